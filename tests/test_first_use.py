"""Tuning on first use: switched on by fatune.autotune or $FATUNE_AUTOTUNE, never where it cannot time (the CPU,
the interpreter, torch.compile, CUDA-graph capture), once per call signature; on a GPU, the first call of a new
key stores the faster of fatune's built-in configs and SDPA's backends, which later calls use."""

from __future__ import annotations

import logging
import re
import time

import pytest
import torch

import fatune
from fatune import logs
from fatune.call import check_inputs
from fatune.db import TunedDB
from fatune.runtime import plans
from fatune.tuning import first_use
from tests.conftest import DEVICE


@pytest.fixture
def autotuning(monkeypatch):
    monkeypatch.setattr(first_use, "_enabled", None)
    monkeypatch.setattr(first_use, "_tried", set())
    yield
    first_use._enabled = None
    plans.clear()


@pytest.mark.parametrize("value, on", [("1", True), ("TRUE", True), (" on ", True), ("yes", True), ("0", False),
                                       ("", False), ("maybe", False)])
def test_the_environment_switch(monkeypatch, autotuning, value, on):
    monkeypatch.setenv("FATUNE_AUTOTUNE", value)
    assert first_use.enabled() is on
    fatune.autotune(not on)  # the call overrides the environment
    assert first_use.enabled() is (not on)


def test_autotune_takes_a_bool_by_name():
    with pytest.raises(TypeError, match="^enabled: expected True or False"):
        fatune.autotune("yes")


@pytest.mark.parametrize("kwargs, covered", [
    ({}, True), ({"is_causal": True}, True), ({"is_causal": True, "causal_alignment": "bottom_right"}, True),
    ({"is_causal": True, "window_size": (8, 0)}, False), ({"dropout_p": 0.1}, False),
    ({"attn_mask": torch.ones(16, 24, dtype=torch.bool)}, False),
])
def test_the_calls_first_use_tuning_covers(kwargs, covered):
    q, k = torch.randn(2, 4, 16, 32), torch.randn(2, 2, 24, 32)
    shape = first_use.shape_of(check_inputs(q, k, k, enable_gqa=True, **kwargs))
    assert (shape is not None) == covered
    if covered:
        assert (shape.batch, shape.heads, shape.kv_heads, shape.seqlen_q, shape.seqlen_k, shape.head_dim) == \
            (2, 4, 2, 16, 24, 32)


def test_nothing_is_tuned_where_nothing_can_be_timed(autotuning, monkeypatch):
    """On this CPU (Triton's interpreter) an enabled autotune leaves calls as they were, and decides so once per
    call signature."""
    fatune.autotune(True)
    tried = []
    monkeypatch.setattr(first_use, "tune", lambda *args: tried.append(args) or True)
    q = torch.randn(1, 2, 24, 16, device=DEVICE, dtype=torch.float16)
    expected = fatune.attention(q, q, q, is_causal=True, config=fatune.explain(q, q, q, is_causal=True).decision.config)
    assert torch.equal(fatune.attention(q, q, q, is_causal=True), expected)
    prepared = plans.prepare_plain(q, q, q, 0.0, True, None, False, (-1, -1), None, None, None, None, None)
    assert prepared.settled and not tried


@pytest.mark.gpu
def test_gpu_the_first_call_of_a_new_key_stores_the_faster_and_later_calls_use_it(autotuning, tmp_path,
                                                                                 monkeypatch, caplog):
    from fatune.runtime.dispatch import Dispatcher
    from tests.conftest import use_dispatcher

    monkeypatch.setenv("FATUNE_DB", str(tmp_path / "tuned.sqlite"))
    # no shipped DB either: on an H200 its entry of this key would answer before tuning on first use
    use_dispatcher(monkeypatch, Dispatcher(user_db=tmp_path / "tuned.sqlite", shipped=[]))
    monkeypatch.setattr(logs, "_warned", set())
    plans.clear()
    fatune.autotune(True)
    q, k, v = (torch.randn(3, 16, 1536, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    assert fatune.explain(q, k, v, is_causal=True).decision.layer == "heuristic"
    fatune.attention(q, k, v, is_causal=True).sum().backward()  # compiles the heuristic's kernels
    first_use._tried.clear()
    plans.clear()
    with caplog.at_level(logging.WARNING, logger="fatune"):
        started = time.perf_counter()
        fatune.attention(q, k, v, is_causal=True).sum().backward()
        seconds = time.perf_counter() - started
    said = [r.message for r in caplog.records if "on first use" in r.message]
    assert len(said) == 1, [r.message for r in caplog.records]
    with TunedDB(tmp_path / "tuned.sqlite") as db:
        (entry,) = db.entries()
    assert not entry.forward_only and entry.trials >= 2 and entry.sdpa_backend
    explained = fatune.explain(q, k, v, is_causal=True)
    assert explained.decision.layer == "user-db"
    assert explained.backend == (f"sdpa-{entry.route()}" if entry.route() else explained.decision.config.family)
    print(f"first-use tuning, the call included: {seconds:.2f} s; {said[0]}")
    total, compiles = (float(x) for x in re.search(r"in ([\d.]+) s \(compiles ([\d.]+) s;", said[0]).groups())
    assert total - compiles <= 0.5  # timing the candidates, compiles apart (the Gluon forward's among them)


def test_a_key_is_tried_once_whatever_its_lengths(autotuning, monkeypatch):
    """Tuning that stored nothing (a DB it cannot write, say) is not tried again for every new length of the same
    tuned-DB key (a decode loop's growing cache)."""
    tried = []
    monkeypatch.setattr(first_use, "_tune", lambda shape, *args: tried.append(shape.seqlen_k) or False)
    q = torch.randn(1, 2, 1, 16)
    for length in (100, 101, 102, 120):
        k = torch.randn(1, 2, length, 16)
        first_use.tune(check_inputs(q, k, k), q, k, k, False, fatune.attention)
    assert tried == [100]


def test_the_timed_steps_stay_out_of_the_users_activation_checkpointing(autotuning, monkeypatch):
    """A first call inside torch.utils.checkpoint (non-reentrant): the tuner's own training steps must not be
    saved into the checkpoint's frame, or the user's backward fails ("a different number of tensors was saved")."""
    def timed_step(*args):
        x = torch.randn(8, requires_grad=True)
        (x * x).sum().backward()
        return False

    monkeypatch.setattr(first_use, "_tune", timed_step)

    def block(x):
        y = x.sin()
        first_use.tune(check_inputs(*(torch.randn(1, 2, 8, 16),) * 3), *(torch.randn(1, 2, 8, 16),) * 3, True,
                       fatune.attention)
        return y.cos()

    x = torch.randn(4, requires_grad=True)
    torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).sum().backward()
    torch.testing.assert_close(x.grad, -torch.sin(x.sin()) * torch.cos(x))


def test_tuning_a_key_stores_its_fastest_candidate_and_says_where_the_time_went(autotuning, monkeypatch, tmp_path,
                                                                               caplog):
    """The whole of one key's tuning, its timings stood in for (the CPU cannot time): the fastest candidate goes to
    the user DB, and the one log line splits the seconds into builds, timing and the rest."""
    from fatune.tuning.target import Target

    monkeypatch.setenv("FATUNE_DB", str(tmp_path / "user.sqlite"))
    monkeypatch.setattr(logs, "_warned", set())
    interpreter = Target(torch.device("cpu"), True, "triton-interpreter", "cpu", None)
    monkeypatch.setattr(first_use.Target, "detect", staticmethod(lambda interpret: interpreter))
    steps = iter([3.0, 2.0, 4.0])

    def timed(attention, inputs, warmup_ms, rep_ms):
        step = next(steps)
        return {"fwd_ms": step / 3, "bwd_ms": 2 * step / 3, "fwd_bwd_ms": step, "compile_s": 0.25}

    monkeypatch.setattr(first_use, "time_training_step", timed)
    q, k, v = (torch.randn(1, 2, 64, 16, dtype=torch.float16, device=DEVICE) for _ in range(3))
    problem = check_inputs(q, k, v, is_causal=True)
    with caplog.at_level(logging.WARNING, logger="fatune"):
        assert first_use._tune(first_use.shape_of(problem), problem, q, k, v, True, fatune.attention)
    (said,) = [r.message for r in caplog.records if "on first use" in r.message]
    found = re.search(r"in ([\d.]+) s \(compiles ([\d.]+) s; timing fatune's configs \((\d+)\) and SDPA's backends "
                      r"(-?[\d.]+) s, the rest ([\d.]+) s\)", said)
    assert found, said
    total, compiles, configs, timing, rest = (float(x) for x in found.groups())
    assert compiles == 0.25 * configs and abs(total - compiles - timing - rest) <= 0.02
    with TunedDB(tmp_path / "user.sqlite") as db:
        (entry,) = db.entries()
    assert entry.fwd_bwd_ms == min([3.0, 2.0, 4.0][:int(configs)])
