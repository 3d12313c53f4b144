"""Tiny interpreter searches: DB rows, resuming, pruning, rejecting wrong kernels, reproducibility;
concurrent searches and resuming after Ctrl-C or a kill (subprocesses)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections import deque

import optuna
import pytest
import torch
from click.testing import CliRunner

import fatune
from fatune.cli import cli
from fatune.db import TunedDB
from fatune.db.keys import seqlen_bucket
from fatune.kernel import codegen as loader
from fatune.kernel.spec import KERNELS, KernelSpec, LaunchConfig
from fatune.kernel.triton import codegen
from fatune.runtime import plans
from fatune.tuning import search, study, trials
from fatune.tuning import target as targets
from fatune.tuning.precompile import CompilePool
from fatune.tuning.search import search_shape
from fatune.tuning.shape import Shape, make_inputs
from fatune.tuning.space import INTERPRETER_SPACE, SearchSpace, infeasible, make_config, trial_budget
from fatune.tuning.storage import default_storage_url, open_storage
from fatune.tuning.target import Target

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter searches: CPU only")
TINY = Shape(batch=1, heads=1, seqlen_q=32, seqlen_k=32, head_dim=16, dtype="float16", causal=True)


def interpreter_target(shared_limit=None) -> Target:
    return Target(torch.device("cpu"), True, "triton-interpreter", "cpu", shared_limit)


def test_cli_search_creates_the_default_dbs_folder(tmp_path, monkeypatch):
    """On a new machine ~/.cache/fatune does not exist yet: the DB and its Optuna storage beside it go there."""
    monkeypatch.setenv("FATUNE_DB", str(tmp_path / "new" / "folders" / "tuned.sqlite"))
    result = CliRunner().invoke(cli, ["search", "--head-dim", "16", "--dtype", "fp16", "--interpret", "--lengths",
                                      "24", "--batch", "1", "--heads", "1", "--mask", "none", "--trials", "1"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "new" / "folders" / "tuned.sqlite").is_file()
    assert (tmp_path / "new" / "folders" / "tuned.optuna.sqlite").is_file()


@pytest.mark.parametrize("cost, wait", [(0.001, 1.0), (0.25, 12.5), (5.0, 30.0)])
def test_the_progress_bar_spends_at_most_a_small_share_counting_trials(cost, wait):
    """Counting a search's finished trials reads every trial of its studies (a quarter second once they hold
    hundreds): the bar counts again PROGRESS_S after a cheap count, after 1 / PROGRESS_SHARE times a costly one's
    cost, and never later than PROGRESS_MAX_S (a count slowed once, behind another host's lock, does not freeze
    the bar). Each shape's result forces a count besides (the CLI's refresh(force=True))."""
    from fatune.cli.search import CountThrottle

    now = [100.0]
    throttle = CountThrottle(lambda: now[0])
    assert throttle.due()
    with throttle.counting():
        now[0] += cost
    now[0] += wait - 0.01
    assert not throttle.due()
    now[0] += 0.02
    assert throttle.due()


def test_cli_search_writes_db_rows_with_the_right_keys(tmp_path):
    db_path = tmp_path / "tuned.sqlite"
    result = CliRunner().invoke(cli, ["search", "--head-dim", "16", "--dtype", "fp16", "--interpret", "--lengths",
                                      "24", "--heads", "1", "--mask", "causal", "--trials", "3", "--db", str(db_path),
                                      "--json"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.output[result.output.index("["):])
    assert row["interpreted"] and row["fwd_bwd_ms"] > 0 and set(row["config"]) == {"fwd", "dkdv", "dq"}
    with TunedDB(db_path, readonly=True) as db:
        (entry,) = db.entries()
    assert (entry.gpu, entry.dtype, entry.head_dim, entry.mask_variant, entry.seqlen_q_bucket) == \
        ("triton-interpreter", "float16", 16, "causal", 32)
    assert entry.template_hash == entry.kernel_hashes() and entry.interpreted and entry.trials == 9
    assert entry.attention_config().to_dict() == row["config"]
    # where the wall time went: every phase, none negative, and all of them make up the shape's wall time
    breakdown = row["breakdown"]
    assert set(breakdown) == {*search.SHAPE_PHASES, "other"} and min(breakdown.values()) >= 0
    assert breakdown["build"] > 0 and breakdown["ask"] > 0 and breakdown["reference"] > 0
    assert sum(breakdown.values()) == pytest.approx(row["seconds"] + breakdown["db"], rel=1e-3)
    # and each trial's own phases, as its user attr
    storage = default_storage_url(db_path)
    for summary in optuna.get_all_study_summaries(storage):
        for trial in optuna.load_study(study_name=summary.study_name, storage=storage).trials:
            seconds = trial.user_attrs["seconds"]
            assert seconds["ask"] > 0 and set(seconds) <= set(search.TRIAL_PHASES)
            if trial.user_attrs.get("rejected") not in ("infeasible", "compile_error"):
                assert seconds["build"] > 0 and seconds["quick"] > 0


def test_search_resumes_from_its_storage(tmp_path):
    storage = f"sqlite:///{tmp_path / 'studies.sqlite'}"
    search_shape(TINY, interpreter_target(), trials=2, seconds=600, storage=storage, seed=0, space=INTERPRETER_SPACE)
    result = search_shape(TINY, interpreter_target(), trials=3, seconds=600, storage=storage, seed=0,
                          space=INTERPRETER_SPACE)
    assert result.trials == 9  # 3 per kernel in all: the 2 done before were kept, 1 more each
    names = {s.study_name for s in optuna.get_all_study_summaries(storage)}
    assert len(names) == 3 and all(name.endswith((":fwd", ":dkdv", ":dq")) for name in names)


def test_impossible_configs_are_pruned_before_compiling(tmp_path):
    spec = KernelSpec("float16", 128)
    assert infeasible("fwd", spec, LaunchConfig(128, 128, 8, 5), 227 * 1024) is not None
    assert infeasible("fwd", spec, LaunchConfig(16, 16, 8, 1), 227 * 1024) is not None  # too many warps
    assert infeasible("fwd", spec, LaunchConfig(64, 64, 4, 3), 227 * 1024) is None
    # a head-dim split's dK/dV programs each hold half the accumulators
    wide = KernelSpec("bfloat16", 256)
    assert infeasible("dkdv", wide, LaunchConfig(32, 128, 4, 1), 227 * 1024) is not None
    assert infeasible("dkdv", wide, LaunchConfig(32, 128, 4, 1, split_d=2), 227 * 1024) is None
    space = SearchSpace(block_m=(32, 128), block_n=(32, 128), num_warps=(4,), num_stages=(1, 4), num_splits=(0, 2))
    result = search_shape(TINY, interpreter_target(shared_limit=24 * 1024), trials=8, seconds=600,
                          storage=f"sqlite:///{tmp_path / 's.sqlite'}", seed=1, space=space)
    assert result.rejected.get("infeasible", 0) > 0
    for kernel in ("fwd", "dkdv", "dq"):
        assert infeasible(kernel, TINY.spec, getattr(result.config, kernel), 24 * 1024) is None


def test_a_wrong_kernel_never_wins(tmp_path, monkeypatch):
    """Configs with BLOCK_N = 16 get a broken softmax; they are fast enough but must be rejected."""
    original = codegen.render

    def render(kind, spec, config):
        source = original(kind, spec, config)
        if kind == "fwd" and config.fwd.block_n == 16:
            source = source.replace("l_i = l_i * alpha + tl.sum(p, 1)", "l_i = l_i * alpha + 2.0 * tl.sum(p, 1)")
        return source

    monkeypatch.setattr(codegen, "render", render)
    monkeypatch.setattr(loader, "_modules", {})
    monkeypatch.setattr(codegen, "source_key", lambda kind, spec, config: f"wrong-{kind}-"
                        + hashlib.sha256(config.to_json().encode()).hexdigest()[:20])  # a file name of its own
    space = SearchSpace(block_m=(16, 32), block_n=(16, 32), num_warps=(4,), num_stages=(1,), num_splits=(0, 2))
    result = search_shape(TINY, interpreter_target(), trials=6, seconds=600,
                          storage=f"sqlite:///{tmp_path / 's.sqlite'}", seed=3, space=space)
    assert result.config.fwd.block_n == 32
    assert result.rejected.get("wrong_result", 0) >= 1


def test_same_seed_same_trial_sequence(tmp_path):
    def params(run: int):
        storage = f"sqlite:///{tmp_path / f'run{run}.sqlite'}"
        space = SearchSpace(block_m=(16, 32), block_n=(16, 32), num_warps=(2, 4), num_stages=(1, 2), num_splits=(0, 2))
        search_shape(TINY, interpreter_target(), trials=4, seconds=600, storage=storage, seed=7, space=space)
        studies = sorted(optuna.get_all_study_summaries(storage), key=lambda s: s.study_name)
        return [[t.params for t in optuna.load_study(study_name=s.study_name, storage=storage).trials]
                for s in studies]

    assert params(1) == params(2)


def test_trials_in_flight_are_all_told_and_the_budget_holds(tmp_path):
    """With a compile pool of 2, a trial is asked while earlier ones compile and are timed; every
    trial is told (the first-asked whose compile is done first), and a lone search runs exactly
    --trials per study."""
    storage = f"sqlite:///{tmp_path / 's.sqlite'}"
    with CompilePool(2, "cpu") as pool:
        result = search_shape(TINY, interpreter_target(), trials=4, seconds=600, storage=storage, seed=0,
                              space=INTERPRETER_SPACE, pool=pool)
    assert result.trials == 12 and result.trials_per_s > 0
    for summary in optuna.get_all_study_summaries(storage):
        trials = optuna.load_study(study_name=summary.study_name, storage=storage).trials
        counted = [t for t in trials if study.counts(t)]
        assert len(counted) == 4 and len({tuple(sorted(t.params.items())) for t in counted}) == 4
        assert all(t.user_attrs.get("rejected") in ("infeasible", "repeated") for t in trials if not study.counts(t))
        assert any(later.datetime_start < earlier.datetime_complete for earlier, later in zip(counted, counted[1:]))
        assert all("compile_wait" in t.user_attrs["seconds"] for t in counted)


def test_a_space_smaller_than_the_budget_is_searched_whole_each_config_once(tmp_path):
    """Four feasible configs per kernel and --trials 10: each study tries every one exactly once (repeated
    draws and infeasible ones are drawn again without counting) and ends; progress counts 4 per kernel."""
    space = SearchSpace(block_m=(16, 32), block_n=(16, 32, 128), num_warps=(1,), num_stages=(1,), num_splits=(0,),
                        tma=(0,), atomic_dq=(0,), maxnreg=(0,), concurrent=(0,))
    target = interpreter_target(shared_limit=8 * 1024)  # the 128-key tiles do not fit
    storage = f"sqlite:///{tmp_path / 's.sqlite'}"
    assert [trial_budget(space, target, TINY, kernel, 10) for kernel in KERNELS] == [4, 4, 4]
    result = search_shape(TINY, target, trials=10, seconds=600, storage=storage, seed=2, space=space)
    assert result.trials == 12 and search.finished_trials([TINY], target, 10, open_storage(storage),
                                                          space=space) == 12
    for summary in optuna.get_all_study_summaries(storage):
        trials = optuna.load_study(study_name=summary.study_name, storage=storage).trials
        tried = sorted((t.params["block_m"], t.params["block_n"]) for t in trials if study.counts(t))
        assert tried == [(16, 16), (16, 32), (32, 16), (32, 32)], summary.study_name


def test_the_candidate_timed_next_is_the_first_asked_whose_compile_is_done():
    from concurrent.futures import Future
    from threading import Timer

    def candidate(done: bool | None) -> study.Candidate:
        future = None if done is None else Future()
        if done:
            future.set_result(None)
        return study.Candidate(None, None, None, future)

    slow, ready, also_ready = candidate(False), candidate(True), candidate(None)
    pending = deque([slow, ready, also_ready])
    assert trials._next_candidate(pending) is ready and list(pending) == [slow, also_ready]
    assert trials._next_candidate(pending) is also_ready
    Timer(0.2, slow.compiled.set_result, [None]).start()  # none done: wait for the first that is
    assert trials._next_candidate(pending) is slow and not pending
    assert slow.seconds["compile_wait"] >= 0.15 and ready.seconds["compile_wait"] < 0.1


class ScriptedTarget(Target):
    """A GPU-like target (full timings) whose quick and full timings are given numbers."""

    def __init__(self, quick_ms: float, full_ms: float, interpret: bool = False):
        super().__init__(torch.device("cpu"), interpret, "scripted", "cpu", None)
        self.quick_ms, self.full_ms, self.timed = quick_ms, full_ms, []

    def time_ms(self, fn, quick=False, prune_above=math.inf):
        self.timed.append("quick" if quick else "full")
        if quick:
            self.prune_above = prune_above
        return self.quick_ms if quick else self.full_ms


@pytest.mark.parametrize("quick_ms, expected, timed, interpret", [
    (1.05, "full", ["quick", "full"], False),   # within CONTENDER_FACTOR of the best: timed in full
    (1.3, "quick", ["quick"], False),           # cannot win: its quick time counts
    (2.0, "pruned", ["quick"], False),          # over PRUNE_FACTOR: pruned
    (2.0, "quick", ["quick"], True),            # the interpreter's times (noise) prune nothing
])
def test_only_a_contender_for_the_best_is_timed_in_full(tmp_path, quick_ms, expected, timed, interpret):
    from fatune.kernel.triton.heuristics import default_config
    from fatune.tuning.shape import make_inputs
    from fatune.tuning.storage import Heartbeat, open_storage

    target = ScriptedTarget(quick_ms, full_ms=0.99, interpret=interpret)
    storage = open_storage(f"sqlite:///{tmp_path / 's.sqlite'}")
    heuristic = default_config(TINY.spec, None)
    # one candidate, not the heuristic (which is never pruned)
    space = SearchSpace(block_m=(48 - heuristic.fwd.block_m,), block_n=(heuristic.fwd.block_n,), num_warps=(4,),
                        num_stages=(1,), num_splits=(1,))
    kernel = search.KernelSearch(target, TINY, "fwd", heuristic, space, storage, seed=0, trials=4,
                                 deadline=time.time() + 600)
    kernel.known_best = (1.0, heuristic.fwd)
    inputs = make_inputs(TINY, "cpu")
    with Heartbeat(storage) as heartbeat:
        candidate = kernel.ask(heuristic, heartbeat, None)
        kernel.finish(candidate, heuristic, inputs, targets.Checker(TINY, inputs), heartbeat)
    (trial,) = [t for t in kernel.study.trials if t.number == candidate.trial.number]
    assert target.timed == timed and target.prune_above == (math.inf if interpret else study.PRUNE_FACTOR * 1.0)
    if expected == "pruned":
        assert trial.state == optuna.trial.TrialState.PRUNED and trial.user_attrs["rejected"] == "slow"
    else:
        assert trial.value == (0.99 if expected == "full" else quick_ms)
        assert ("full" in trial.user_attrs["seconds"]) == (expected == "full")
        assert trial.user_attrs.get("timed") == ("quick" if expected == "quick" and not interpret else None)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_repeated_draw_queues_the_untried_config_nearest_to_it(tmp_path, seed):
    """A sampler that draws a config tried already (as TPE does once it settles) costs one failed trial: the next
    trial runs the untried config fewest steps away from it along the axes, until the space is exhausted."""
    from fatune.kernel.triton.heuristics import default_config
    from fatune.tuning.storage import Heartbeat, open_storage

    storage = open_storage(f"sqlite:///{tmp_path / 's.sqlite'}")
    heuristic = default_config(TINY.spec, None)
    space = SearchSpace(block_m=(16, 32, 64), block_n=(16, 32, 64), num_warps=(1,), num_stages=(1,), num_splits=(0,),
                        tma=(0,), maxnreg=(0,), concurrent=(0,))
    kernel = search.KernelSearch(interpreter_target(), TINY, "fwd", heuristic, space, storage, seed=seed, trials=9,
                                 deadline=time.time() + 600)
    assert len(kernel.points) == 9
    with Heartbeat(storage) as heartbeat:
        while (candidate := kernel.ask(heuristic, heartbeat, None)) is not None:
            kernel._tell(candidate.trial, heartbeat, lambda: 1.0 + candidate.config.block_m / 64)

    def config(trial):
        return make_config("fwd", trial.params or trial.system_attrs["fixed_params"])

    trials = kernel.study.get_trials()
    counted = [t for t in trials if study.counts(t)]
    assert kernel.exhausted and {config(t) for t in counted} == kernel.points and len(counted) == 9
    repeats = [(t, trials[t.number + 1]) for t in trials[:-1] if t.user_attrs.get("rejected") == "repeated"]
    assert repeats and len(repeats) < 9  # (a last one finds nothing left: the space is exhausted)
    for repeated, following in repeats:
        untried = kernel.points - {config(t) for t in counted if t.number < following.number}
        nearest = min(kernel._steps(c, config(repeated)) for c in untried)
        assert kernel._steps(config(following), config(repeated)) == nearest


def test_the_check_rejects_wrong_and_unwritten_outputs():
    from types import SimpleNamespace

    from fatune.tuning.shape import make_inputs

    inputs = make_inputs(TINY, "cpu")
    checker = targets.Checker(TINY, inputs)
    out = checker.reference["out"].clone()
    runner = SimpleNamespace(args=SimpleNamespace(out=out))
    assert checker.error("fwd", runner) == 0
    out[0, 0, 0, 0] += 0.5 * checker.reference["out"].abs().max()
    assert checker.error("fwd", runner) == pytest.approx(0.5, rel=1e-2)
    out[0, 0, 0, 0] = float("nan")
    assert checker.error("fwd", runner) == float("inf")


@pytest.mark.parametrize("sizes", [{"window": 0}, {"valid_keys": 1 / 64}])
def test_the_check_takes_exact_gradients_that_vanish_where_torch_leaves_rounding_noise(sizes):
    """Where every query sees one key (a window of none, one kept key) dQ = dK = 0: torch's own reference leaves
    rounding noise there (1e-6 beside a dV of 4), against which an exact kernel failed every config (the search
    stored nothing). A kernel off by a ten-thousandth of dV's scale still fails."""
    from types import SimpleNamespace

    shape = dataclasses.replace(TINY, causal=True).with_(**sizes)
    checker = targets.Checker(shape, make_inputs(shape, "cpu"))
    grads = {name: checker.reference[name].clone() for name in ("q", "k", "v")}
    assert grads["q"].abs().max() < 1e-3 * grads["v"].abs().max()
    exact = {**{name: torch.zeros_like(grads[name]) for name in ("q", "k")}, "v": grads["v"]}
    runner = SimpleNamespace(args=SimpleNamespace(grad_q=exact["q"], grad_k=exact["k"], grad_v=exact["v"]))
    assert checker.error("dkdv", runner) < targets.TOLERANCE[shape.dtype]
    runner.args.grad_q = exact["q"] + 1e-4 * grads["v"].abs().max()
    assert checker.error("dkdv", runner) > targets.TOLERANCE[shape.dtype]


def test_search_without_gpu_or_interpreter_says_what_to_do(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="--interpret"):
        search.Target.detect(interpret=False)


def test_the_heuristic_config_is_the_first_trial(tmp_path):
    from fatune.kernel.triton.heuristics import default_config

    storage = f"sqlite:///{tmp_path / 's.sqlite'}"
    search_shape(TINY, interpreter_target(), trials=2, seconds=600, storage=storage, seed=0, space=INTERPRETER_SPACE)
    heuristic = default_config(TINY.spec, None)
    for summary in optuna.get_all_study_summaries(storage):
        kernel = summary.study_name.rsplit(":", 1)[1]
        first = optuna.load_study(study_name=summary.study_name, storage=storage).trials[0]
        expected = dataclasses.asdict(getattr(heuristic, kernel))
        assert first.params == {axis: expected[axis] for axis in INTERPRETER_SPACE.axes(kernel, TINY)}


DUMP = b"TritonGPURemoveLayoutConversions: pass failed, reproducer generated at /tmp/repro.mlir\n#blocked = <IR dump>\n"


class InProcessPool:
    """A compile pool that compiles each candidate in this process, as a pool process would (its output
    captured), so that a test's monkeypatches reach it."""

    processes = 1

    def submit(self, shape, config, kernel):
        from concurrent.futures import Future

        from fatune.tuning import precompile

        future = Future()
        future.set_result(precompile.compile_candidate(shape, config, kernel, "cpu"))
        return future


@pytest.mark.parametrize("pooled", [False, True], ids=["compiled-in-the-timing-process", "compiled-in-the-pool"])
def test_a_compiler_crash_is_one_line_and_its_output_goes_to_the_log(tmp_path, monkeypatch, capfd, pooled):
    """Triton's C++ side writes a failing pass's reproducer and IR straight to fd 2: a candidate whose compile
    does that and raises leaves one line on the terminal, naming the log that holds the dump; a candidate
    that compiles with output of its own leaves it in the log too, never on the terminal."""
    from fatune.tuning import compile_log, precompile
    from fatune.tuning.timing import KernelRunner

    log = tmp_path / "logs" / "search.log"
    monkeypatch.setattr(compile_log, "_path", log)
    forwards = []

    class CrashingCompiler(KernelRunner):
        def run(self, kernel):
            forwards.append(forwards[0] if forwards else self.config.fwd)  # the heuristic's: its trial is the first
            if self.config.fwd != forwards[0]:  # every forward candidate but the heuristic
                os.write(2, DUMP)
                os.write(1, b"compiler stdout\n")
                raise RuntimeError("PassManager::run failed\nsecond line of the error")
            os.write(2, b"a warning from a compile that worked\n")
            return super().run(kernel)

    monkeypatch.setattr(study, "KernelRunner", CrashingCompiler)
    monkeypatch.setattr(precompile, "KernelRunner", CrashingCompiler)
    result = search_shape(TINY, interpreter_target(), trials=2, seconds=600,
                          storage=f"sqlite:///{tmp_path / 's.sqlite'}", seed=0, space=INTERPRETER_SPACE,
                          pool=InProcessPool() if pooled else None)
    assert result.rejected == {"compile_error": 1}  # the forward's second trial
    out, err = capfd.readouterr()
    for text in ("reproducer generated", "IR dump", "compiler stdout", "second line", "a warning", "Traceback"):
        assert text not in out and text not in err
    (line,) = [line for line in err.splitlines() if "fatune search:" in line]
    assert f"{TINY.label()} fwd " in line and "failed: RuntimeError: PassManager::run failed" in line
    assert str(log) in line
    logged = log.read_text()
    assert DUMP.decode() in logged and "compiler stdout" in logged and "second line of the error" in logged
    assert "Traceback" in logged and "a warning from a compile that worked" in logged


def test_the_phase_breakdown_is_printed_only_with_profile(tmp_path):
    args = ["search", "--head-dim", "16", "--dtype", "fp16", "--interpret", "--lengths", "24", "--batch", "1",
            "--heads", "1", "--mask", "none", "--trials", "1", "--db", str(tmp_path / "tuned.sqlite")]
    breakdown = re.compile(r"seconds per phase|studies +inputs +ref +ask +compile +build")
    plain = CliRunner().invoke(cli, args)
    assert plain.exit_code == 0, plain.output
    assert "1 shapes, 3 trials" in plain.output and not breakdown.search(plain.output)
    profiled = CliRunner().invoke(cli, [*args, "--profile"])  # the studies are done: the winners are re-timed
    assert profiled.exit_code == 0, profiled.output
    assert len(breakdown.findall(profiled.output)) == 2  # its title and its header


# -- several searches at once, and resuming after Ctrl-C or a kill (subprocesses) -----------------

CHILD = """
import os, signal, sys, time
from pathlib import Path

from fatune.tuning import search, storage
from fatune.cli import cli

storage.HEARTBEAT_S, storage.GRACE_S = 1, 5  # a killed search's trials are found dead in seconds
barrier, count, kill_in, signal_name, *args = sys.argv[1:]
if kill_in:  # die the way Ctrl-C or `kill -9` would, in the first trial of this kernel
    # as in a terminal: a process started in the background of a script inherits SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    evaluate = search.KernelSearch.evaluate

    def dying(self, trial, *args):
        if self.kernel == kill_in:
            os.kill(os.getpid(), getattr(signal, signal_name))
        return evaluate(self, trial, *args)

    search.KernelSearch.evaluate = dying
Path(barrier, str(os.getpid())).touch()  # start together, imports done: storage creation races
while len(os.listdir(barrier)) < int(count):
    time.sleep(0.01)
cli(args, prog_name="fatune")
"""
SEARCH = ["search", "--head-dim", "16", "--dtype", "fp16", "--interpret", "--lengths", "32", "--batch", "1",
          "--heads", "1", "--mask", "none"]


def start_searches(tmp_path, args: list[str], count: int = 1, kill_in: str = "", signal_name: str = ""):
    barrier = tmp_path / f"barrier-{time.monotonic_ns()}"
    barrier.mkdir()
    return [subprocess.Popen([sys.executable, "-c", CHILD, str(barrier), str(count), kill_in, signal_name, *args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(count)]


def finish(process) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=300)
    return process.returncode, out, err


def studies(db_path) -> dict[str, list[optuna.trial.FrozenTrial]]:
    storage = default_storage_url(db_path)
    return {s.study_name.rsplit(":", 1)[1]: optuna.load_study(study_name=s.study_name, storage=storage).trials
            for s in optuna.get_all_study_summaries(storage)}


def test_searches_started_together_on_a_fresh_db_all_succeed(tmp_path):
    db_path = tmp_path / "fresh" / "tuned.sqlite"
    db_path.parent.mkdir()
    results = [finish(p) for p in start_searches(tmp_path, [*SEARCH, "--trials", "1", "--db", str(db_path)], count=3)]
    assert [rc for rc, _, _ in results] == [0, 0, 0], [err[-2000:] for _, _, err in results]
    with TunedDB(db_path, readonly=True) as db:
        assert db.count() == 1
    assert set(studies(db_path)) == {"fwd", "dkdv", "dq"}


@pytest.mark.parametrize("signal_name, trials", [("SIGINT", 1), ("SIGKILL", 2)])
def test_a_killed_search_resumes_without_counting_dead_trials(tmp_path, signal_name, trials):
    """Killed in the dK/dV study's first (heuristic) trial; the same command then finishes the job:
    the dead trial does not count, the heuristic is run again, nothing finished is run twice."""
    from fatune.kernel.triton.heuristics import default_config

    db_path = tmp_path / "tuned.sqlite"
    args = [*SEARCH, "--trials", str(trials), "--db", str(db_path)]
    (process,) = start_searches(tmp_path, args, kill_in="dkdv", signal_name=signal_name)
    rc, _, err = finish(process)
    if signal_name == "SIGINT":
        assert rc == 130 and "Traceback" not in err and "interrupted" in err.strip().splitlines()[-1]
    else:
        assert rc == -signal.SIGKILL
    dead = {"SIGINT": optuna.trial.TrialState.FAIL, "SIGKILL": optuna.trial.TrialState.RUNNING}[signal_name]
    assert [t.state for t in studies(db_path)["dkdv"]] == [dead]
    with TunedDB(db_path, readonly=True) as db:
        assert db.count() == 0

    (process,) = start_searches(tmp_path, args)
    rc, _, err = finish(process)
    assert rc == 0, err[-2000:]
    heuristic = default_config(TINY.spec, None)
    for kernel, trials_of in studies(db_path).items():
        finished = [t for t in trials_of if t.state in search.FINISHED]
        assert len(finished) == trials, (kernel, trials_of)
        expected = dataclasses.asdict(getattr(heuristic, kernel))
        first = [t for t in finished if t.params == {axis: expected[axis] for axis in t.params}]
        assert first and first[0].state == optuna.trial.TrialState.COMPLETE
    with TunedDB(db_path, readonly=True) as db:
        (entry,) = db.entries()
    assert entry.attention_config().dkdv == LaunchConfig.from_dict(
        min((t for t in studies(db_path)["dkdv"] if t.state == optuna.trial.TrialState.COMPLETE),
            key=lambda t: t.value).params)


def test_uri_characters_in_the_db_path_keep_the_storage_beside_it(tmp_path):
    folder = tmp_path / "a?b%20c#d"
    folder.mkdir()
    result = CliRunner().invoke(cli, [*SEARCH, "--trials", "1", "--profile", "--db", str(folder / "tuned.sqlite")])
    assert result.exit_code == 0, result.output
    assert "wall time per shape in this process" in result.output and "  compile " in result.output
    assert {p.name for p in folder.iterdir()} >= {"tuned.sqlite", "tuned.optuna.sqlite"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a?b%20c#d"]


@pytest.mark.parametrize("dtype, kv_heads, kernel, structure, head_dim", [
    ("float16", 2, "fwd", ["num_splits", "tma"], 64),
    ("bfloat16", 1, "fwd", ["num_splits", "pack_gqa", "tma"], 64),
    ("float32", 2, "fwd", ["num_splits", "tma"], 64),
    ("float16", 2, "dkdv", ["atomic_dq", "tma"], 64),
    ("float16", 2, "dkdv", ["atomic_dq", "tma"], 100),  # 128 lanes: no head-dim split
    ("float16", 2, "dkdv", ["atomic_dq", "tma", "split_d"], 160),  # 256 lanes: the head-dim split is searched
    ("float32", 2, "dkdv", ["tma", "split_d"], 256),  # float32 dK/dV keeps its Kahan-summed dQ kernel
    ("float16", 2, "dq", [], 256),
    ("float16", 2, "dq", [], 128),  # no GQA: the dQ kernel runs after dK/dV
    ("bfloat16", 1, "dq", ["concurrent"], 128),  # GQA: the dQ kernel beside dK/dV is searched
    ("bfloat16", 2, "dq", ["maxnreg"], 64),  # registers limit the d64 dQ kernel to one program per SM
    ("float32", 2, "dq", [], 64),
])
def test_forward_structure_axes(dtype, kv_heads, kernel, structure, head_dim):
    from fatune.tuning.space import GPU_SPACE

    shape = Shape(1, 2, 64, 64, head_dim, dtype, kv_heads=kv_heads)
    axes = GPU_SPACE.axes(kernel, shape)
    assert list(axes)[4:] == structure
    assert axes.get("tma", (0, 1)) == (0, 1)
    assert all(config.tma in (0, 1) for config in GPU_SPACE.grid(kernel, shape)[:50])


DECODE_SEARCH = ["search", "--head-dim", "16", "--dtype", "fp16", "--interpret", "--lengths-q", "1", "--lengths-k",
                 "64", "--heads", "4", "--kv-heads", "2", "--mask", "none", "--trials", "3"]


def test_a_decode_search_is_forward_only_and_its_entry_is_picked_for_decode_calls(tmp_path):
    from fatune.cli import search as search_cli
    from fatune.kernel.triton.heuristics import DECODE_QUERIES, default_config

    assert search_cli.DECODE_QUERIES == DECODE_QUERIES  # its copy, kept off `fatune --help`'s imports
    db_path = tmp_path / "tuned.sqlite"
    result = CliRunner().invoke(cli, [*DECODE_SEARCH, "--db", str(db_path), "--json"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.output[result.output.index("["):])
    # the backward is not timed: null, not 0 or NaN; TFLOP/s of the forward
    assert row["forward_only"] and row["bwd_ms"] is None and row["fwd_bwd_ms"] is None and row["fwd_ms"] > 0
    assert row["tflops"] > 0 and " b1 " in row["shape"]  # B * L_k = the interpreter's 64 tokens
    with TunedDB(db_path, readonly=True) as db:
        (entry,) = db.entries()
    assert entry.forward_only and entry.trials == 3 and entry.fwd_ms > 0
    assert (entry.seqlen_q_bucket, entry.seqlen_k_bucket, entry.group_size) == (16, 64, 2)
    # one study, the forward's: its best trial is the stored forward config; the backward is the heuristic's
    storage = default_storage_url(db_path)
    (summary,) = optuna.get_all_study_summaries(storage)
    assert summary.study_name.endswith(":fwd")
    study = optuna.load_study(study_name=summary.study_name, storage=storage)
    assert len(study.trials) == 3
    config = entry.attention_config()
    assert config.fwd == LaunchConfig.from_dict(study.best_trial.params)
    heuristic = default_config(Shape(batch=1, heads=4, kv_heads=2, seqlen_q=1, seqlen_k=64, head_dim=16,
                                     dtype="float16").spec, None, decode=True)
    assert (config.dkdv, config.dq) == (heuristic.dkdv, heuristic.dq)
    # again, as a table (the studies are done: only the re-timing runs): the backward is marked not timed
    table = CliRunner().invoke(cli, [*DECODE_SEARCH, "--db", str(db_path)])
    assert table.exit_code == 0, table.output
    line = next(line for line in table.output.splitlines() if line.startswith("float16 b1 h4 hkv2 lq1 lk64"))
    assert line.split()[8:10] == ["–", "–"] and "nan" not in line.lower()
    # `fatune db which` (the dispatcher) picks it for a matching decode call
    which = CliRunner().invoke(cli, ["db", "which", "--db", str(db_path), "--head-dim", "16", "--dtype", "fp16",
                                     "--seqlen", "1", "--seqlen-k", "64", "--heads", "4", "--kv-heads", "2"])
    assert which.exit_code == 0, which.output
    assert "layer: user-db" in which.output and "exact bucket Lq<=16, Lk<=64" in which.output
    assert f"fwd {config.fwd} | dkdv {config.dkdv} | dq {config.dq}" in which.output


def test_a_packed_documents_search_stores_a_varlen_entry_that_packed_calls_use(tmp_path, monkeypatch):
    """--mask packed: the batch's tokens as documents of unequal lengths (cu_seqlens); the entry is keyed by
    the varlen kernel and the longest document, and a packed call with such documents dispatches to it."""
    db_path = tmp_path / "tuned.sqlite"
    result = CliRunner().invoke(cli, ["search", "--head-dim", "16", "--dtype", "fp16", "--interpret", "--lengths", "24",
                                      "--batch", "2", "--heads", "1", "--mask", "packed", "--documents", "3",
                                      "--trials", "2", "--db", str(db_path), "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output[result.output.index("["):])
    assert [row["shape"] for row in rows] == ["float16 b2 h1 lq24 lk24 d16 docs3", "float16 b2 h1 lq24 lk24 d16 causal docs3"]
    shape = Shape(batch=2, heads=4, seqlen_q=24, seqlen_k=24, head_dim=16, dtype="float16", causal=True, documents=3)
    assert sum(shape.document_lengths()) == 48 and len(set(shape.document_lengths())) > 1
    with TunedDB(db_path, readonly=True) as db:
        entries = {entry.mask_variant: entry for entry in db.entries()}
    assert set(entries) == {"bottom-right+varlen", "causal+bottom-right+varlen"}
    longest = max(shape.document_lengths())
    assert entries["causal+bottom-right+varlen"].seqlen_q_bucket == seqlen_bucket(longest)
    monkeypatch.setenv("FATUNE_DB", str(db_path))
    plans.clear()  # forget decisions made with other DBs (and, below, this one's)
    try:
        inputs = make_inputs(shape, "cpu")
        explained = fatune.explain(inputs["q"], inputs["k"], inputs["v"], **shape.attention_kwargs("cpu"))
    finally:
        plans.clear()
    assert explained.decision.layer == "user-db"
    assert explained.decision.config == entries["causal+bottom-right+varlen"].attention_config()


def test_packed_documents_need_self_attention_lengths():
    with pytest.raises(ValueError, match="documents"):
        Shape(batch=1, heads=2, seqlen_q=8, seqlen_k=16, head_dim=16, dtype="float16", documents=2)
    result = CliRunner().invoke(cli, ["search", "--head-dim", "16", "--interpret", "--lengths-q", "8", "--lengths-k",
                                      "16", "--mask", "packed"])
    assert result.exit_code == 2 and "--documents" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("shape, sms, splits", [
    (Shape(4, 32, 4096, 4096, 64, "bfloat16"), 132, (0,)),  # 4096 programs of 128 queries: 31 waves
    (Shape(2, 16, 8192, 8192, 128, "bfloat16", kv_heads=2), 132, (0,)),  # packed groups: still 2048 programs
    (Shape(1, 8, 1024, 8192, 128, "bfloat16"), 132, None),  # 64 programs: under one wave
    (Shape(8, 32, 1, 8192, 128, "bfloat16", kv_heads=8), 132, None),  # decode
    (Shape(4, 32, 4096, 4096, 64, "bfloat16"), None, None),  # the interpreter: no multiprocessor count
])
def test_split_kv_is_searched_only_where_the_grid_leaves_the_gpu_idle(shape, sms, splits):
    from fatune.tuning.space import GPU_SPACE

    assert GPU_SPACE.axes("fwd", shape, sms)["num_splits"] == (splits or GPU_SPACE.num_splits)
    assert "num_splits" not in GPU_SPACE.axes("dkdv", shape, sms)


@pytest.mark.parametrize("kind", study.SAMPLERS)
def test_every_sampler_draws_the_same_trials_from_the_same_seed(kind):
    def draws(seed):
        drawn = optuna.create_study(sampler=study.TrialSeededSampler(seed, kind))
        for _ in range(14):  # past TPE's 10 startup trials
            trial = drawn.ask()
            block = trial.suggest_categorical("block_m", [16, 32, 64, 128])
            warps = trial.suggest_categorical("num_warps", [2, 4, 8])
            drawn.tell(trial, block / warps)
        return [t.params for t in drawn.trials]

    assert draws(0) == draws(0) != draws(1)


def test_an_unknown_sampler_is_refused_by_name():
    with pytest.raises(ValueError, match="sampler: expected one of tpe, tpe-independent, random, got 'cma'"):
        study.TrialSeededSampler(0, "cma")


def test_study_names_survive_template_edits_their_search_never_renders(tmp_path, monkeypatch):
    """A study's name carries the hash of the sources its search can render (launch.search_hash), not the
    templates' global hash: an edit in code only window kernels render keeps a causal study's name (its
    trials resume) and renames a window study's (its trials measured other kernels); likewise an edit only
    atomic-dQ backwards render, which every 16-bit search can try."""
    from fatune.tuning.study import study_name
    from tests.test_db import edited_template

    causal = Shape(1, 2, 64, 64, 32, "float16", causal=True)
    window = Shape(1, 2, 64, 64, 32, "float16", causal=True, window=8)
    target = interpreter_target()
    before = {shape: study_name(target, shape, "dq") for shape in (causal, window)}
    with edited_template(tmp_path / "a", monkeypatch, "attn_fwd.py.jinja",
                         "{% if HAS_LEFT %}\nONLY_WINDOWED_FORWARDS_RENDER_THIS = 1\n{% endif %}\n"):
        after = {shape: study_name(target, shape, "dq") for shape in (causal, window)}
        assert after[causal] == before[causal] and after[window] != before[window]
    with edited_template(tmp_path / "b", monkeypatch, "attn_bwd.py.jinja",
                         "{% if ATOMIC_DQ %}\nONLY_ATOMIC_DQ_BACKWARDS_RENDER_THIS = 1\n{% endif %}\n"):
        assert study_name(target, causal, "dq") != before[causal]
    gqa = Shape(1, 4, 64, 64, 32, "float16", causal=True, kv_heads=2)  # searched with GQA packing and without
    gqa_name = study_name(target, gqa, "fwd")
    for edit, name in (("{% if PACK_GQA %}", "c"), ("{% if not PACK_GQA %}", "d")):
        with edited_template(tmp_path / name, monkeypatch, "attn_fwd.py.jinja", edit + "\nA_LINE_OF_CODE = 1\n{% endif %}\n"):
            assert study_name(target, gqa, "fwd") != gqa_name, edit


def test_a_space_that_gains_an_axis_or_a_value_starts_new_studies():
    """Trials of a smaller space must not seed a bigger one as if it were the same study (its new axis was
    never tried): the study's name carries its axes; a space with the same axes keeps the name."""
    from fatune.tuning.space import GPU_SPACE
    from fatune.tuning.study import study_name

    target = Target(torch.device("cpu"), False, "NVIDIA H200", "9.0", 227 * 1024, 132)
    shape = Shape(4, 32, 4096, 4096, 64, "bfloat16")
    name = study_name(target, shape, "dq")
    assert study_name(target, shape, "dq", GPU_SPACE) == name
    assert study_name(target, shape, "dq", dataclasses.replace(GPU_SPACE, maxnreg=(0,))) != name
    assert study_name(target, shape, "dq", dataclasses.replace(GPU_SPACE, num_warps=(4, 8))) != name
    assert study_name(target, shape, "dq", dataclasses.replace(GPU_SPACE, split_d=(1,))) == name  # not a dQ axis


def test_shapes_that_share_a_db_key_keep_their_trials_apart():
    """Two shapes of one tuned-DB key (lengths in one bucket, windows of one width bucket at other lengths,
    other padding or documents) are different problems: each gets its own study, so no trial timed on one
    steers or wins the other's search; the same shape finds its study again."""
    from fatune.tuning.shape import shape_key
    from fatune.tuning.study import study_name

    target = interpreter_target()
    pairs = [
        (Shape(2, 4, 3000, 3000, 32, "float16", causal=True), Shape(2, 4, 4096, 4096, 32, "float16", causal=True)),
        (Shape(2, 4, 4096, 4096, 32, "float16", causal=True, window=256),
         Shape(2, 4, 4096, 8192, 32, "float16", causal=True, window=256)),
        (Shape(2, 4, 4096, 4096, 32, "float16", causal=True, window=200),
         Shape(2, 4, 4096, 4096, 32, "float16", causal=True, window=256)),
        (Shape(2, 4, 4096, 4096, 32, "float16", valid_keys=0.5), Shape(2, 4, 4096, 4096, 32, "float16", valid_keys=0.25)),
        (Shape(2, 4, 256, 256, 32, "float16", documents=3), Shape(2, 4, 256, 256, 32, "float16", documents=4)),
    ]
    for one, other in pairs:
        if shape_key(one) == shape_key(other):  # the lengths of packed documents may fall into other buckets
            assert study_name(target, one, "dq") != study_name(target, other, "dq"), (one, other)
        assert study_name(target, one, "dq") == study_name(target, dataclasses.replace(one), "dq")
    assert shape_key(pairs[1][0]) == shape_key(pairs[1][1])  # a window's entry is keyed by its width
    # one problem, one study: windows the call drops (at least L_q + L_k wide), paddings keeping as many keys
    for one, other in ((Shape(2, 4, 512, 512, 32, "float16", causal=True, window=1024),
                        Shape(2, 4, 512, 512, 32, "float16", causal=True, window=4096)),
                       (Shape(2, 4, 1000, 1000, 32, "float16", valid_keys=0.5),
                        Shape(2, 4, 1000, 1000, 32, "float16", valid_keys=0.5004))):
        assert study_name(target, one, "dq") == study_name(target, other, "dq"), (one, other)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_heuristic_is_a_point_of_every_hopper_search_space(dtype):
    """Every head dim's Hopper heuristic, causal or not, is a trial the GPU space can hold, so it is queued and
    the winner is never slower than it (e.g. causal d50: the heuristic's TMA-reduced dQ runs as element
    atomics, the only atomic kind a head dim that is not a multiple of 4 has)."""
    from fatune.kernel.triton.heuristics import default_config
    from fatune.tuning.space import GPU_SPACE
    from fatune.tuning.study import heuristic_params

    for head_dim in range(1, 257):
        for causal, kv_heads in ((False, 4), (True, 4), (True, 1)):  # GQA causal: the concurrent dQ kernel
            shape = Shape(2, 4, 1024, 1024, head_dim, dtype, causal=causal, kv_heads=kv_heads)
            heuristic = default_config(shape.spec, (9, 0), group=4 // kv_heads)
            for kernel in ("fwd", "dkdv", "dq"):
                axes = GPU_SPACE.axes(kernel, shape, sms=132)
                start = heuristic_params(heuristic, kernel, shape.spec, axes)
                assert all(start[axis] in values for axis, values in axes.items()), (head_dim, causal, kernel, start)


def test_a_warm_start_keeps_the_dq_kernels_place_beside_an_atomic_dkdv():
    """A stored config with atomic dK/dV and its dQ kernel beside dK/dV (`/c`): the dQ study's trial keeps
    `concurrent`, since dQ trials run beside a dK/dV without atomic dQ (base_config)."""
    from fatune.kernel.spec import AttentionConfig
    from fatune.tuning.space import GPU_SPACE
    from fatune.tuning.study import heuristic_params

    shape = Shape(2, 8, 1024, 1024, 128, "bfloat16", causal=True, kv_heads=2)
    stored = AttentionConfig(fwd=LaunchConfig(64, 64), dkdv=LaunchConfig(64, 64, tma=1, atomic_dq=2),
                             dq=LaunchConfig(128, 64, num_warps=8, num_stages=3, concurrent=1))
    params = heuristic_params(stored, "dq", shape.spec, GPU_SPACE.axes("dq", shape, sms=132))
    assert params["concurrent"] == 1
    assert heuristic_params(stored, "dkdv", shape.spec, GPU_SPACE.axes("dkdv", shape, sms=132))["atomic_dq"] == 2


def test_a_dq_trial_goes_with_the_best_dkdv_config_without_atomic_dq():
    """An atomic dK/dV adds dQ itself (the dQ kernel's tile would only size Delta's rows), so dQ candidates
    are timed beside the best dK/dV without it, or the dK/dV study's heuristic tile without it when none finished
    yet."""
    from types import SimpleNamespace

    from fatune.kernel.triton.heuristics import default_config
    from fatune.tuning.trials import base_config

    heuristic = default_config(KernelSpec("bfloat16", 64, causal=True), (9, 0))
    atomic, separate, fwd = LaunchConfig(64, 64, atomic_dq=2), LaunchConfig(32, 128), LaunchConfig(128, 64)
    searches = [SimpleNamespace(kernel="fwd", known_best=(1.0, fwd), known_best_separate=(1.0, fwd)),
                SimpleNamespace(kernel="dkdv", known_best=(2.0, atomic), known_best_separate=(2.4, separate),
                                heuristic=heuristic),
                SimpleNamespace(kernel="dq", known_best=(2.3, LaunchConfig(64, 32)), known_best_separate=(2.3, None))]
    assert base_config(searches, heuristic, "dkdv") == heuristic.replace(fwd=fwd)
    assert base_config(searches, heuristic, "dq") == heuristic.replace(fwd=fwd, dkdv=separate)
    searches[1].known_best_separate = (math.inf, None)
    assert heuristic.dkdv.atomic_dq and base_config(searches, heuristic, "dq").dkdv == dataclasses.replace(
        heuristic.dkdv, atomic_dq=0)


@pytest.mark.parametrize("dq_ms, stored", [(2.3, "atomic"), (1.9, "separate")])
def test_the_separate_backward_is_stored_where_it_beat_the_atomic_one(dq_ms, stored):
    from types import SimpleNamespace

    from fatune.tuning.trials import separate_backward

    atomic, separate = LaunchConfig(64, 64, atomic_dq=2), LaunchConfig(32, 128)
    dkdv = SimpleNamespace(known_best=(2.0, atomic), known_best_separate=(2.4, separate))
    dq = SimpleNamespace(known_best=(dq_ms, LaunchConfig(64, 32)))
    assert separate_backward(dkdv, dq) == (separate if stored == "separate" else None)
    dkdv.known_best = (2.4, separate)  # the best is not atomic: nothing to weigh
    assert separate_backward(dkdv, SimpleNamespace(known_best=(1.0, None))) is None


def test_the_census_keeps_the_best_trial_without_atomic_dq(tmp_path):
    from fatune.kernel.triton.heuristics import default_config
    from fatune.tuning.storage import open_storage

    storage = open_storage(f"sqlite:///{tmp_path / 's.sqlite'}")
    shape = Shape(batch=2, heads=2, seqlen_q=48, seqlen_k=48, head_dim=32, dtype="float16", causal=True)
    kernel = search.KernelSearch(interpreter_target(), shape, "dkdv", default_config(shape.spec, None), INTERPRETER_SPACE,
                                 storage, seed=0, trials=4, deadline=time.time() + 600)
    assert "atomic_dq" in kernel.axes
    distributions = {axis: optuna.distributions.CategoricalDistribution(list(values))
                     for axis, values in kernel.axes.items()}
    for atomic_dq, block_m, value in ((2, 16, 1.0), (0, 32, 1.5), (1, 32, 1.2), (0, 16, 1.7)):
        params = {**{axis: values[0] for axis, values in kernel.axes.items()}, "atomic_dq": atomic_dq, "block_m": block_m}
        kernel.study.add_trial(optuna.trial.create_trial(params=params, distributions=distributions, value=value))
    kernel.census()
    assert kernel.known_best[0] == 1.0 and kernel.known_best[1].atomic_dq == 2
    assert kernel.known_best_separate[0] == 1.5 and kernel.known_best_separate[1].block_m == 32


def test_a_shape_starts_from_the_tuned_configs_of_its_relatives(tmp_path, monkeypatch):
    """Optuna's warm start: a shape's studies queue (after the heuristic, once) the configs tuned in its DB for
    its own key, the same lengths in the other 16-bit dtype, then the nearest lengths in its own (nearest
    before faster); not a stale entry's, another mask's or GQA group's, and not configs outside the space."""
    from fatune.tuning.search import ShapeResult, store, warm_starts
    from fatune.tuning.storage import open_storage
    from fatune.tuning.trials import kernel_searches

    target = interpreter_target()
    own, tile, other, far, elsewhere = (LaunchConfig(m, n, num_warps=4, num_stages=1, num_splits=0)
                                        for m, n in ((32, 32), (16, 32), (16, 16), (32, 16), (64, 16)))

    def tuned(dtype, length, fwd, causal=True, ms=3.0, kv_heads=2):
        from fatune.kernel.triton.heuristics import default_config

        shape = Shape(2, 2, length, length, 32, dtype, causal=causal, kv_heads=kv_heads)
        config = default_config(shape.spec, None).replace(fwd=fwd, dq=dataclasses.replace(fwd, num_splits=1))
        return ShapeResult(shape, config, {}, 1.0, ms - 1.0, ms, 9)

    with TunedDB(tmp_path / "tuned.sqlite") as db:
        for result in (tuned("float16", 256, other), tuned("bfloat16", 64, tile), tuned("float16", 64, own),
                       tuned("float16", 1024, far, ms=1.5),  # faster, but farther
                       tuned("float16", 128, elsewhere, causal=False),  # another mask variant
                       tuned("float16", 128, elsewhere, kv_heads=1)):  # another GQA group
            assert store(db, result, target)
        stale = search.to_entry(tuned("float16", 32, elsewhere), target)
        assert db.upsert(dataclasses.replace(stale, template_hash="0123456789abcdef"))
        shape = Shape(2, 2, 64, 64, 32, "float16", causal=True)
        monkeypatch.setattr(search, "WARM_STARTS", 8)
        assert [config.fwd for config in warm_starts(db, target, shape)] == [own, tile, other, far]
        monkeypatch.setattr(search, "WARM_STARTS", 2)
        warm = warm_starts(db, target, shape)
        assert [config.fwd for config in warm] == [own, tile]
        monkeypatch.setattr(db, "entries", lambda **_: (_ for _ in ()).throw(sqlite3.DatabaseError("malformed")))
        assert warm_starts(db, target, shape) == ()  # a DB that cannot be read costs the warm start only
        storage = open_storage(f"sqlite:///{tmp_path / 's.sqlite'}")
        for _ in range(2):  # a resumed search queues nothing twice
            _, searches = kernel_searches(shape, target, trials=6, seconds=600, storage=storage, seed=0,
                                          space=INTERPRETER_SPACE, warm=warm)
        fwd = {search.kernel: search for search in searches}["fwd"]
        queued = [t.system_attrs["fixed_params"] for t in fwd.study.trials if t.user_attrs.get("warm_start")]
        assert [(p["block_m"], p["block_n"]) for p in queued] == [(32, 32), (16, 32)]
        outside = INTERPRETER_SPACE.__class__(**{**INTERPRETER_SPACE.__dict__, "block_m": (32,)})
        _, narrow = kernel_searches(shape, target, trials=6, seconds=600, storage=open_storage(
            f"sqlite:///{tmp_path / 'n.sqlite'}"), seed=0, space=outside, warm=warm)
        queued = [t.system_attrs["fixed_params"]["block_m"] for t in narrow[0].study.trials if t.user_attrs.get("warm_start")]
        assert queued == [32]  # 16-row tiles are not in that space


@pytest.mark.parametrize("timings, prune_above, calls, expected", [
    ([40.0, 35.0], 30.0, [1, 1], 35.0),          # past the pruning line twice: pruned on the faster call
    ([40.0, 9.0, 8.0], 30.0, [1, 1, 1], 9.0),    # a noisy first call: not pruned; long calls: median of 3
    ([9.0, 8.0, 7.0], 30.0, [1, 2], 8.0),        # 3 calls fill the 20 ms budget: their median, not do_bench's 8+
    ([2.0], 30.0, [1], "bench"),                 # short: do_bench's quick timing
    ([40.0, 8.0, 7.0], math.inf, [1, 2], 8.0),   # the heuristic (never pruned) is timed however slow
])
def test_a_quick_timing_stops_early_for_slow_calls(timings, prune_above, calls, expected):
    from fatune.tuning.target import quick_time

    asked, left = [], list(timings)

    def calls_ms(n):
        asked.append(n)
        return [left.pop(0) for _ in range(n)]

    result = quick_time(calls_ms, lambda: "bench", prune_above)
    assert asked == calls and result == expected
