"""The dispatcher's layers, nearest-bucket fallback, stale-entry skipping, explain and strict mode,
and bad DBs: logged once, the next layer answers, strict mode raises."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import sqlite3
import threading
import time

import pytest
import torch

import fatune
from fatune import hardware, logs
from fatune.call import check_inputs
from fatune.db import TunedDB, shipped_dbs
from fatune.kernel.spec import AttentionConfig, LaunchConfig
from fatune.kernel.triton.heuristics import default_config
from fatune.kernel.triton.resolve import resolve
from fatune.runtime import dispatch
from fatune.runtime.dispatch import Dispatcher, DispatchError
from fatune.runtime.plans import clear
from tests.conftest import DEVICE, run_together, use_dispatcher
from tests.test_db import make_entry, raw_insert, write_bad_db

GPU, CAPABILITY = hardware.device_identity(torch.device(DEVICE))


def problem(seqlen=4096, causal=True, head_dim=64, dtype=torch.float16):
    q = torch.empty(1, 4, seqlen, head_dim, dtype=dtype, device="meta")
    return check_inputs(q, q, q, is_causal=causal)


def entry(**changes):
    return make_entry(**{"gpu": GPU, "capability": CAPABILITY, "dtype": "float16", **changes})


def fwd_block(decision) -> int:
    return decision.config.fwd.block_m


def write(path, *entries):
    with TunedDB(path) as db:
        for e in entries:
            db.upsert(e)
    return path


def test_lookup_order_user_then_shipped_then_heuristic(tmp_path):
    user = write(tmp_path / "user.sqlite", entry(fwd_config={**make_entry().fwd_config, "block_m": 16}))
    shipped = write(tmp_path / "shipped.sqlite", entry(fwd_config={**make_entry().fwd_config, "block_m": 32}))
    both = Dispatcher(user_db=user, shipped=[shipped]).lookup(problem(), GPU, CAPABILITY, None)
    assert (both.layer, fwd_block(both), both.db_path) == ("user-db", 16, str(user))
    only_shipped = Dispatcher(user_db=tmp_path / "missing.sqlite", shipped=[shipped]).lookup(problem(), GPU, CAPABILITY,
                                                                                               None)
    assert (only_shipped.layer, fwd_block(only_shipped)) == ("shipped-db", 32)
    none = Dispatcher(user_db=tmp_path / "missing.sqlite", shipped=[]).lookup(problem(), GPU, CAPABILITY, None)
    assert none.layer == "heuristic" and none.config == default_config(problem().spec, None)
    forced = AttentionConfig(LaunchConfig(16, 16), LaunchConfig(16, 16), LaunchConfig(16, 16))
    assert Dispatcher(user_db=user).decide(problem(), torch.device(DEVICE), forced).layer == "argument"


def test_other_gpu_dtype_or_mask_does_not_match(tmp_path):
    path = write(tmp_path / "u.sqlite", entry(gpu="Other GPU"), entry(dtype="bfloat16"), entry(mask_variant="none"))
    decision = Dispatcher(user_db=path, shipped=[]).lookup(problem(), GPU, CAPABILITY, None)
    assert decision.layer == "heuristic"


def test_nearest_bucket_on_a_log_scale(tmp_path):
    rows = [entry(seqlen_q_bucket=n, seqlen_k_bucket=n, fwd_config={**make_entry().fwd_config, "block_m": b})
            for n, b in ((512, 16), (4096, 32), (16384, 64))]
    path = write(tmp_path / "u.sqlite", *rows)
    chooser = Dispatcher(user_db=path, shipped=[])
    assert fwd_block(chooser.lookup(problem(4096), GPU, CAPABILITY, None)) == 32
    near_small = chooser.lookup(problem(1000), GPU, CAPABILITY, None)  # bucket 1024: 1 octave from 512
    assert fwd_block(near_small) == 16 and "nearest bucket" in near_small.reason
    assert fwd_block(chooser.lookup(problem(30000), GPU, CAPABILITY, None)) == 64


@pytest.mark.parametrize("lower_ms, upper_ms", [(1.0, 9.0), (9.0, 1.0)])
def test_a_tie_between_buckets_goes_to_the_lower_whatever_their_times(tmp_path, lower_ms, upper_ms):
    """L = 1024 is one octave from 512 and from 2048: entries of different buckets timed different problems, so
    their stored times do not decide (a smaller problem is always faster)."""
    rows = [entry(seqlen_q_bucket=n, seqlen_k_bucket=n, fwd_bwd_ms=ms, fwd_config={**make_entry().fwd_config,
                                                                                  "block_m": b})
            for n, b, ms in ((512, 16, lower_ms), (2048, 32, upper_ms))]
    chooser = Dispatcher(user_db=write(tmp_path / "u.sqlite", *rows), shipped=[])
    assert fwd_block(chooser.lookup(problem(1024), GPU, CAPABILITY, None)) == 16


@pytest.mark.parametrize("routed", [512, 2048])
def test_a_tie_between_buckets_goes_to_the_entry_routed_to_sdpa(tmp_path, routed):
    """L = 1024 between an entry whose kernels beat SDPA at its length and one where SDPA's backend won: the call
    takes SDPA's route (at worst as fast as SDPA), on either side, with that entry's configs as its kernels'."""
    rows = [entry(seqlen_q_bucket=n, seqlen_k_bucket=n, fwd_bwd_ms=1.0, sdpa_backend="cudnn",
                  sdpa_ms=0.9 if n == routed else 1.1, fwd_config={**make_entry().fwd_config, "block_m": b})
            for n, b in ((512, 16), (2048, 32))]
    chooser = Dispatcher(user_db=write(tmp_path / "u.sqlite", *rows), shipped=[])
    decision = chooser.lookup(problem(1024), GPU, CAPABILITY, None)
    assert (decision.route, fwd_block(decision)) == ("cudnn", 16 if routed == 512 else 32)
    exact = chooser.lookup(problem(512 if routed == 2048 else 2048), GPU, CAPABILITY, None)
    assert exact.route == ""  # an exact bucket's own entry decides


def test_a_tie_between_buckets_goes_to_a_tuned_backward_before_a_route(tmp_path):
    """A forward-only entry (its backward untuned) that routes loses a tie to one with a tuned backward."""
    rows = [entry(seqlen_q_bucket=512, seqlen_k_bucket=512, fwd_ms=1.0, bwd_ms=math.nan, fwd_bwd_ms=math.nan,
                  sdpa_backend="cudnn", sdpa_ms=0.5, fwd_config={**make_entry().fwd_config, "block_m": 16}),
            entry(seqlen_q_bucket=2048, seqlen_k_bucket=2048, fwd_config={**make_entry().fwd_config, "block_m": 32})]
    assert rows[0].forward_only and rows[0].route() == "cudnn" and not rows[1].route()
    chooser = Dispatcher(user_db=write(tmp_path / "u.sqlite", *rows), shipped=[])
    assert fwd_block(chooser.lookup(problem(1024), GPU, CAPABILITY, None)) == 32


def test_a_tie_between_buckets_across_lq_and_lk_goes_to_the_smaller_problem(tmp_path):
    """A call at Lq 4096, Lk 512 is three octaves from (1024, 1024) and from (4096, 64): the smaller problem wins."""
    rows = [entry(seqlen_q_bucket=q, seqlen_k_bucket=k, fwd_config={**make_entry().fwd_config, "block_m": b})
            for q, k, b in ((1024, 1024, 16), (4096, 64, 32))]
    chooser = Dispatcher(user_db=write(tmp_path / "u.sqlite", *rows), shipped=[])
    q = torch.empty(1, 4, 4096, 64, dtype=torch.float16, device="meta")
    k = torch.empty(1, 4, 512, 64, dtype=torch.float16, device="meta")
    assert fwd_block(chooser.lookup(check_inputs(q, k, k, is_causal=True), GPU, CAPABILITY, None)) == 32


PREFILL = {"seqlen_q_bucket": 4096, "fwd_config": {**make_entry().fwd_config, "block_m": 128}}
DECODE = {"seqlen_q_bucket": 16, "fwd_config": {**make_entry().fwd_config, "block_m": 32},
          "bwd_ms": math.nan, "fwd_bwd_ms": math.nan}


@pytest.mark.parametrize("seqlen_q, rows, expected", [
    (1, [PREFILL], None),  # a prefill tile would leave a decode call's rows nearly empty: the decode heuristic
    (16, [PREFILL, DECODE], 32),
    (1, [DECODE], 32),
    (17, [DECODE], None),  # a decode entry's untuned backward does not serve longer queries
    (64, [PREFILL, DECODE], 128),
])
def test_decode_and_prefill_entries_serve_only_their_own_calls(tmp_path, seqlen_q, rows, expected):
    path = write(tmp_path / "u.sqlite", *(entry(seqlen_k_bucket=4096, **row) for row in rows))
    q = torch.empty(1, 4, seqlen_q, 64, dtype=torch.float16, device="meta")
    k = torch.empty(1, 4, 4096, 64, dtype=torch.float16, device="meta")
    decision = Dispatcher(user_db=path, shipped=[]).lookup(check_inputs(q, k, k, is_causal=True), GPU, CAPABILITY, None)
    assert (decision.layer, fwd_block(decision) if expected else None) == \
        (("user-db", expected) if expected else ("heuristic", None))


@pytest.mark.parametrize("kv_heads, causal, concurrent", [(2, True, 1), (16, True, 0), (2, False, 0)])
def test_the_heuristic_knows_the_calls_gqa_group(tmp_path, kv_heads, causal, concurrent):
    """The heuristic answers with the call's GQA group: causal GQA at d128 runs its dQ kernel beside dK/dV."""
    q = torch.empty(2, 16, 1024, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(2, kv_heads, 1024, 128, dtype=torch.bfloat16, device="meta")
    call = check_inputs(q, k, k, is_causal=causal, enable_gqa=True)
    decision = Dispatcher(user_db=tmp_path / "none.sqlite", shipped=[]).lookup(call, GPU, CAPABILITY, (9, 0))
    assert decision.layer == "heuristic" and decision.config.dq.concurrent == concurrent


@pytest.mark.parametrize("batch, stages", [(1, 4), (4, 4), (7, 4), (8, 2), (16, 2)])
def test_the_decode_heuristic_streams_deeper_with_one_program_per_multiprocessor(tmp_path, monkeypatch, batch,
                                                                                   stages):
    """A decode call's tiles (here one per sequence: 4 query heads packed over one K/V head) against the
    interpreter's 4 multiprocessors: up to 7 programs (split keys, or at most one or two per multiprocessor)
    stream 4 stages deep; from 8, every multiprocessor has two programs to interleave, 2 stages. Batch sizes
    share a DB key, so each regime gets its own memoised decision."""
    monkeypatch.setattr(dispatch, "device_arch", lambda device: (9, 0))
    chooser = Dispatcher(user_db=tmp_path / "missing.sqlite", shipped=[])
    q = torch.empty(batch, 4, 1, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(batch, 1, 8192, 128, dtype=torch.bfloat16, device="meta")
    decode = check_inputs(q, k, k, enable_gqa=True)
    decision = chooser.decide(decode, torch.device("cpu"))
    assert decision.layer == "heuristic" and decision.config.fwd.block_m == 16
    assert decision.config.fwd.num_stages == stages
    assert chooser.lookup(decode, GPU, CAPABILITY, (9, 0), sms=4).config == decision.config


STALE_KERNELS = "fwd:feedfacefeedface,bwd:feedfacefeedface"


def test_stale_entries_are_skipped_and_the_next_answers(tmp_path, caplog):
    """An entry of another Triton version, or whose kernels changed since it was measured, is skipped when the DB
    is read (one line per file and kind): a current entry of a farther bucket answers, else the next layer (a
    user DB's stale entries, after an upgrade, must not hide the shipped DB's current ones)."""
    stale = entry(template_hash=STALE_KERNELS, seqlen_q_bucket=64, seqlen_k_bucket=64)
    other_triton = entry(triton_version="0.0.1", seqlen_q_bucket=128, seqlen_k_bucket=128)
    farther = entry(fwd_config={**make_entry().fwd_config, "block_m": 16}, seqlen_q_bucket=512, seqlen_k_bucket=512)
    shipped = write(tmp_path / "shipped.sqlite", entry(seqlen_q_bucket=64, seqlen_k_bucket=64))
    user = write(tmp_path / "u.sqlite", stale, other_triton)
    with caplog.at_level(logging.WARNING, logger="fatune"):
        first = Dispatcher(user_db=user, shipped=[shipped]).lookup(problem(), GPU, CAPABILITY, None)
        Dispatcher(user_db=user, shipped=[shipped]).lookup(problem(), GPU, CAPABILITY, None)
    assert first.layer == "shipped-db" and len(first.skipped) == 2 and "changed since" in first.describe()
    assert len([r for r in caplog.records if "not used" in r.message]) == 2
    with TunedDB(user) as db:
        db.upsert(farther)
    nearer = Dispatcher(user_db=user, shipped=[shipped]).lookup(problem(), GPU, CAPABILITY, None)
    assert nearer.layer == "user-db" and nearer.config.fwd.block_m == 16


def _copies(path, row_changes: list[dict]) -> None:
    """Copies of the DB's one row past fatune's checks, each with its changes."""
    connection = sqlite3.connect(path)
    connection.row_factory = sqlite3.Row
    row = dict(connection.execute("select * from entries").fetchone())
    columns = [name for name in row if name != "id"]
    connection.executemany(f"insert into entries ({', '.join(columns)}) values ({', '.join('?' * len(columns))})",
                           [[changes.get(name, row[name]) for name in columns] for changes in row_changes])
    connection.commit()
    connection.close()


def test_a_db_of_many_stale_rows_for_one_key_costs_one_line_and_little_time(tmp_path):
    """A DB holding thousands of rows of one key whose kernels have all changed (crafted, or shipped as is) is read
    in about linear time, one line saying how many were skipped (it took quadratic time, a minute at 16,000 rows,
    with a line per row); a current entry behind them still answers. Only the first 16 configs are rendered."""
    user = write(tmp_path / "u.sqlite", entry(template_hash=STALE_KERNELS, seqlen_q_bucket=64, seqlen_k_bucket=64))
    _copies(user, [{"template_hash": f"fwd:{n:016x}"} for n in range(5000)])
    start = time.perf_counter()
    decision = Dispatcher(user_db=user, shipped=[]).lookup(problem(), GPU, CAPABILITY, None)
    assert time.perf_counter() - start < 10
    assert decision.layer == "heuristic" and list(decision.skipped) == [
        f"{user}: 5001 entries measured with kernels that have changed since are not used; `fatune db refresh` "
        f"re-times them on this GPU (`fatune db list` shows them)"], decision.skipped

    with TunedDB(user) as db:
        db.upsert(entry(fwd_config={**make_entry().fwd_config, "block_m": 16}, seqlen_q_bucket=512,
                        seqlen_k_bucket=512))
    decision = Dispatcher(user_db=user, shipped=[]).lookup(problem(), GPU, CAPABILITY, None)
    assert decision.layer == "user-db" and decision.config.fwd.block_m == 16


def test_a_key_of_many_stale_configs_renders_sixteen(tmp_path):
    """Each config's kernels are rendered once to tell whether they changed: past 16 stale configs of one key the
    next layer answers, said so."""
    user = write(tmp_path / "u.sqlite", entry(template_hash=STALE_KERNELS, seqlen_q_bucket=64, seqlen_k_bucket=64))
    configs = [{**make_entry().fwd_config, "block_m": block_m, "num_stages": stages} for block_m in (16, 32, 64)
               for stages in (1, 2, 3, 4, 5, 6, 7)]
    _copies(user, [{"fwd_config": json.dumps(config), "template_hash": f"fwd:{n:016x}"}
                   for n, config in enumerate(configs)])
    decision = Dispatcher(user_db=user, shipped=[]).lookup(problem(), GPU, CAPABILITY, None)
    assert decision.layer == "heuristic" and "16 or more entries measured with kernels that have changed" in \
        decision.skipped[0], decision.skipped


def test_stale_kernels_are_caught_where_they_launch_too(tmp_path, caplog, monkeypatch):
    """Should an entry whose kernels changed reach a launch (rendered since the lookup, say), the launch finds it:
    the call runs the heuristic's config, said once, with the heuristic's result."""
    from fatune.db import store

    path = write(tmp_path / "u.sqlite", entry(template_hash=STALE_KERNELS, seqlen_q_bucket=64, seqlen_k_bucket=64))
    monkeypatch.setattr(store, "is_stale", lambda entry, render=True: [])  # the lookup renders nothing
    monkeypatch.setenv("FATUNE_DB", str(path))
    monkeypatch.setattr(logs, "_warned", set())
    clear()
    try:
        q, k, v = (torch.randn(1, 4, 48, 64, dtype=torch.float16, device=DEVICE) for _ in range(3))
        with caplog.at_level(logging.WARNING, logger="fatune"):
            out = fatune.attention(q, k, v, is_causal=True)
        assert any("changed since" in r.message for r in caplog.records), [r.message for r in caplog.records]
        expected = fatune.attention(q, k, v, is_causal=True, config=default_config(problem().spec, None))
        assert torch.equal(out, expected)
    finally:
        clear()


def test_decisions_are_memoised_per_process(tmp_path, monkeypatch):
    path = write(tmp_path / "u.sqlite", entry())
    chooser = Dispatcher(user_db=path, shipped=[])
    device = torch.device(DEVICE)
    first = chooser.decide(problem(), device)
    monkeypatch.setattr(dispatch.Dispatcher, "lookup", lambda *a: pytest.fail("looked up twice"))
    assert chooser.decide(problem(), device) is first


def test_concurrent_first_calls_agree(tmp_path):
    path = write(tmp_path / "u.sqlite", entry())
    chooser = Dispatcher(user_db=path, shipped=[])
    results = []
    threads = [threading.Thread(target=lambda: results.append(chooser.decide(problem(), torch.device(DEVICE))))
               for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 8 and all(r is results[0] for r in results) and results[0].layer == "user-db"


def test_strict_mode_refuses_the_heuristic(tmp_path):
    chooser = Dispatcher(user_db=tmp_path / "none.sqlite", shipped=[])
    with pytest.raises(fatune.DispatchError, match="strict"):  # the README's name for it
        chooser.decide(problem(), torch.device(DEVICE), strict=True)


def test_explain_reports_layer_config_and_source(tmp_path, monkeypatch):
    path = write(tmp_path / "u.sqlite", entry(seqlen_q_bucket=64, seqlen_k_bucket=64))
    use_dispatcher(monkeypatch, Dispatcher(user_db=path, shipped=[]))
    q = torch.randn(1, 4, 50, 64, dtype=torch.float16, device=DEVICE)
    explanation = fatune.explain(q, q, q, is_causal=True)
    assert explanation.decision.layer == "user-db" and explanation.decision.db_path == str(path)
    assert set(explanation.sources) == {"fwd", "bwd"} and "user-db" in str(explanation)
    heuristic = fatune.explain(q, q, q)  # non-causal: no entry
    assert heuristic.decision.layer == "heuristic"
    forced = AttentionConfig(LaunchConfig(16, 16), LaunchConfig(16, 16), LaunchConfig(16, 16))
    assert fatune.explain(q, q, q, config=forced).decision.layer == "argument"
    with pytest.raises(DispatchError):
        fatune.attention(q, q, q, strict=True)


# -- a DB that cannot be used costs speed, never the call ----------------------------------------

BAD_DBS = ["directory", "garbage", "empty", "foreign", "newer", "invalid-entry", "null-config", "negative-time",
           "stale"]


@pytest.mark.parametrize("kind", BAD_DBS)
def test_a_bad_user_db_is_logged_once_and_the_next_layer_answers(tmp_path, caplog, kind):
    user = write_bad_db(tmp_path / "user.sqlite", kind, gpu=GPU, capability=CAPABILITY, dtype="float16")
    shipped = write(tmp_path / "shipped.sqlite", entry(fwd_config={**make_entry().fwd_config, "block_m": 32}))
    with caplog.at_level(logging.WARNING, logger="fatune"):
        decision = Dispatcher(user_db=user, shipped=[shipped]).lookup(problem(), GPU, CAPABILITY, None)
        again = Dispatcher(user_db=user, shipped=[shipped]).lookup(problem(), GPU, CAPABILITY, None)
    assert (decision.layer, fwd_block(decision)) == ("shipped-db", 32) and again.layer == "shipped-db"
    logged = [r.getMessage() for r in caplog.records if str(user) in r.getMessage()]
    assert len(logged) == 1, logged  # once per process, naming the file
    assert decision.skipped == (logged[0],)
    alone = Dispatcher(user_db=user, shipped=[])
    assert alone.decide(problem(), torch.device(DEVICE)).layer == "heuristic"
    with pytest.raises(DispatchError, match=re.escape(str(user))):
        Dispatcher(user_db=user, shipped=[shipped]).decide(problem(), torch.device(DEVICE), strict=True)


def test_a_bad_fatune_db_variable_is_named(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("FATUNE_DB", str(tmp_path))  # a directory
    with caplog.at_level(logging.WARNING, logger="fatune"):
        decision = Dispatcher(shipped=[]).lookup(problem(), GPU, CAPABILITY, None)
    assert decision.layer == "heuristic" and "$FATUNE_DB" in decision.skipped[0]
    assert any("$FATUNE_DB" in r.getMessage() for r in caplog.records)


def test_a_corrupt_user_db_still_gives_the_right_result(tmp_path, monkeypatch):
    """Through fatune.attention: the call runs (heuristic config) and matches torch."""
    user = write_bad_db(tmp_path / "user.sqlite", "invalid-entry")
    raw_insert(user, gpu=GPU, capability=CAPABILITY, dtype="float32", head_dim=16, head_dim_v=16,
                seqlen_q_bucket=32, seqlen_k_bucket=32, mask_variant="none", bwd_config='{"dkdv": null}')
    use_dispatcher(monkeypatch, Dispatcher(user_db=user, shipped=[]))
    q, k, v = (torch.randn(1, 2, 24, 16, device=DEVICE) for _ in range(3))
    out = fatune.attention(q, k, v)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert torch.allclose(out, expected, atol=1e-5)
    decision = fatune.explain(q, k, v).decision
    assert decision.layer == "heuristic" and "bwd_config" in decision.skipped[0]


def _failing_builds(monkeypatch, failing: str, before_raising=None) -> list:
    """Make every kernel whose name starts with `failing` fail to build at 3 stages (a tuned entry's, below;
    the interpreter's heuristic runs 1): KernelBuildError at its first launch. Returns the launches that ran
    (one at a time: Triton's interpreter runs one kernel per process at once)."""
    from fatune.kernel.triton import launch

    monkeypatch.setattr(logs, "_warned", set())  # said once per process: these tests count the saying
    original = launch.KernelLaunch.__call__
    ran, one_at_a_time = [], threading.Lock()

    def call(self, slots, stream):
        name = self.fn.fn.__name__
        if name.startswith(failing) and self.options["num_stages"] == 3:
            if before_raising is not None:
                before_raising()
            raise launch.KernelBuildError(f"{name}: RuntimeError: PassManager::run failed")
        with one_at_a_time:
            ran.append((name, self.options["num_stages"]))
            return original(self, slots, stream)

    monkeypatch.setattr(launch.KernelLaunch, "__call__", call)
    return ran


def _assert_matches_sdpa(q, k, v, out, grads):
    golden = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = torch.nn.functional.scaled_dot_product_attention(*golden, is_causal=True)
    expected_grads = torch.autograd.grad(expected, golden, torch.ones_like(expected))
    assert torch.allclose(out.double(), expected, atol=2e-3)
    assert all(torch.allclose(g.double(), e, atol=2e-2) for g, e in zip(grads, expected_grads))


def _two_causal_steps(caplog, failures: int = 1) -> tuple[torch.Tensor, ...]:
    """Two causal training steps at L=100 (matching SDPA), the first meeting `failures` build failures, each said
    once."""
    q, k, v = (torch.randn(1, 4, 100, 64, dtype=torch.float16, device=DEVICE, requires_grad=True) for _ in range(3))
    with caplog.at_level(logging.WARNING, logger="fatune"):
        for _ in range(2):
            out = fatune.attention(q, k, v, is_causal=True)
            grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    _assert_matches_sdpa(q, k, v, out, grads)
    logged = [r.getMessage() for r in caplog.records if "cannot be built" in r.getMessage()]
    assert len(logged) == failures and all("PassManager" in line for line in logged), logged
    return q, k, v


@pytest.mark.parametrize("failing", ["attn_fwd", "attn_bwd"])
def test_a_tuned_config_whose_kernels_cannot_be_built_here_runs_the_heuristic(tmp_path, monkeypatch, caplog, failing):
    """A valid entry whose kernels Triton cannot build on this GPU (a compiler error, more shared memory than
    it has: KernelBuildError at their first launch) costs speed: the heuristic's kernels run, said once."""
    # every kernel at 3 stages; 100 rows and keys: more than one tile of each (a loop that runs once is unpipelined)
    path = write(tmp_path / "u.sqlite", entry(seqlen_q_bucket=128, seqlen_k_bucket=128))
    use_dispatcher(monkeypatch, Dispatcher(user_db=path, shipped=[]))
    ran = _failing_builds(monkeypatch, failing)
    q, k, v = _two_causal_steps(caplog)
    assert any(name.startswith(failing) and stages == 1 for name, stages in ran)  # the heuristic's ran instead
    assert any(name.startswith("attn_fwd") and stages == (1 if failing == "attn_fwd" else 3) for name, stages in ran)
    explanation = fatune.explain(q, k, v, is_causal=True)
    assert explanation.decision.layer == "user-db" and "cannot be built" in explanation.reason
    assert explanation.launched.fwd.num_stages == 1


@pytest.mark.parametrize("failing", ["attn_fwd", "attn_bwd_dq"])
@pytest.mark.parametrize("layer", ["heuristic", "tuned entry: the heuristic's config", "tuned entry, then the heuristic"])
def test_heuristic_kernels_that_cannot_be_built_run_unpipelined(tmp_path, monkeypatch, caplog, failing, layer):
    """The heuristic's own kernels cannot be built here (ptxas 13 crashed on a pipelined dQ), whether it
    is the first config tried (no tuned entry, or an entry that is the heuristic's config) or the fallback of a
    tuned entry that cannot be built either: its tiles run at one stage without a register cap; the call answers,
    each failure said once."""
    from fatune.kernel.triton import heuristics

    pipelined = heuristics.INTERPRETER_CONFIG.replace(
        **{kernel: dataclasses.replace(getattr(heuristics.INTERPRETER_CONFIG, kernel), num_stages=3)
           for kernel in ("fwd", "dkdv", "dq")})
    pipelined = pipelined.replace(dq=dataclasses.replace(pipelined.dq, maxnreg=128))
    monkeypatch.setattr(heuristics, "heuristic_config", lambda *args, **kwargs: pipelined)
    tuned = {"heuristic": None, "tuned entry, then the heuristic": entry(seqlen_q_bucket=128, seqlen_k_bucket=128),
             "tuned entry: the heuristic's config": entry(
                 seqlen_q_bucket=128, seqlen_k_bucket=128, fwd_config=pipelined.fwd.to_dict(),
                 bwd_config={"dkdv": pipelined.dkdv.to_dict(), "dq": pipelined.dq.to_dict()})}[layer]
    use_dispatcher(monkeypatch, Dispatcher(user_db=write(tmp_path / "u.sqlite", tuned) if tuned else None, shipped=[]))
    if tuned is None:
        monkeypatch.setattr(dispatch.Dispatcher, "_layers", lambda self, report: [])
    else:
        assert (tuned.attention_config() == pipelined) == (layer == "tuned entry: the heuristic's config")
    ran = _failing_builds(monkeypatch, failing)  # any kernel of `failing` at 3 stages
    q, k, v = _two_causal_steps(caplog, failures=2 if layer == "tuned entry, then the heuristic" else 1)
    assert {stages for name, stages in ran if name.startswith(failing)} == {1}
    explanation = fatune.explain(q, k, v, is_causal=True)
    assert explanation.decision.layer == ("heuristic" if tuned is None else "user-db")
    assert "cannot be built" in explanation.reason
    assert explanation.launched == heuristics.unpipelined(explanation.launched)


def test_a_loop_that_runs_once_is_not_pipelined():
    """A kernel whose streamed loop has one tile runs at one stage (nothing to overlap, and ptxas crashed on
    dQ's pipelined single-key loop): the forward and dQ by keys, dK/dV by queries."""
    from fatune.kernel.triton import heuristics

    config = AttentionConfig(LaunchConfig(64, 64, num_stages=3), LaunchConfig(32, 128, num_stages=3),
                             LaunchConfig(128, 64, num_stages=3, maxnreg=128))
    cases = [((100, 100), (3, 3, 3)), ((100, 64), (1, 3, 1)), ((1, 1), (1, 1, 1)), ((32, 100), (3, 1, 3)),
             ((33, 65), (3, 3, 3))]
    for (seqlen_q, seqlen_k), stages in cases:
        q = torch.randn(1, 2, seqlen_q, 64, dtype=torch.float16, device=DEVICE)
        k = torch.randn(1, 2, seqlen_k, 64, dtype=torch.float16, device=DEVICE)
        problem = fatune.call.Call().check(q, k, k)
        resolved = resolve(config, problem, q.device, (q, k, k))
        got = (resolved.fwd.num_stages, resolved.dkdv.num_stages, resolved.dq.num_stages)
        assert got == stages, (seqlen_q, seqlen_k, got)
        assert resolved.dq.maxnreg == 128
    # packed: one token against the caller's bound of 256 (the kernels' L_Q = L_K = 1)
    q = torch.randn(1, 2, 64, dtype=torch.float16, device=DEVICE)
    cu = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    problem = fatune.call.Call(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=256, max_seqlen_k=256).check(q, q, q)
    resolved = resolve(config, problem, q.device, (q, q, q))
    assert (resolved.fwd.num_stages, resolved.dkdv.num_stages, resolved.dq.num_stages) == (1, 1, 1)
    assert heuristics.unpipelined(config).dq == LaunchConfig(128, 64, num_stages=1)


@pytest.mark.gpu
@pytest.mark.parametrize("fwd, dq, must_fall_back", [
    # 6 stages of 128x128 K and V tiles: more shared memory than an H200 has (OutOfResources when loaded)
    ({"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 6}, None, True),
    # Triton 3.6 cannot compile this dQ tile at d128 for sm_90 (TritonGPURemoveLayoutConversions: "operand #0
    # does not dominate this use", met by a search for the shipped DB); a later Triton may, and then it simply runs
    (None, {"block_m": 128, "block_n": 16, "num_warps": 4, "num_stages": 2}, False),
], ids=["shared-memory", "triton-3.6-dq"])
def test_gpu_a_tuned_config_that_cannot_be_built_runs_the_heuristic(tmp_path, monkeypatch, caplog, fwd, dq,
                                                                      must_fall_back):
    """A user DB entry whose kernels this GPU cannot build: the call runs, within the accuracy rule."""
    from tests.reference import random_qkv, run_and_compare

    base = make_entry()
    bad = entry(dtype="bfloat16", head_dim=128, head_dim_v=128, mask_variant="none", seqlen_q_bucket=1024,
                seqlen_k_bucket=1024, fwd_config=fwd or base.fwd_config,
                bwd_config={"dkdv": {"block_m": 64, "block_n": 128, "num_warps": 8, "num_stages": 2},
                            "dq": dq or base.bwd_config["dq"]})
    use_dispatcher(monkeypatch, Dispatcher(user_db=write(tmp_path / "u.sqlite", bad), shipped=[]))
    monkeypatch.setattr(logs, "_warned", set())
    q, k, v = random_qkv(2, 4, 4, 1000, 1000, 128, 128, torch.bfloat16, DEVICE)
    with caplog.at_level(logging.WARNING, logger="fatune"):
        run_and_compare(q, k, v)
    explanation = fatune.explain(q, k, v)
    assert explanation.decision.layer == "user-db"
    fell_back = any("cannot be built" in r.getMessage() for r in caplog.records)
    assert fell_back == ("cannot be built" in explanation.reason)
    assert fell_back or not must_fall_back


def test_threads_that_share_a_plan_whose_kernels_cannot_be_built_all_fall_back(tmp_path, monkeypatch):
    """Two threads whose first calls both meet the build failure (one plan, cached): one switches the plan,
    the other sees it switched and runs on it; neither call fails."""
    path = write(tmp_path / "u.sqlite", entry(seqlen_q_bucket=128, seqlen_k_bucket=128))
    use_dispatcher(monkeypatch, Dispatcher(user_db=path, shipped=[]))
    both_failing = threading.Barrier(2, timeout=30)
    _failing_builds(monkeypatch, "attn_fwd", before_raising=both_failing.wait)
    q, k, v = (torch.randn(1, 4, 100, 64, dtype=torch.float16, device=DEVICE) for _ in range(3))
    fatune.explain(q, k, v, is_causal=True)  # the plan, cached before either thread starts
    results, errors = [None, None], []

    def call(index):
        try:
            results[index] = fatune.attention(q, k, v, is_causal=True)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert all(torch.allclose(r, expected, atol=2e-3) for r in results)


CONCURRENT_CALLS = [  # (query length, key length, kwargs): plain, causal, a bool mask (its span scan launches too)
    (64, 64, {}), (33, 48, {"is_causal": True}), (17, 96, {"attn_mask": "bool"}), (64, 40, {"enable_gqa": True})]


def test_calls_from_several_threads_at_once_are_all_right():
    """Threads launching at once, each its own calls (Triton's interpreter keeps one grid per process: overlapping
    launches failed or ran with another's grid until they were made to take turns; a GPU runs them as they come)."""
    def draw(index: int):
        lq, lk, kwargs = CONCURRENT_CALLS[index % len(CONCURRENT_CALLS)]
        generator = torch.Generator().manual_seed(index)
        heads_kv = 1 if kwargs.get("enable_gqa") else 2
        q = torch.randn(1, 2, lq, 32, generator=generator).to(DEVICE, torch.float16)
        k, v = (torch.randn(1, heads_kv, lk, 32, generator=generator).to(DEVICE, torch.float16) for _ in range(2))
        if kwargs.get("attn_mask") == "bool":
            kwargs = {"attn_mask": (torch.rand(lq, lk, generator=generator) < 0.7).to(DEVICE)}
        return q, k, v, kwargs

    for index in range(len(CONCURRENT_CALLS)):  # kernels built first: the launches, not the builds, overlap
        fatune.attention(*draw(index)[:3], **draw(index)[3])
    start = threading.Barrier(6, timeout=60)
    failures = []

    def calls(thread: int):
        start.wait()
        for index in range(thread, thread + 8):
            q, k, v, kwargs = draw(index)
            try:
                out = fatune.attention(q, k, v, **kwargs)
                expected = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                                            **kwargs)
                if not torch.allclose(out.double(), expected, atol=2e-3):
                    failures.append(f"call {index}: max error {(out.double() - expected).abs().max().item():.3g}")
            except Exception as error:  # noqa: BLE001 - reported below
                failures.append(f"call {index}: {type(error).__name__}: {error}")

    run_together(calls, 6, timeout=300)
    assert failures == []


def test_strict_mode_raises_when_the_tuned_kernels_cannot_be_built(tmp_path, monkeypatch):
    """strict=True promises the tuned entry or an error: no quiet fallback past it."""
    from fatune.kernel.triton import launch

    path = write(tmp_path / "u.sqlite", entry(seqlen_q_bucket=128, seqlen_k_bucket=128))
    use_dispatcher(monkeypatch, Dispatcher(user_db=path, shipped=[]))
    _failing_builds(monkeypatch, "attn_fwd")
    q = torch.randn(1, 4, 100, 64, dtype=torch.float16, device=DEVICE)
    with pytest.raises(launch.KernelBuildError, match="PassManager"):
        fatune.attention(q, q, q, is_causal=True, strict=True)


def test_a_plan_keeps_no_call_data_alive(tmp_path):
    """A cached plan keeps its problem's optional tensors as meta tensors (shapes and strides), not the
    call's mask, slopes or index tensors."""
    q = torch.randn(1, 2, 20, 16, dtype=torch.float16, device=DEVICE)
    mask = torch.rand(1, 1, 20, 20, device=DEVICE) > 0.3
    mask[..., 0] = True
    fatune.attention(q, q, q, attn_mask=mask)
    plan = fatune.runtime.plans.prepare(q, q, q, fatune.call.Call(attn_mask=mask), None, None).plan
    kept = plan.problem.attn_mask
    assert kept.device.type == "meta" and tuple(kept.shape) == (1, 2, 20, 20) and kept.stride() == (400, 0, 20, 1)


def test_a_forced_config_whose_kernels_cannot_be_built_raises(monkeypatch):
    """A config passed by hand has no fallback: its build error reaches the caller."""
    from fatune.kernel.triton import launch

    def build(self, slots, stream):
        raise launch.KernelBuildError("attn_fwd: OutOfResources: shared memory")

    monkeypatch.setattr(launch.KernelLaunch, "__call__", build)
    q = torch.randn(1, 2, 20, 16, dtype=torch.float16, device=DEVICE)
    forced = AttentionConfig(LaunchConfig(16, 16), LaunchConfig(16, 16), LaunchConfig(16, 16))
    with pytest.raises(launch.KernelBuildError, match="OutOfResources"):
        fatune.attention(q, q, q, config=forced)


class _Loaded:
    """What Triton's run(warmup=True) returns: a compiled kernel whose `run` loads it (and may fail)."""

    def __init__(self, load_error):
        self.load_error = load_error

    @property
    def run(self):
        if self.load_error:
            raise self.load_error
        return None


@pytest.mark.parametrize("compile_error, load_error, launch_error, raised", [
    (RuntimeError("PassManager::run failed\nreproducer ..."), None, None, r"RuntimeError: PassManager::run failed$"),
    (None, RuntimeError("out of resources: shared memory, Required: 300000"), None, "out of resources"),
    (None, None, ValueError("a launch's own error"), None),  # built: what the launch raises passes unchanged
])
def test_a_kernel_that_cannot_be_compiled_or_loaded_is_a_build_error(monkeypatch, compile_error, load_error,
                                                                      launch_error, raised):
    """Compiled kernels (not the interpreter): the first launch builds the kernel apart (compile, then load
    against the GPU's limits), and a failure there is a KernelBuildError naming the kernel and its options."""
    from fatune.kernel.triton import launch

    class Kernel:
        __name__ = "attn_bwd_dq"

        def run(self, *args, warmup, **kwargs):
            if warmup:
                if compile_error:
                    raise compile_error
                return _Loaded(load_error)
            raise launch_error

    monkeypatch.setattr(launch, "interpreting", lambda: False)
    kernel = launch.KernelLaunch.__new__(launch.KernelLaunch)
    for name, value in {"fn": Kernel(), "grid": (1, 1, 1), "options": {"num_warps": 4, "num_stages": 2},
                        "pick": lambda slots: (), "tail": (), "binary": None, "direct": None, "middle": (),
                        "scratch": 0, "tma": False}.items():
        setattr(kernel, name, value)
    if raised is None:
        with pytest.raises(ValueError, match="a launch's own error"):
            kernel((), None)
        return
    with pytest.raises(launch.KernelBuildError, match=r"^attn_bwd_dq with .*'num_stages': 2.*" + raised):
        kernel((), None)


SHIPPED_GPUS = {"nvidia-h100.sqlite": "NVIDIA H100 80GB HBM3", "nvidia-h200.sqlite": "NVIDIA H200"}
SHIPPED_CALLS = [  # (seqlen, kwargs of check_inputs): what each shipped DB covers, lengths between buckets
    (4096, {"is_causal": True}),
    (3000, {}),
    (600, {"is_causal": True, "window_size": (256, 0)}),
    (20000, {"seqlens_k": "half"}),
    (20000, {"is_causal": True, "seqlens_k": "half"}),
]


def test_the_shipped_dbs_are_in_the_package_and_valid():
    shipped = shipped_dbs()
    assert sorted(path.name for path in shipped) == sorted(SHIPPED_GPUS)
    for path in shipped:
        assert path.read_bytes()[18:20] == b"\x01\x01", f"{path.name}: ship it in rollback-journal mode (no -wal/-shm)"
        with TunedDB(path, readonly=True) as db:
            entries = list(db.entries(on_invalid=pytest.fail))
        assert len(entries) >= 90 and all((e.gpu, e.capability) == (SHIPPED_GPUS[path.name], "9.0") for e in entries)


@pytest.mark.parametrize("name", sorted(SHIPPED_GPUS))
@pytest.mark.parametrize("seqlen, kwargs", SHIPPED_CALLS)
def test_the_shipped_dbs_answer_their_gpus_calls(tmp_path, name, seqlen, kwargs):
    """A call on each GPU finds its own DB in the package with no user DB (that its entries are current for these
    templates: tests/test_packaging.py)."""
    q = torch.empty(2, 16, seqlen, 128, dtype=torch.bfloat16, device="meta")
    if kwargs.get("seqlens_k") == "half":
        kwargs = {**kwargs, "seqlens_k": torch.full((2,), seqlen // 2, dtype=torch.int32, device="meta")}
    decision = Dispatcher(user_db=tmp_path / "none.sqlite", shipped=shipped_dbs()).lookup(
        check_inputs(q, q, q, **kwargs), SHIPPED_GPUS[name], "9.0", None)
    assert decision.layer == "shipped-db" and decision.db_path.endswith(name), decision
