"""One shape's trials in flight: the studies asked in turn, candidates compiled ahead in a pool while the GPU
times the one before, the shape's inputs and torch's reference made once (Fixture).

run_trials keeps up to one trial per compile-pool process plus the one being timed in flight, and tells each
one's end to its study (failed on errors and Ctrl-C), so the GPU never waits for a compile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, wait
from typing import Callable

import optuna
import torch

from fatune.hardware import sm_count
from fatune.kernel.family import builtin_config
from fatune.kernel.spec import KERNELS, AttentionConfig, LaunchConfig
from fatune.tuning.precompile import CompilePool
from fatune.tuning.shape import Shape, make_inputs
from fatune.tuning.space import SearchSpace, slot
from fatune.tuning.storage import Heartbeat
from fatune.tuning.study import POLL_S, Candidate, KernelSearch, forward_only, shape_kernels
from fatune.tuning.target import Checker, Stopwatch, Target


def base_config(searches: list[KernelSearch], heuristic: AttentionConfig, kernel: str) -> AttentionConfig:
    """What a trial of `kernel` runs besides its candidate: the best so far (as this process knows it) of the
    kernels searched before it (the backward reads the forward's LSE), the heuristic for the others. A dQ
    trial goes with the best dK/dV config without atomic dQ, or its study's heuristic without it (an atomic one
    adds dQ itself, and the dQ kernel's tile would only size Delta's rows): the dQ study tunes the separate
    backward, which measure_shape weighs against the atomic one."""
    base = heuristic
    for search in searches:
        if search.kernel not in KERNELS or KERNELS.index(search.kernel) >= KERNELS.index(slot(kernel)):
            continue  # a kernel searched later, or the Gluon forward (the backward reads either forward's LSE)
        if kernel == "dq" and search.kernel == "dkdv":
            best = search.known_best_separate[1] or dataclasses.replace(search.heuristic.dkdv, atomic_dq=0)
        else:
            best = search.known_best[1]
        base = base.replace(**{search.kernel: best}) if best else base
    return base


def separate_backward(dkdv: KernelSearch, dq: KernelSearch) -> LaunchConfig | None:
    """The dK/dV config to store with the dQ study's winner when the backward with the dQ kernel wins: the
    best dK/dV without atomic dQ, if the dK/dV study's best has atomic dQ and the dQ study's best backward
    (timed beside that config: base_config) is faster than it; else None (keep the dK/dV study's best)."""
    best_ms, best = dkdv.known_best
    separate = dkdv.known_best_separate[1]
    if best is None or not best.atomic_dq or separate is None:
        return None
    return separate if dq.known_best[0] < best_ms else None


class Fixture:
    """A shape's inputs and torch's reference, made once per process and shape when first needed: after
    the first candidates went to the compile pool, so that making them overlaps their compiles."""

    def __init__(self, shape: Shape, target: Target, seed: int, clock: Stopwatch):
        self.shape, self.target, self.seed, self.clock = shape, target, seed, clock
        self._made: tuple[dict[str, torch.Tensor], Checker] | None = None

        self._inputs: dict[str, torch.Tensor] | None = None

    def inputs(self) -> dict[str, torch.Tensor]:
        """The inputs alone (re-timing the winners needs no reference)."""
        if self._inputs is None:
            with self.clock("inputs"):
                self._inputs = make_inputs(self.shape, self.target.device, self.seed)
                self.target.synchronize()
        return self._inputs

    def get(self) -> tuple[dict[str, torch.Tensor], Checker]:
        if self._made is None:
            inputs = self.inputs()
            with self.clock("reference"):
                checker = Checker(self.shape, inputs, backward=not forward_only(self.shape))
            self._made = (inputs, checker)
        return self._made


def _next_candidate(pending: deque[Candidate]) -> Candidate:
    """The first-asked candidate whose compile is done, waiting for one if none is (its "compile_wait"):
    one slow compile does not hold up the ones behind it, nor the pool that would compile the next."""
    start = time.perf_counter()
    while True:
        candidate = next((c for c in pending if c.compiled_yet()), None)
        if candidate is not None:
            pending.remove(candidate)
            candidate.seconds["compile_wait"] = time.perf_counter() - start
            return candidate
        wait([c.compiled for c in pending if c.compiled is not None], return_when=FIRST_COMPLETED)


def run_trials(searches: list[KernelSearch], heuristic: AttentionConfig, fixture: Fixture, *,
               pool: CompilePool | None = None, wait: bool = True, poll: bool = False,
               idle: Callable[[], bool] | None = None, on_trial: Callable[[KernelSearch], None] | None = None,
               clock: Stopwatch | None = None) -> bool:
    """This process's trials of one shape's studies, kernel after kernel, while they want trials; True
    if the studies are finished (every trial of every process told, the heuristic's complete).

    With a compile pool, up to one trial per pool process plus the one being timed are in flight
    (asked and compiling), so the GPU never waits for a compile; the first-asked one whose compile
    is done is timed next. With `wait`, it then waits for the trials other processes hold, runs
    those that died again, and the heuristic's if it did not finish; while others hold trials,
    `idle` may do other work instead of sleeping (True if it did), and with `poll` it returns False
    at once. Without `wait` it returns False once the studies want no more trials from it. Trials
    still in flight on an error or Ctrl-C are told failed. Where the time goes is added to `clock`
    (SHAPE_PHASES).
    """
    clock = clock if clock is not None else Stopwatch()
    depth = 1 + (pool.processes if pool else 0)
    pending: deque[Candidate] = deque()

    def wanting() -> KernelSearch | None:
        with clock("census"):
            return next((s for s in searches if s.wants_trial()), None)

    def report(search: KernelSearch) -> None:
        if on_trial:
            with clock("progress"):
                on_trial(search)

    with Heartbeat(searches[0].storage) as heartbeat:
        try:
            while True:
                while len(pending) < depth:
                    search = wanting()
                    if search is None:
                        break
                    candidate = search.ask(base_config(searches, heuristic, search.kernel), heartbeat, pool, clock)
                    if candidate:
                        pending.append(candidate)
                    else:
                        report(search)
                if pending:
                    inputs, checker = fixture.get()
                    candidate = _next_candidate(pending)
                    search = candidate.search
                    search.finish(candidate, base_config(searches, heuristic, search.kernel), inputs, checker,
                                  heartbeat, clock)
                    report(search)
                    continue
                if not wait:
                    return False
                with clock("census"):  # held and wanted from one look: a trial may end or start between two
                    censuses = [(search, search.census()) for search in searches]
                if any(running for _, (_, running, _) in censuses):
                    if poll:
                        return False
                    if idle is None or not idle():
                        with clock("wait"):
                            time.sleep(POLL_S)
                elif any(search.wants(*census) for search, census in censuses):
                    continue  # a trial failed since this process last asked (a dead one, retried; a repeated draw)
                else:
                    with clock("census"):
                        queued = any([search.ensure_heuristic() for search in searches])
                    if not queued:
                        return True
        finally:
            for candidate in pending:
                if candidate.compiled is not None:
                    candidate.compiled.cancel()
                with contextlib.suppress(Exception):  # a lost connection: the heartbeats stop, the trial goes stale
                    candidate.search._tell(candidate.trial, heartbeat, None)


def shape_heuristic(shape: Shape, target: Target) -> AttentionConfig:
    """The config the dispatcher would take for `shape` on `target` with no tuned entry."""
    return builtin_config(shape.problem, target.arch_or_none, target.sms or sm_count(target.device))


def kernel_searches(shape: Shape, target: Target, *, trials: int, seconds: float,
                    storage: optuna.storages.RDBStorage, seed: int, space: SearchSpace,
                    warm: tuple[AttentionConfig, ...] = ()) -> tuple[AttentionConfig, list[KernelSearch]]:
    """(the heuristic config, the shape's studies: three, or the forward's alone for a forward-only shape);
    each kernel may start trials until its share of `seconds` from now has passed; `warm`: configs to
    try early (KernelSearch.warm_start)."""
    started = time.time()
    heuristic = shape_heuristic(shape, target)
    kernels = shape_kernels(shape, target, space)
    searches = [KernelSearch(target, shape, kernel, heuristic, space, storage, seed, trials,
                             deadline=started + seconds * (index + 1) / len(kernels), warm=warm)
                for index, kernel in enumerate(kernels)]
    return heuristic, searches


def help_search_shape(shape: Shape, target: Target, *, trials: int, seconds: float,
                      storage: optuna.storages.RDBStorage, seed: int, space: SearchSpace,
                      pool: CompilePool | None = None) -> None:
    """A helper process's share of a shape's trials: it runs trials while the studies want them and
    leaves waiting for the others, re-timing and storing to the process that owns the tuned DB."""
    heuristic, searches = kernel_searches(shape, target, trials=trials, seconds=seconds, storage=storage, seed=seed,
                                          space=space)
    clock = Stopwatch()
    run_trials(searches, heuristic, Fixture(shape, target, seed, clock), pool=pool, wait=False, clock=clock)
