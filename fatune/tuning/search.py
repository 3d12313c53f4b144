"""`fatune search`: find the fastest correct launch configs per shape, and store the winners.

A shape's studies (fatune.tuning.study: one per kernel; the forward's alone for an inference shape, at most
DECODE_QUERIES queries per sequence) run their trials (fatune.tuning.trials); once they are done, the winners
are re-timed end to end, beside torch's best SDPA backend in the same run, and stored in the tuned DB.

Any number of processes, on any number of hosts, work on the same studies through one Optuna storage
(fatune.tuning.storage). The process that owns a tuned DB pipelines the shapes like the others: it runs its
share of a shape's trials and goes on to the next shape without waiting for the trials others hold; between
shapes, and after the last one, it re-times and stores the winners of each shape whose studies have finished,
in shape order (search_shapes). Where the wall time goes is measured: each trial records its phases
(TRIAL_PHASES) as its user attr "seconds", and a shape's result sums them with the fixed costs (SHAPE_PHASES).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import optuna
import torch

import fatune
from fatune.db import Entry, TunedDB, bucket_distance, is_stale, key_columns
from fatune.kernel.family import family
from fatune.kernel.spec import AttentionConfig, GluonConfig, LaunchConfig
from fatune.tuning import compile_log, precompile
from fatune.tuning.competitors import sdpa
from fatune.tuning.precompile import CompilePool
from fatune.tuning.shape import Shape, shape_key
from fatune.tuning.space import SearchSpace, trial_budget
from fatune.tuning.storage import open_storage
from fatune.tuning.study import FINISHED, TRIAL_PHASES, KernelSearch, counts, forward_only, shape_kernels, study_name
from fatune.tuning.target import Stopwatch, Target
from fatune.tuning.timing import tflops, time_forward, time_step_only, time_training_step
from fatune.tuning.trials import Fixture, kernel_searches, run_trials, separate_backward

# SDPA's training step is the summary's yardstick, not a search result: timed once per shape and backend, the
# training step alone (not its forward too), on a shorter budget (the default's 3 x 2 timings took 1.4 s a shape)
SDPA_BENCH = (5, 40)
SHAPE_PHASES = ("studies", "inputs", "reference", *TRIAL_PHASES, "census", "wait", "progress", "sdpa", "retime", "db")


@dataclass
class ShapeResult:
    shape: Shape
    config: AttentionConfig
    kernel_ms: dict[str, float]
    fwd_ms: float
    bwd_ms: float  # NaN with fwd_bwd_ms: not timed (a forward-only shape)
    fwd_bwd_ms: float
    trials: int  # finished trials of the shape's studies (three, or the forward's alone), by every process
    rejected: dict[str, int] = field(default_factory=dict)  # reason -> count
    sdpa_backend: str = ""
    sdpa_ms: float = math.nan
    seconds: float = 0.0  # wall time this process spent on the shape: its trials, waiting for others', its winners
    breakdown: dict[str, float] = field(default_factory=dict)  # SHAPE_PHASES -> seconds of this process

    @property
    def trials_per_s(self) -> float:
        return self.trials / self.seconds if self.seconds > 0 else math.nan

    @property
    def forward_only(self) -> bool:
        """Searched and timed as inference runs it: the forward alone (bwd_ms, fwd_bwd_ms NaN)."""
        return math.isnan(self.fwd_bwd_ms)

    @property
    def time_ms(self) -> float:
        """What was re-timed end to end: the forward+backward, or the forward of a forward-only shape."""
        return self.fwd_ms if self.forward_only else self.fwd_bwd_ms

    @property
    def tflops(self) -> float:
        return tflops(self.shape, "fwd" if self.forward_only else "fwd+bwd", self.time_ms)

    @property
    def speedup(self) -> float:
        """SDPA's time over fatune's, both forward+backward, or both forward for a forward-only shape."""
        return self.sdpa_ms / self.time_ms if self.time_ms > 0 else math.nan


def sdpa_best(shape: Shape, inputs: dict[str, torch.Tensor], target: Target) -> tuple[str, float]:
    """The fastest torch SDPA backend on this shape, timed as a training step in this run (its forward
    alone for a forward-only shape)."""
    if target.interpret:
        return "", math.nan

    best = ("", math.inf)
    for backend in ("cudnn", "flash", "efficient"):
        runner = sdpa(backend, shape)
        try:
            ms = time_forward(runner, inputs, *SDPA_BENCH)["fwd_ms"] if forward_only(shape) \
                else time_step_only(runner, inputs, *SDPA_BENCH)["fwd_bwd_ms"]
        except Exception:  # backend unavailable for this shape
            continue
        if ms < best[1]:
            best = (backend, ms)
    for name in ("q", "k", "v"):
        inputs[name].grad = None
    return best


@dataclass
class ShapeRun:
    """One shape's search in the process that owns the tuned DB: its studies, its inputs and where its wall
    time went (`clock` by phase, `seconds` in all), from its first trials to its winners' re-timing."""

    shape: Shape
    heuristic: AttentionConfig
    searches: list[KernelSearch]
    fixture: Fixture
    clock: Stopwatch
    seconds: float = 0.0


class Ledger:
    """Charges wall time to the shape being worked on (ShapeRun.seconds). Work on one shape inside work on
    another (trials of a later shape while waiting for an earlier one's) is charged to the inner shape only,
    so the shapes' times add up to the wall time spent on them."""

    def __init__(self) -> None:
        self._stack: list[ShapeRun] = []
        self._mark = time.perf_counter()

    def _switch(self) -> None:
        now = time.perf_counter()
        if self._stack:
            self._stack[-1].seconds += now - self._mark
        self._mark = now

    @contextlib.contextmanager
    def charge(self, run: ShapeRun):
        self._switch()
        self._stack.append(run)
        try:
            yield
        finally:
            self._switch()
            self._stack.pop()


def start_shape(shape: Shape, target: Target, *, trials: int, seconds: float, storage: optuna.storages.RDBStorage,
                seed: int, space: SearchSpace, warm: tuple[AttentionConfig, ...] = ()) -> ShapeRun:
    """A shape's studies (created or loaded, `warm` configs queued) and its fixture, before any trial."""
    clock = Stopwatch()
    with clock("studies"):
        heuristic, searches = kernel_searches(shape, target, trials=trials, seconds=seconds, storage=storage,
                                              seed=seed, space=space, warm=warm)
    return ShapeRun(shape, heuristic, searches, Fixture(shape, target, seed, clock), clock)


def search_shapes(shapes: list[Shape], target: Target, *, trials: int, seconds: float,
                  storage: str | optuna.storages.RDBStorage, seed: int, space: SearchSpace,
                  pool: CompilePool | None = None, on_trial: Callable[[Shape, str, float], None] | None = None,
                  warm: Callable[[Shape], tuple[AttentionConfig, ...]] | None = None) -> Iterator[ShapeResult]:
    """Search `shapes` (with whatever other processes share their studies) and yield each one's result in
    order, once its studies are finished and its winners measured (measure_shape); `warm(shape)`: configs
    its studies try early (warm_starts), asked when the shape starts.

    Shapes are pipelined: this process runs its share of each shape's trials and moves on to the next
    shape without waiting for the trials other processes hold, as helpers do; between shapes it measures
    the winners of the earliest shapes whose studies have finished. After the last shape's trials it waits
    for the shapes left, in order, running trials of later shapes that still want them while it waits
    (a dead process's retried trials). Alone, each shape's winners are measured right after its trials."""
    if isinstance(storage, str):
        storage = open_storage(storage)
    ledger = Ledger()
    runs: list[ShapeRun] = []

    def trials_of(run: ShapeRun, *, wait: bool, poll: bool = False, idle: Callable[[], bool] | None = None) -> bool:
        with ledger.charge(run):
            return run_trials(
                run.searches, run.heuristic, run.fixture, pool=pool, wait=wait, poll=poll, idle=idle, clock=run.clock,
                on_trial=(lambda search: on_trial(run.shape, search.kernel, search.known_best[0])) if on_trial else None)

    def measured(run: ShapeRun) -> ShapeResult:
        with ledger.charge(run):
            result = measure_shape(run, target, pool)
        runs.remove(run)  # its inputs and reference can go
        return result

    def idle_for(run: ShapeRun) -> Callable[[], bool]:
        def idle() -> bool:  # the first later shape that wants trials: run them (True), else nothing to do
            for later in runs[runs.index(run) + 1:]:
                with ledger.charge(later), later.clock("census"):
                    wants = any(search.wants_trial() for search in later.searches)
                if wants:
                    trials_of(later, wait=False)
                    return True
            return False
        return idle

    for shape in shapes:
        started = time.perf_counter()
        run = start_shape(shape, target, trials=trials, seconds=seconds, storage=storage, seed=seed, space=space,
                          warm=warm(shape) if warm else ())
        run.seconds = time.perf_counter() - started
        runs.append(run)
        trials_of(run, wait=False)
        while runs and trials_of(runs[0], wait=True, poll=True):  # its trials, and all others', are done
            yield measured(runs[0])
    while runs:
        trials_of(runs[0], wait=True, idle=idle_for(runs[0]))
        yield measured(runs[0])


def search_shape(shape: Shape, target: Target, *, trials: int, seconds: float,
                 storage: str | optuna.storages.RDBStorage, seed: int, space: SearchSpace,
                 pool: CompilePool | None = None, on_trial: Callable[[str, float], None] | None = None
                 ) -> ShapeResult:
    """Search the three kernels of one shape (with whatever other processes share its studies), wait
    until the studies are done, then measure the winners end to end and SDPA beside them."""
    (result,) = search_shapes([shape], target, trials=trials, seconds=seconds, storage=storage, seed=seed,
                              space=space, pool=pool,
                              on_trial=(lambda _, kernel, best_ms: on_trial(kernel, best_ms)) if on_trial else None)
    return result


def choose_winners(shape: Shape, searches: list[KernelSearch]) -> tuple[dict[str, LaunchConfig | GluonConfig],
                                                                         dict[str, float], dict[str, int]]:
    """(each kernel's winning config, each study's best kernel time, trials rejected by reason) of a shape whose
    studies are finished. The forward's winner is the faster of the families' forward studies, the dK/dV slot's of
    their backward studies (each timed on the same inputs); a family's study without a complete trial (its kernels
    could not be built here) leaves the slot to the other; RuntimeError if no study of a kernel has one. The backward keeps the dQ kernel beside a non-atomic dK/dV where that beat the
    atomic backward (separate_backward)."""
    chosen: dict[str, LaunchConfig | GluonConfig] = {}
    kernel_ms: dict[str, float] = {}  # per study: the forward's of each family
    slot_ms: dict[str, float] = {}  # per kernel: its chosen config's
    rejected: dict[str, int] = {}
    for search in searches:
        for kind, count in search.rejected().items():
            rejected[kind] = rejected.get(kind, 0) + count
        best = search.best_config()
        if best is None:
            continue
        kernel_ms[search.kernel] = search.best_ms
        if search.best_ms < slot_ms.get(search.slot, math.inf):
            chosen[search.slot], slot_ms[search.slot] = best, search.best_ms
        search.census()  # known_best and known_best_separate from every process's trials
    for slot_name in dict.fromkeys(search.slot for search in searches):
        if slot_name not in chosen:
            trials = sum(len(s.study.trials) for s in searches if s.slot == slot_name)
            raise RuntimeError(f"{shape.label()}: no {slot_name} config passed the checks in {trials} trials "
                               f"({rejected}); give more trials or time")
    if not forward_only(shape):
        dkdv, dq = (next(s for s in searches if s.kernel == kernel) for kernel in ("dkdv", "dq"))
        separate = separate_backward(dkdv, dq)
        # the dQ kernel beside a non-atomic dK/dV beat the atomic backward (and the Gluon one, if that won)
        if separate is not None and dq.known_best[0] < slot_ms["dkdv"]:
            chosen["dkdv"], kernel_ms["dkdv"] = separate, dkdv.known_best_separate[0]
    return chosen, kernel_ms, rejected


def measure_shape(run: ShapeRun, target: Target, pool: CompilePool | None = None) -> ShapeResult:
    """The winners of a shape whose studies are finished, measured end to end, and SDPA beside them.

    The winners' combination is compiled in the pool while SDPA is timed (the dK/dV kernel reads the
    dQ kernel's config, so the pair is new). A forward-only shape's forward winner goes with the
    heuristic's backward configs, and only the forward is timed. The result's `breakdown` says where the shape's wall time
    went, its trials' and its measurement's."""
    started = time.perf_counter()
    shape, clock, searches = run.shape, run.clock, run.searches
    with clock("census"):
        chosen, kernel_ms, rejected = choose_winners(shape, searches)
    config = run.heuristic.replace(**chosen)  # every kernel searched, or the forward alone
    only_forward = forward_only(shape)
    compiled = pool.submit(shape, config, "fwd" if only_forward else "dkdv") if pool else None
    inputs = run.fixture.inputs()
    with clock("sdpa"):
        backend, sdpa_ms = sdpa_best(shape, inputs, target)

    with clock("retime"):
        winners = f"{shape.label()} winners {config}"
        ahead = precompile.compiled(compiled)  # a failure fails again below, and is reported there
        if ahead is not None:
            compile_log.write(winners, ahead.output + ahead.traceback)
        kwargs = shape.attention_kwargs(target.device)
        timer = time_forward if only_forward else time_training_step
        with compile_log.logged(winners):  # the winners' combination may be compiled here
            step = timer(lambda q, k, v: fatune.attention(q, k, v, config=config, **kwargs), inputs) \
                if not target.interpret else _interpreted_step(shape, config, inputs, backward=not only_forward)
    finished = sum(search.finished() for search in searches)
    total = run.seconds + time.perf_counter() - started  # the ledger adds this part to run.seconds when it returns
    breakdown = {phase: clock.seconds.get(phase, 0.0) for phase in SHAPE_PHASES if phase != "db"}
    breakdown["other"] = max(0.0, total - sum(breakdown.values()))
    return ShapeResult(shape, config, kernel_ms, step["fwd_ms"], step["bwd_ms"], step["fwd_bwd_ms"], finished,
                       rejected, backend, sdpa_ms, total, breakdown)


def finished_trials(shapes: list[Shape], target: Target, trials: int, storage: optuna.storages.RDBStorage,
                    done: set[Shape] | None = None, space: SearchSpace | None = None) -> int:
    """Trials finished so far in the studies of `shapes`, by every process and host (each study counted up
    to `trials`): a search's progress. Shapes in `done` count in full without asking the storage; shapes
    found with all their trials are added to it."""
    total = 0
    for shape in shapes:
        kernels = shape_kernels(shape, target, space)
        budget = sum(trial_budget(space, target, shape, kernel, trials) for kernel in kernels)
        if done is not None and shape in done:
            total += budget
            continue
        counted = 0
        for kernel in kernels:
            try:
                study_id = storage.get_study_id_from_name(study_name(target, shape, kernel, space))
            except KeyError:  # not created yet
                continue
            finished = storage.get_all_trials(study_id, deepcopy=False, states=FINISHED)
            counted += min(trial_budget(space, target, shape, kernel, trials), sum(map(counts, finished)))
        if done is not None and counted == budget:
            done.add(shape)
        total += counted
    return total


def _interpreted_step(shape: Shape, config: AttentionConfig, inputs: dict[str, torch.Tensor],
                      backward: bool = True) -> dict[str, float]:

    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    start = time.perf_counter()
    with torch.set_grad_enabled(backward):
        out = fatune.attention(q, k, v, config=config, **shape.attention_kwargs(q.device))
    middle = time.perf_counter()
    if not backward:
        return {"fwd_ms": (middle - start) * 1e3, "bwd_ms": math.nan, "fwd_bwd_ms": math.nan}
    out.backward(inputs["do"])
    end = time.perf_counter()
    return {"fwd_ms": (middle - start) * 1e3, "bwd_ms": (end - middle) * 1e3, "fwd_bwd_ms": (end - start) * 1e3}


def to_entry(result: ShapeResult, target: Target) -> Entry:
    """The tuned-DB entry of a shape's winners; its key is built by fatune.db like the dispatcher's, its
    template_hash holds the code hashes of the kernels it measured (its family's kernel_hashes)."""
    hashes = family(result.config.family).kernel_hashes(result.shape.spec, result.config,
                                                        result.shape.heads > result.shape.kv_heads)
    return Entry(
        **key_columns(target.gpu, target.capability, shape_key(result.shape), hashes),
        fwd_config=result.config.fwd.to_dict(),
        bwd_config={"dkdv": result.config.dkdv.to_dict(), "dq": result.config.dq.to_dict()},
        fwd_ms=result.fwd_ms, bwd_ms=result.bwd_ms, fwd_bwd_ms=result.fwd_bwd_ms,  # NaN: forward-only
        tflops=_measured(result.tflops),
        sdpa_backend=result.sdpa_backend, sdpa_ms=_measured(result.sdpa_ms), speedup=_measured(result.speedup),
        batch=result.shape.batch, heads=result.shape.heads, seqlen_q=result.shape.seqlen_q,
        seqlen_k=result.shape.seqlen_k, trials=result.trials, interpreted=target.interpret,
    )


def _measured(value: float) -> float:
    """A measured number as the DB keeps it: NaN (not measured) unless finite and positive (no SDPA
    backend ran: infinite ms)."""
    return value if math.isfinite(value) and value > 0 else math.nan


WARM_STARTS = 2  # tuned configs of related shapes queued per study


def warm_starts(db: TunedDB, target: Target, shape: Shape) -> tuple[AttentionConfig, ...]:
    """Configs of `shape`'s nearest tuned relatives in `db` (this GPU, current kernels, the same head dims,
    mask variant and GQA group): its own entry (a search again, under another study), the same lengths in
    the other 16-bit dtype, then the nearest lengths in this dtype (Optuna's warm start: the kernels' best
    tiles move little between them). At most WARM_STARTS; none if the DB cannot be read (a search does not
    need them)."""

    key = shape_key(shape)
    dtypes = [key.dtype] + [d for d in ("float16", "bfloat16") if d != key.dtype and key.dtype != "float32"]
    try:
        related = [entry for dtype in dtypes
                   for entry in db.entries(on_invalid=lambda message: None, gpu=target.gpu, capability=target.capability,
                                           dtype=dtype, head_dim=key.head_dim, head_dim_v=key.head_dim_v,
                                           mask_variant=key.mask_variant, group_size=key.group_size)
                   if entry.forward_only == forward_only(shape) and not is_stale(entry)]
    except Exception:  # noqa: BLE001 - a bad DB costs the warm start, never the search
        return ()
    order = sorted(related, key=lambda e: (bucket_distance(e, key) > 0, e.dtype != key.dtype, bucket_distance(e, key),
                                           e.time_ms))
    order = [e for e in order if bucket_distance(e, key) == 0 or e.dtype == key.dtype]
    return tuple(dict.fromkeys(e.attention_config() for e in order))[:WARM_STARTS]


def store(db: TunedDB, result: ShapeResult, target: Target) -> bool:
    """Upsert the shape's winners; True if they were faster than what the DB held."""
    return db.upsert(to_entry(result, target))


def default_shapes(head_dim: int, dtype: str, *, lengths=(512, 1024, 2048, 4096, 8192, 16384), causal=(False, True),
                   tokens: int = 16384, model_dim: int = 2048, kv_heads: int = 0) -> list[Shape]:
    """The standard sweep: B * L = tokens and H * D = model_dim fill an H100/H200-class GPU."""
    heads = max(1, model_dim // head_dim)
    return [Shape(batch=max(1, tokens // length), heads=heads, seqlen_q=length, seqlen_k=length, head_dim=head_dim,
                  dtype=dtype, causal=c, kv_heads=kv_heads or heads) for c in causal for length in lengths]
