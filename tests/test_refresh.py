"""`fatune db refresh`: stale entries re-timed with today's kernels beside the heuristic (interpreter, CPU)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from fatune.cli import cli
from fatune.db import Entry, TunedDB, is_stale, key_columns
from fatune.kernel.spec import AttentionConfig, LaunchConfig
from fatune.tuning import refresh
from fatune.tuning.refresh import entry_key, entry_shape, refresh_db
from fatune.tuning.shape import Shape, shape_key
from fatune.tuning.target import Target
from fatune.tuning.trials import shape_heuristic

SHIPPED = Path(__file__).parent.parent / "tuned_db" / "nvidia-h200.sqlite"
TUNED = AttentionConfig(fwd=LaunchConfig(32, 16, num_warps=4, num_stages=1),
                        dkdv=LaunchConfig(16, 32, num_warps=4, num_stages=1),
                        dq=LaunchConfig(32, 16, num_warps=4, num_stages=1))
INTERPRETER = Target(torch.device("cpu"), True, "triton-interpreter", "cpu", None)


def entry_for(shape: Shape, config: AttentionConfig = TUNED, gpu: str = "triton-interpreter", capability: str = "cpu",
              template_hash: str = "0123456789abcdef", **changes) -> Entry:
    """An entry as `fatune search` stores one for `shape` (stale: its kernel hash is no kernel's)."""
    entry = Entry(**key_columns(gpu, capability, shape_key(shape), template_hash),
                  fwd_config=config.fwd.to_dict(),
                  bwd_config={"dkdv": config.dkdv.to_dict(), "dq": config.dq.to_dict()},
                  fwd_ms=1.0, bwd_ms=2.0, fwd_bwd_ms=3.0, tflops=1.0, sdpa_backend="cudnn", sdpa_ms=6.0, speedup=2.0,
                  batch=shape.batch, heads=shape.heads, seqlen_q=shape.seqlen_q, seqlen_k=shape.seqlen_k, trials=30,
                  interpreted=gpu == "triton-interpreter", created_at="2026-11-30T00:00:00+00:00")
    return dataclasses.replace(entry, **changes)


SHAPES = [  # what `fatune search` searches: each mask variant, GQA, L_q != L_k, decode
    Shape(4, 16, 4096, 4096, 128, "bfloat16"),
    Shape(2, 32, 8192, 8192, 64, "bfloat16", causal=True, kv_heads=4),
    Shape(8, 16, 2048, 2048, 128, "float16", causal=True, window=256),
    Shape(1, 16, 32768, 32768, 128, "bfloat16", causal=True, window=1024),
    Shape(32, 16, 511, 512, 128, "bfloat16", causal=True, window=1023),  # wider than the keys: alignment only
    Shape(8, 16, 2048, 2048, 128, "bfloat16", valid_keys=0.25),
    Shape(8, 16, 2048, 2048, 64, "bfloat16", causal=True, valid_keys=0.25),
    Shape(2, 16, 8192, 8192, 128, "bfloat16", causal=True, documents=5),
    Shape(2, 16, 8192, 8192, 128, "bfloat16", documents=64),
    Shape(4, 16, 1024, 4096, 128, "bfloat16", causal=True),
    Shape(8, 32, 1, 8192, 128, "bfloat16", kv_heads=8),
    Shape(4, 12, 1000, 1000, 80, "float16", head_dim_v=96),
]


@pytest.mark.parametrize("shape", SHAPES, ids=Shape.label)
def test_an_entrys_problem_is_rebuilt_with_its_key_and_sizes(shape):
    entry = entry_for(shape)
    rebuilt = entry_shape(entry)
    assert rebuilt is not None and shape_key(rebuilt) == entry_key(entry)
    assert rebuilt == shape  # searched at the search's default sizes: the very problem, window and documents too


def test_a_bottom_right_entry_timed_at_equal_lengths_is_rebuilt_one_query_shorter():
    """Such entries predate equal lengths taking the plain call's key (a window wider than the keys at L_q = L_k
    is plain causal now); the shipped DB holds some. Their problem keeps its alignment with one query fewer."""
    wide = Shape(32, 16, 512, 512, 128, "bfloat16", causal=True, window=1024)
    assert shape_key(wide) == shape_key(wide.with_(window=-1))
    old = entry_for(wide.with_(seqlen_q=511, window=1023), seqlen_q=512)
    rebuilt = entry_shape(old)
    assert rebuilt is not None and shape_key(rebuilt) == entry_key(old) and (rebuilt.seqlen_q, rebuilt.seqlen_k) == (511, 512)


def test_a_window_is_rebuilt_narrower_than_its_keys():
    """A user's window of 80 keys at L = 100 (width bucket 128) is timed as a window, not as plain causal."""
    rebuilt = entry_shape(entry_for(Shape(4, 8, 100, 100, 64, "float16", causal=True, window=80)))
    assert rebuilt is not None and 0 <= rebuilt.window < 100


@pytest.mark.parametrize("changes", [
    {"mask_variant": "causal+alibi"}, {"mask_variant": "mask-bool"}, {"mask_variant": "dropout"},
    {"mask_variant": "causal+nonsense"}, {"group_size": 3}, {"heads": 0}, {"seqlen_q_bucket": 64},
    {"batch": 10**12, "seqlen_q_bucket": 4096},  # a key it fits, but inputs too large to time
])
def test_an_entry_no_search_could_have_made_has_no_problem_to_time(changes):
    assert entry_shape(entry_for(SHAPES[0], **changes)) is None


def test_every_shipped_entry_can_be_refreshed():
    """A GPU refresh of the shipped DB times every entry (none skipped for a problem it cannot rebuild)."""
    with TunedDB(SHIPPED, readonly=True) as db:
        entries = list(db.entries())
    assert entries and all(entry_shape(entry) is not None for entry in entries)


TINY = Shape(batch=2, heads=2, seqlen_q=40, seqlen_k=40, head_dim=16, dtype="float16", causal=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter: CPU only")
def test_refresh_re_times_stale_entries_and_leaves_others_alone(tmp_path):
    path = tmp_path / "tuned.sqlite"
    gqa = Shape(batch=1, heads=4, seqlen_q=24, seqlen_k=56, head_dim=16, dtype="float16", kv_heads=2)
    stale, stale_gqa = entry_for(TINY), entry_for(gqa, torch_version="2.0.0")  # a torch version of its own key
    other_gpu = entry_for(TINY.with_(head_dim=32), gpu="NVIDIA H200", capability="9.0")
    current = entry_for(TINY.with_(causal=False))
    current = dataclasses.replace(current, template_hash=current.kernel_hashes())
    with TunedDB(path) as db:
        for entry in (stale, stale_gqa, other_gpu, current):
            db.upsert(entry)
        results = {r.old.describe(): r for r in refresh_db(db, INTERPRETER, rounds=2)}
        after = list(db.entries())
    assert results[other_gpu.describe()].outcome.startswith("skipped: tuned on NVIDIA H200")
    assert results[current.describe()].outcome == "current" and results[current.describe()].new is None
    for old in (stale, stale_gqa):
        result = results[old.describe()]
        assert result.outcome in ("tuned", "heuristic") and result.shape == entry_shape(old)
        assert result.tuned_ms > 0 and result.heuristic_ms > 0
        new = result.new
        assert not is_stale(new) and new.template_hash == new.kernel_hashes() and new.interpreted
        assert new.attention_config() == (TUNED if result.outcome == "tuned" else
                                          shape_heuristic(result.shape, INTERPRETER))
        assert new.fwd_bwd_ms > 0 and new.trials == 30 and new.key()[5:] == old.key()[5:]
    # SDPA's stored time is kept only while torch is the same
    assert results[stale.describe()].new.sdpa_ms == 6.0
    assert math.isnan(results[stale_gqa.describe()].new.sdpa_ms)
    # one entry per key: the stale rows were replaced, the others are as they were
    assert len(after) == 4 and not any(is_stale(e) for e in after if e.gpu == "triton-interpreter")
    assert other_gpu in after and current in after


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter: CPU only")
def test_a_decode_entry_is_refreshed_forward_only(tmp_path):
    decode = Shape(batch=2, heads=4, seqlen_q=1, seqlen_k=72, head_dim=16, dtype="float16", kv_heads=2)
    heuristic = shape_heuristic(decode, INTERPRETER)
    tuned = heuristic.replace(fwd=LaunchConfig(16, 32, num_warps=4, num_stages=1, num_splits=2, pack_gqa=1))
    with TunedDB(tmp_path / "tuned.sqlite") as db:
        db.upsert(entry_for(decode, tuned, bwd_ms=math.nan, fwd_bwd_ms=math.nan))
        (result,) = refresh_db(db, INTERPRETER, rounds=1)
        (entry,) = db.entries()
    assert result.outcome in ("tuned", "heuristic") and not is_stale(entry)
    assert entry.forward_only and entry.fwd_ms > 0 and math.isnan(entry.bwd_ms)
    assert entry.attention_config().fwd == (tuned if result.outcome == "tuned" else heuristic).fwd


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter: CPU only")
def test_stored_configs_that_fail_the_check_give_way_to_the_heuristic(tmp_path, monkeypatch):
    checked = []

    def failing_tuned(shape, config, inputs, checker, backward):
        checked.append(config)
        return "fwd relative error 1 > 0.01" if config == TUNED else ""

    monkeypatch.setattr(refresh, "_check", failing_tuned)
    with TunedDB(tmp_path / "tuned.sqlite") as db:
        db.upsert(entry_for(TINY))
        (result,) = refresh_db(db, INTERPRETER, rounds=1)
        (entry,) = db.entries()
    assert TUNED in checked and result.outcome == "heuristic" and "stored configs failed" in result.note
    assert math.isnan(result.tuned_ms) and entry.attention_config() == shape_heuristic(TINY, INTERPRETER)


def test_the_stored_configs_are_really_checked():
    """The check runs the kernels against torch's result: against another input's reference it fails."""
    from fatune.tuning.shape import make_inputs
    from fatune.tuning.target import Checker

    inputs = make_inputs(TINY, "cpu")
    assert refresh._check(TINY, TUNED, inputs, Checker(TINY, inputs), backward=True) == ""
    other = Checker(TINY, make_inputs(TINY, "cpu", seed=1))
    assert "fwd relative error" in refresh._check(TINY, TUNED, inputs, other, backward=True)
    assert "fwd relative error" in refresh._check(TINY, TUNED, inputs, other, backward=False)


def test_cli_dry_run_lists_and_writes_nothing(tmp_path):
    path = tmp_path / "tuned.sqlite"
    with TunedDB(path) as db:
        db.upsert(entry_for(TINY))
    before = path.read_bytes()
    result = CliRunner().invoke(cli, ["db", "refresh", "--db", str(path), "--dry-run", "--interpret"])
    assert result.exit_code == 0, result.output
    assert f"would refresh on {TINY.label()}" in result.output and "1 would refresh" in result.output
    assert path.read_bytes() == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter: CPU only")
def test_cli_refresh_writes_and_counts(tmp_path):
    path = tmp_path / "tuned.sqlite"
    with TunedDB(path) as db:
        db.upsert(entry_for(TINY))
        db.upsert(entry_for(TINY.with_(head_dim=32), gpu="NVIDIA H200", capability="9.0"))
    result = CliRunner().invoke(cli, ["db", "refresh", "--db", str(path), "--interpret", "--rounds", "1"])
    assert result.exit_code == 0, result.output
    assert "1 skipped" in result.output and ("1 tuned" in result.output or "1 heuristic" in result.output)
    with TunedDB(path, readonly=True) as db:
        assert sum(not is_stale(e) for e in db.entries()) == 1


def test_cli_refresh_names_a_missing_db(tmp_path):
    result = CliRunner().invoke(cli, ["db", "refresh", "--db", str(tmp_path / "none.sqlite"), "--interpret"])
    assert result.exit_code != 0 and "no such file" in result.output


def fixed_times(times: dict[str, float], calls: list | None = None):
    """A stand-in for refresh._time: `times` by config ('tuned' is TUNED, anything else the heuristic)."""
    def timed(shape, config, inputs, target, backward):
        if calls is not None:
            calls.append(config)
        ms = times["tuned" if config == TUNED else "heuristic"]
        return ms, {"fwd_ms": ms / 3, "bwd_ms": 2 * ms / 3, "fwd_bwd_ms": ms}
    return timed


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter: CPU only")
@pytest.mark.parametrize("tuned_ms, heuristic_ms, winner", [(1.0, 2.0, "tuned"), (2.0, 1.0, "heuristic"),
                                                            (1.5, 1.5, "tuned")])
def test_the_faster_config_is_stored_and_a_tie_keeps_the_stored_one(tmp_path, monkeypatch, tuned_ms, heuristic_ms,
                                                                    winner):
    monkeypatch.setattr(refresh, "_time", fixed_times({"tuned": tuned_ms, "heuristic": heuristic_ms}))
    with TunedDB(tmp_path / "tuned.sqlite") as db:
        db.upsert(entry_for(TINY))
        (result,) = refresh_db(db, INTERPRETER, rounds=3)
        (entry,) = db.entries()
    assert result.outcome == winner and (result.tuned_ms, result.heuristic_ms) == (tuned_ms, heuristic_ms)
    assert entry.attention_config() == (TUNED if winner == "tuned" else shape_heuristic(TINY, INTERPRETER))
    assert entry.fwd_bwd_ms == min(tuned_ms, heuristic_ms) and not is_stale(entry)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter: CPU only")
def test_a_current_entry_of_the_key_stays_whatever_its_time(tmp_path, monkeypatch):
    """A search since the stale entry (here under another torch, so another key) wrote a current entry: refresh
    neither times the stale one nor replaces the current one (even a slow one: it timed another problem)."""
    calls = []
    monkeypatch.setattr(refresh, "_time", fixed_times({"tuned": 0.1, "heuristic": 0.1}, calls))
    window = TINY.with_(window=16)
    stale = entry_for(window, torch_version="2.0.0")
    searched = entry_for(window, fwd_bwd_ms=10.0, created_at="2026-12-01T00:00:00+00:00")
    searched = dataclasses.replace(searched, template_hash=searched.kernel_hashes())
    with TunedDB(tmp_path / "tuned.sqlite") as db:
        db.upsert(stale)
        db.upsert(searched)
        (result,) = [r for r in refresh_db(db, INTERPRETER) if r.old == stale]
        after = list(db.entries())
    assert result.outcome == "superseded" and result.new is None and not calls
    assert after == [searched]


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter: CPU only")
def test_an_entry_that_cannot_be_timed_is_skipped_and_the_run_goes_on(tmp_path, monkeypatch):
    # too big to allocate (its times what such a problem would take: a faster one is refused as forged)
    huge = entry_for(SHAPES[0], batch=10**12, fwd_ms=1e11, bwd_ms=2e11, fwd_bwd_ms=3e11, sdpa_ms=6e11)
    broken = entry_for(TINY.with_(head_dim=8))
    fine = entry_for(TINY)
    original = refresh.refresh_entry

    def failing(entry, *args, **kwargs):
        if entry.head_dim == 8:
            raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")
        return original(entry, *args, **kwargs)

    monkeypatch.setattr(refresh, "refresh_entry", failing)
    with TunedDB(tmp_path / "tuned.sqlite") as db:
        for entry in (huge, broken, fine):
            db.upsert(entry)
        results = {r.old.describe(): r for r in refresh_db(db, INTERPRETER, rounds=1)}
        after = {e.describe(): e for e in db.entries()}
    assert results[huge.describe()].outcome == refresh.UNBUILT
    assert results[broken.describe()].outcome == "skipped: RuntimeError: CUDA error: an illegal memory access " \
                                                 "was encountered"
    assert results[fine.describe()].outcome in ("tuned", "heuristic")
    assert after[huge.describe()] == huge and after[broken.describe()] == broken  # left as they were
    assert not is_stale(after[fine.describe()])


def test_cli_refresh_warns_about_invalid_rows(tmp_path):
    from tests.test_db import raw_insert

    path = tmp_path / "tuned.sqlite"
    with TunedDB(path) as db:
        db.upsert(entry_for(TINY))
    raw_insert(path, fwd_ms=-1.0, head_dim=32)
    result = CliRunner().invoke(cli, ["db", "refresh", "--db", str(path), "--dry-run",
                                     "--interpret"])
    assert result.exit_code == 0 and "invalid entry" in result.stderr and "fwd_ms" in result.stderr
    assert "1 would refresh" in result.stdout


def current_entry(shape: Shape, **changes) -> Entry:
    entry = entry_for(shape, **changes)
    return dataclasses.replace(entry, template_hash=entry.kernel_hashes())


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter: CPU only")
@pytest.mark.parametrize("tuned_ms, heuristic_ms, winner", [(1.0, 2.0, "tuned"), (2.0, 1.0, "heuristic")])
def test_all_re_times_current_entries_beside_todays_heuristic(tmp_path, monkeypatch, tuned_ms, heuristic_ms, winner):
    """After a heuristic change (`--include-current`): a current entry is timed again and the faster written in
    its place, its own row not taken for a newer entry of its key; without it the entry stays untouched."""
    monkeypatch.setattr(refresh, "_time", fixed_times({"tuned": tuned_ms, "heuristic": heuristic_ms}))
    entry = current_entry(TINY)
    with TunedDB(tmp_path / "tuned.sqlite") as db:
        db.upsert(entry)
        assert [r.outcome for r in refresh_db(db, INTERPRETER)] == ["current"]
        (result,) = refresh_db(db, INTERPRETER, current_too=True)
        (after,) = db.entries()
    assert result.outcome == winner and after.fwd_bwd_ms == min(tuned_ms, heuristic_ms) and not is_stale(after)
    assert after.attention_config() == (TUNED if winner == "tuned" else shape_heuristic(TINY, INTERPRETER))


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter: CPU only")
def test_cli_refresh_all_of_one_gqa_group(tmp_path, monkeypatch):
    """`--include-current --group 2`: the current entries of GQA group 2 only; the others are neither timed nor
    listed."""
    monkeypatch.setattr(refresh, "_time", fixed_times({"tuned": 2.0, "heuristic": 1.0}))
    path = tmp_path / "tuned.sqlite"
    gqa = current_entry(TINY.with_(heads=4, kv_heads=2))
    with TunedDB(path) as db:
        for entry in (gqa, current_entry(TINY), entry_for(TINY.with_(heads=8, kv_heads=2))):
            db.upsert(entry)
    result = CliRunner().invoke(cli, ["db", "refresh", "--db", str(path), "--interpret", "--include-current",
                                      "--group", "2"])
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1] == "1 heuristic", result.output
    with TunedDB(path, readonly=True) as db:
        rows = {e.group_size: e for e in db.entries()}
    assert rows[2].fwd_bwd_ms == 1.0 and rows[1] == current_entry(TINY) and is_stale(rows[4])


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter: CPU only")
def test_a_search_writing_the_same_kernels_meanwhile_keeps_its_entry(tmp_path, monkeypatch):
    """With `include_current`, a search may store the very same configs (same key and kernel hash) while the
    entry is timed: its newer row stays, and the refresh drops nothing else."""
    entry = current_entry(TINY)
    searched = dataclasses.replace(entry, fwd_bwd_ms=0.5, created_at="2026-12-02T00:00:00+00:00")
    timings = fixed_times({"tuned": 2.0, "heuristic": 2.0})
    with TunedDB(tmp_path / "tuned.sqlite") as db:
        db.upsert(entry)

        def timed_while_a_search_writes(*args):
            db.upsert(searched)
            return timings(*args)

        monkeypatch.setattr(refresh, "_time", timed_while_a_search_writes)
        (result,) = refresh_db(db, INTERPRETER, current_too=True)
        after = list(db.entries())
    assert result.outcome == "superseded" and after == [searched]


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter: CPU only")
def test_a_superseded_row_with_no_creation_time_is_dropped_too(tmp_path, monkeypatch):
    """A row written by another tool with a NULL created_at (read back as "") still goes when superseded."""
    import sqlite3

    monkeypatch.setattr(refresh, "_time", fixed_times({"tuned": 0.1, "heuristic": 0.1}))
    path = tmp_path / "tuned.sqlite"
    window = TINY.with_(window=16)
    stale = entry_for(window, torch_version="2.0.0")
    searched = current_entry(window, created_at="2026-12-01T00:00:00+00:00")
    with TunedDB(path) as db:
        db.upsert(stale)
        db.upsert(searched)
    with sqlite3.connect(path) as connection:
        connection.execute("update entries set created_at = null where torch_version = '2.0.0'")
    with TunedDB(path) as db:
        (result,) = [r for r in refresh_db(db, INTERPRETER) if r.outcome != "current"]
        after = list(db.entries())
    assert result.outcome == "superseded" and after == [searched]


def test_cli_refresh_interpret_without_the_variable_set_times_in_the_interpreter(tmp_path):
    """`--interpret` in a shell where TRITON_INTERPRET is not set: the command starts again with it set, so the
    interpreter times the entry (the kernels would find no driver otherwise)."""
    import os
    import subprocess
    import sys

    path = tmp_path / "tuned.sqlite"
    with TunedDB(path) as db:
        db.upsert(entry_for(Shape(1, 1, 16, 16, 16, "float16")))  # one tile: the interpreter takes a second
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "fatune.cli", "db", "refresh", "--db", str(path), "--interpret",
                             "--rounds", "1"], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] in ("1 tuned", "1 heuristic"), result.stdout
    with TunedDB(path, readonly=True) as db:
        (entry,) = db.entries()
    assert not is_stale(entry) and entry.interpreted


BROKEN = entry_for(TINY.with_(head_dim=8))  # its refresh raises (fails_on_head_dim_8)
REFRESH_EXITS = [  # (id, entries, exit code, the last line of the output)
    ("every-one-failed", [BROKEN], 1, "Error: re-timed none of the 1 entry to refresh: 1 skipped: RuntimeError: 0 "
                                      "active drivers ([]). There should only be one."),
    ("failed-beside-a-current-one", [BROKEN, current_entry(TINY)], 1, "Error: re-timed none of the 1 entry"),
    ("every-one-of-another-gpu", [entry_for(TINY.with_(head_dim=d), gpu="NVIDIA H200", capability="9.0")
                                  for d in (16, 32)], 1,
     "Error: re-timed none of the 2 entries to refresh: 2 skipped: tuned on NVIDIA H200 (sm 9.0); refresh it there"),
    ("no-problem-to-time", [entry_for(TINY, mask_variant="causal+alibi")], 1,
     f"Error: re-timed none of the 1 entry to refresh: 1 {refresh.UNBUILT}"),
    ("one-failed-one-done", [BROKEN, entry_for(TINY)], 0, "1 heuristic, 1 skipped"),
    ("nothing-stale", [current_entry(TINY), current_entry(TINY, gpu="NVIDIA H200", capability="9.0")], 0,
     "1 current, 1 skipped"),
    ("no-entries", [], 0, "no entries"),
]


@pytest.mark.parametrize("entries, code, last", [case[1:] for case in REFRESH_EXITS], ids=[c[0] for c in REFRESH_EXITS])
def test_cli_refresh_that_re_times_no_entry_it_had_to_fails(tmp_path, monkeypatch, entries, code, last):
    """A refresh whose entries to re-time (stale ones, any GPU's) were all skipped or failed leaves them stale: exit
    1 with why; one with nothing stale to re-time succeeds."""
    original = refresh.refresh_entry

    def fails_on_head_dim_8(entry, *args, **kwargs):
        if entry.head_dim == 8:
            raise RuntimeError("0 active drivers ([]). There should only be one.")
        return original(entry, *args, **kwargs)

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # no restart: the kernels are not run here
    monkeypatch.setattr(refresh, "refresh_entry", fails_on_head_dim_8)
    monkeypatch.setattr(refresh, "_check", lambda *args: "")
    monkeypatch.setattr(refresh, "_time", fixed_times({"tuned": 2.0, "heuristic": 1.0}))
    path = tmp_path / "tuned.sqlite"
    with TunedDB(path) as db:
        for entry in entries:
            db.upsert(entry)
    result = CliRunner().invoke(cli, ["db", "refresh", "--db", str(path), "--interpret", "--rounds", "1"])
    assert result.exit_code == code and isinstance(result.exception, (SystemExit, type(None))), result.output
    assert "Traceback" not in result.output and result.output.splitlines()[-1].startswith(last), result.output


def test_cli_dry_run_of_entries_it_cannot_time_succeeds(tmp_path):
    path = tmp_path / "tuned.sqlite"
    with TunedDB(path) as db:
        db.upsert(entry_for(TINY, gpu="NVIDIA H200", capability="9.0"))
    result = CliRunner().invoke(cli, ["db", "refresh", "--db", str(path), "--interpret", "--dry-run"])
    assert result.exit_code == 0 and result.output.splitlines()[-1] == "1 skipped", result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter: CPU only")
def test_adopting_re_times_another_gpus_entries_as_this_gpus(tmp_path, monkeypatch):
    """With `adopt`, an entry tuned on another GPU (current there) is timed here beside the heuristic, torch's SDPA
    backends are timed here for it (a route is this GPU's decision), and it is written as this GPU's entry in its
    row's place. A window entry (a size no entry stores) times no SDPA backend; this GPU's current entry stays."""
    sdpa_timed = []
    monkeypatch.setattr(refresh, "_time", fixed_times({"tuned": 2.0, "heuristic": 1.0}))
    monkeypatch.setattr(refresh, "sdpa_best", lambda shape, inputs, target: sdpa_timed.append(shape) or ("flash", 1.5))
    h200 = current_entry(TINY, gpu="NVIDIA H200", capability="9.0")
    window = current_entry(TINY.with_(window=16), gpu="NVIDIA H200", capability="9.0")
    mine = current_entry(TINY.with_(head_dim=32))
    with TunedDB(tmp_path / "tuned.sqlite") as db:
        for entry in (h200, window, mine):
            db.upsert(entry)
        outcomes = {r.old.describe(): r.outcome for r in refresh_db(db, INTERPRETER, rounds=1, adopt=True)}
        after = list(db.entries())
    assert outcomes == {h200.describe(): "heuristic", window.describe(): "heuristic", mine.describe(): "current"}
    assert [e.gpu for e in after] == ["triton-interpreter"] * 3 and not any(is_stale(e) for e in after)
    adopted = {e.sized: e for e in after if e.head_dim == 16}
    assert (adopted[True].sdpa_backend, adopted[True].sdpa_ms) == ("flash", 1.5) and sdpa_timed == [TINY]
    assert adopted[False].sdpa_backend == "" and math.isnan(adopted[False].sdpa_ms)
    assert entry_key(adopted[True]) == entry_key(h200) and adopted[True].attention_config() == \
        shape_heuristic(TINY, INTERPRETER)


def test_cli_refresh_adopt_writes_this_gpus_entries_and_fails_when_none_could_be(tmp_path, monkeypatch):
    """`fatune db refresh --adopt` turns another GPU's entries into this one's; one whose every adoption failed
    exits 1 saying why (without --adopt the same DB is skipped: see REFRESH_EXITS)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # no restart: the kernels are not run here
    monkeypatch.setattr(refresh, "_check", lambda *args: "")
    monkeypatch.setattr(refresh, "_time", fixed_times({"tuned": 2.0, "heuristic": 1.0}))
    monkeypatch.setattr(refresh, "sdpa_best", lambda shape, inputs, target: ("", math.nan))
    path = tmp_path / "tuned.sqlite"
    with TunedDB(path) as db:
        db.upsert(current_entry(TINY, gpu="NVIDIA H200", capability="9.0"))
        db.upsert(current_entry(TINY, gpu="NVIDIA H200", capability="9.0", mask_variant="causal+alibi"))
    result = CliRunner().invoke(cli, ["db", "refresh", "--db", str(path), "--interpret", "--rounds", "1", "--adopt"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == "1 heuristic, 1 skipped", result.output
    with TunedDB(path, readonly=True) as db:
        assert sorted(e.gpu for e in db.entries()) == ["NVIDIA H200", "triton-interpreter"]
    result = CliRunner().invoke(cli, ["db", "refresh", "--db", str(path), "--interpret", "--rounds", "1", "--adopt"])
    assert result.exit_code == 1 and result.output.splitlines()[-1] == \
        f"Error: re-timed none of the 1 entry to refresh: 1 {refresh.UNBUILT}", result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_cli_dry_run_of_adopt_without_the_gpu_lists_every_entry(tmp_path):
    """Without a GPU a dry run cannot tell which entries are another GPU's: with --adopt it lists each entry's
    problem (or why it has none) and writes nothing."""
    path = tmp_path / "tuned.sqlite"
    with TunedDB(path) as db:
        db.upsert(current_entry(TINY, gpu="NVIDIA H200", capability="9.0"))
        db.upsert(current_entry(TINY, gpu="NVIDIA H200", capability="9.0", mask_variant="causal+alibi"))
    before = path.read_bytes()
    result = CliRunner().invoke(cli, ["db", "refresh", "--db", str(path), "--adopt", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert f"would refresh on {TINY.label()}" in result.output, result.output
    assert result.output.splitlines()[-1] == "1 skipped, 1 would refresh", result.output
    assert path.read_bytes() == before
