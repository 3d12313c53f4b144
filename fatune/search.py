"""`fatune search`: find the fastest correct launch configs per shape with Optuna, store the winners.

Each of the forward, dK/dV and dQ configs gets its own Optuna study (multivariate TPE,
fixed seed). The forward's minimises the forward's median time; the two backward studies
both minimise the whole backward's (dQ and dK/dV kernels, with the other config at its best
so far), because with atomic dQ one kernel does both's work and the dQ config only sizes
the passes around it (Delta, which sums P dP on query tiles whose rows see few keys, and dQ's store). An inference shape (at most DECODE_QUERIES queries per
sequence: forward_only) gets the forward's study alone; its winner is re-timed as the
forward alone and stored with the heuristic's backward configs (bwd_ms and fwd_bwd_ms NaN:
not timed). A training step's forward+backward time is measured again end
to end with the winners before anything is stored.

Every trial tries a config no other trial of its study has tried: a draw whose tiles cannot
fit (shared-memory estimate, too many warps for the tile) is rejected before compiling and
drawn again, as is one that repeats a tried config, and neither counts as a trial (both cost
no compile nor GPU time; when the sampler keeps drawing them, an untried feasible config is
taken at random: KernelSearch.ask). A compile error or OutOfResources prunes a trial (the terminal gets
one line; what the compiler printed goes to the search's log: fatune.compile_log); a trial's output is
checked against torch before its time counts (a fast wrong kernel never wins); a trial
whose quick timing is far behind the best so far is pruned before the full timing, and only
one close to the best is timed in full (the others cannot win; their quick time counts).
Each study runs the built-in heuristic config first, once however many processes share it,
so a winner is never slower than what fatune runs untuned (a short search on an H200 stored
configs slower than the heuristic before this; BENCHMARKS.md).

Studies live in Optuna storage (fatune.storage) under a name that encodes the whole
tuned-DB key, so any number of processes, on any number of hosts, work on the same studies
and an interrupted search resumes where it stopped. `--trials` is the total of finished
trials (complete or pruned, draws rejected before compiling aside) per study, or every feasible
config of a smaller space (trial_budget): a process starts a trial only while the finished
ones plus those that live processes hold are fewer, so the studies end with at most one
extra trial per process that raced for the last one. Trials of dead processes (no
heartbeat) are failed, do not count, and are queued again; so is the heuristic's trial if
it did not finish. A process keeps a few trials in flight (asked, compiling ahead in a
fatune.precompile pool, being timed) and tells each one's end to its study, failed on errors
and Ctrl-C. The process that owns a tuned DB pipelines the shapes like the others: it runs its
share of a shape's trials and goes on to the next shape without waiting for the trials others
hold; between shapes, and after the last one (waiting, in shape order, while running any trials
later shapes still want), it re-times the winners of each shape whose studies have finished end
to end and stores them, in shape order (search_shapes).

Where the wall time goes is measured: each trial records its phases (TRIAL_PHASES) as its user
attr "seconds", and a shape's result sums them with the fixed costs (SHAPE_PHASES).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import itertools
import math
import os
import random
import socket
import statistics
import time
import warnings
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Callable, Iterator

import optuna
import torch

from fatune import compile_log, precompile
from fatune import storage as storage_module
from fatune.db import Entry, TunedDB, is_decode, key_columns, seqlen_bucket, shape_key
from fatune.heuristics import default_config
from fatune.measure import (
    KernelRunner,
    Shape,
    bench,
    make_inputs,
    tflops,
    time_calls,
    time_forward,
    time_step_only,
    time_training_step,
)
from fatune.precompile import CompilePool
from fatune.resources import MIN_ELEMENTS_PER_THREAD, shared_memory_bytes
from fatune.spec import (
    KERNELS,
    AttentionConfig,
    KernelSpec,
    LaunchConfig,
    atomic_dq_kinds,
    lanes,
    runnable_backward,
    split_d_searched,
)
from fatune.storage import Heartbeat, open_storage, storage_lock

TOLERANCE = {"float16": 2e-2, "bfloat16": 4e-2, "float32": 1e-3}  # max |candidate - torch| / max |torch|
PRUNE_FACTOR = 1.5  # quick timing this much slower than the best so far: pruned
CONTENDER_FACTOR = 1.1  # quick timing within this factor of the best so far: timed in full (else its quick time counts)
# do_bench budgets (warm-up ms, repeat ms). The candidate has just run once for the check, do_bench runs it 5 times
# to size its loops, and the full timing follows the quick one: a 1 ms warm-up is always at least one more run.
QUICK_BENCH, FULL_BENCH = (1, 20), (1, 100)
QUICK_CALLS = 3  # a call this many times longer than the quick budget's: the median of this many calls (quick_time)
# SDPA's training step is the summary's yardstick, not a search result: timed once per shape and backend, the
# training step alone (not its forward too), on a shorter budget (the default's 3 x 2 timings took 1.4 s a shape)
SDPA_BENCH = (5, 40)
FINISHED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
# A draw the resource model rejects (nothing compiled or timed) or that repeats a config already tried or in flight
# costs no trial: the sampler draws again, up to this many times; then an untried feasible config is queued instead
# (a TPE that has converged on a categorical space keeps drawing its best: in the sampler's offline run over the
# H200's d128 spaces, 8-14 of 30 draws were such, session 24)
FREE_DRAWS = 8
RUNNING, WAITING = optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.WAITING
SPLIT_WAVES = 4  # a forward whose fewest programs fill this many waves of the GPU gains nothing from split-KV
# the dQ kernel's register cap is searched up to this many lanes: there its registers, not its shared memory,
# limit the programs per SM (a cap of 128 fits two at d64; the forward and dK/dV lost with caps, session 9)
MAXNREG_LANES = 64
POLL_S = 0.5  # how often a process waiting for others' trials of a shape looks again
# Where a process's wall time on a shape goes (ShapeResult.breakdown, seconds): per trial, the phases each trial
# records as its user attr "seconds" (ask, compile_wait, build, check, quick, full) and telling it to its
# study (tell); per shape, the fixed costs.
TRIAL_PHASES = ("ask", "compile_wait", "build", "check", "quick", "full", "tell")
SHAPE_PHASES = ("studies", "inputs", "reference", *TRIAL_PHASES, "census", "wait", "progress", "sdpa", "retime", "db")


def counts(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether `trial` is one of the study's trials (its budget, its checkpoints): a finished config that was
    compiled or timed, not a draw the resource model rejected before compiling (nor a repeated one: FAIL)."""
    return trial.state in FINISHED and trial.user_attrs.get("rejected") != "infeasible"


def forward_only(shape: Shape) -> bool:
    """An inference shape (decode: at most DECODE_QUERIES queries per sequence, the test the heuristic
    uses): only its forward is searched and timed; its backward configs are the heuristic's."""
    return is_decode(seqlen_bucket(shape.seqlen_q))


def shape_kernels(shape: Shape) -> tuple[str, ...]:
    """The kernels whose configs are searched for `shape`, in search order."""
    return ("fwd",) if forward_only(shape) else KERNELS


@dataclass(frozen=True)
class SearchSpace:
    """Candidate launch configs for one kernel (the same axes for all three kernels)."""

    block_m: tuple[int, ...] = (16, 32, 64, 128)
    block_n: tuple[int, ...] = (16, 32, 64, 128)
    num_warps: tuple[int, ...] = (2, 4, 8)
    num_stages: tuple[int, ...] = (1, 2, 3, 4, 5)

    num_splits: tuple[int, ...] = (0, 1, 2, 4, 8, 16, 32)  # forward only; 0 = chosen at launch
    pack_gqa: tuple[int, ...] = (0, 1)  # forward only, GQA shapes only
    tma: tuple[int, ...] = (0, 1)  # forward and dK/dV; dropped at launch where TMA cannot read the tensors
    atomic_dq: tuple[int, ...] = (0, 1, 2)  # dK/dV only, where fatune.spec.atomic_dq_kinds allows; 2 = TMA reductions
    split_d: tuple[int, ...] = (1, 2)  # dK/dV only, where fatune.spec.split_d_searched
    maxnreg: tuple[int, ...] = (0, 128)  # dQ only, 16-bit head dims up to 64 (MAXNREG_LANES): a register cap
    # dQ only, GQA shapes only: the dQ kernel on a second stream beside dK/dV (1: dQ launched first, 2: dK/dV
    # first), which only gained there on an H200 (benchmarks/stream_probe.py, session 13: up to 1.19x less
    # backward time with GQA causal, within +-3% without GQA); where a config also adds dQ atomically the
    # kernel never runs and the switch is dropped (fatune.spec.runnable_backward)
    concurrent: tuple[int, ...] = (0, 1, 2)

    def axes(self, kernel: str, shape: Shape, sms: int | None = None) -> dict[str, tuple[int, ...]]:
        """The axes searched for `kernel` on `shape`: tiles, warps, stages, and the structure fields it owns.

        On a GPU with `sms` multiprocessors, a shape whose forward fills SPLIT_WAVES waves even with
        its largest query tiles keeps only num_splits=0 (chosen at launch: no split there): splitting
        its keys would add partial results and merges to a grid that already has no idle multiprocessor."""
        axes = {"block_m": self.block_m, "block_n": self.block_n, "num_warps": self.num_warps,
                "num_stages": self.num_stages}
        if kernel == "fwd":
            axes["num_splits"] = (0,) if sms and self.fills_gpu(shape, sms) else self.num_splits
            if shape.kv_heads != shape.heads:
                axes["pack_gqa"] = self.pack_gqa
            axes["tma"] = self.tma
        kinds = tuple(kind for kind in self.atomic_dq if kind in atomic_dq_kinds(shape.spec))
        if kernel == "dkdv" and len(kinds) > 1:
            axes["atomic_dq"] = kinds
        if kernel == "dkdv":
            axes["tma"] = self.tma
            if split_d_searched(shape.spec):
                axes["split_d"] = self.split_d
        if kernel == "dq" and shape.spec.dtype != "float32" and \
                max(lanes(shape.spec.head_dim), lanes(shape.spec.head_dim_v)) <= MAXNREG_LANES:
            axes["maxnreg"] = self.maxnreg
        if kernel == "dq" and len(self.concurrent) > 1 and shape.kv_heads != shape.heads:
            axes["concurrent"] = self.concurrent
        return axes

    def fills_gpu(self, shape: Shape, sms: int) -> bool:
        """Whether the forward of `shape` (its length bucket, as the study is named) has at least
        SPLIT_WAVES x `sms` programs with the largest query tile, GQA groups packed."""
        rows = seqlen_bucket(shape.seqlen_q) * (shape.heads // shape.kv_heads)
        programs = math.ceil(rows / max(self.block_m)) * shape.kv_heads * shape.batch
        return programs >= SPLIT_WAVES * sms

    def grid(self, kernel: str, shape: Shape, sms: int | None = None) -> list[LaunchConfig]:
        axes = self.axes(kernel, shape, sms)
        return [LaunchConfig(**dict(zip(axes, values))) for values in itertools.product(*axes.values())]

    def feasible(self, kernel: str, shape: Shape, target: Target) -> frozenset[LaunchConfig]:
        """The grid's configs that the resource model (infeasible) lets run on `target`: the points a search
        may try, and so the most trials it can run."""
        return _feasible(self, kernel, shape, target.sms, target.shared_limit, target.arch)


GPU_SPACE = SearchSpace()
# The interpreter runs tiles as numpy arrays: a small space keeps CPU searches short.
INTERPRETER_SPACE = SearchSpace(block_m=(16, 32), block_n=(16, 32), num_warps=(4,), num_stages=(1,), num_splits=(0, 2),
                                maxnreg=(0,),  # the interpreter compiles nothing: a cap changes nothing there
                                concurrent=(0,),  # nor has it streams to run kernels side by side
                                pack_gqa=(1,), atomic_dq=(0, 1, 2))


def infeasible(kernel: str, spec: KernelSpec, config: LaunchConfig, shared_limit: int | None,
               arch: tuple[int, int] = (9, 0)) -> str | None:
    """Why `config` cannot run well for `kernel` on a GPU of compute capability `arch` with `shared_limit` bytes
    per block (None: the interpreter, where only correctness matters), decided without compiling; None if it may."""
    if shared_limit is None:
        return None
    if config.block_m * config.block_n < config.num_warps * 32 * MIN_ELEMENTS_PER_THREAD:
        return (f"{config.num_warps} warps for a {config.block_m}x{config.block_n} tile: under "
                f"{MIN_ELEMENTS_PER_THREAD} elements per thread")
    needed = shared_memory_bytes(kernel, spec, config, arch)
    if needed > shared_limit:
        return f"needs ~{needed // 1024} KiB shared memory, the GPU has {shared_limit // 1024} KiB per block"
    # accumulators in registers (a head-dim split's dK/dV programs each hold half)
    resident = {"fwd": config.block_m * lanes(spec.head_dim_v), "dkdv": config.block_n * (lanes(spec.head_dim)
                + lanes(spec.head_dim_v)) // config.split_d, "dq": config.block_m * lanes(spec.head_dim)}[kernel]
    if (resident + config.block_m * config.block_n) / (config.num_warps * 32) > 512:
        return "float32 accumulators alone need over 512 registers per thread"
    return None


@dataclass
class Target:
    """Where a search runs: the GPU (or the interpreter), and how it times."""

    device: torch.device
    interpret: bool
    gpu: str
    capability: str
    shared_limit: int | None
    sms: int | None = None  # multiprocessors (None: the interpreter)

    @property
    def arch(self) -> tuple[int, int]:
        """The GPU's compute capability ((9, 0) for the interpreter: its estimates are not used there)."""
        major, _, minor = self.capability.partition(".")
        return (int(major), int(minor)) if major.isdigit() and minor.isdigit() else (9, 0)

    @classmethod
    def detect(cls, interpret: bool) -> Target:
        if interpret:
            return cls(torch.device("cpu"), True, "triton-interpreter", "cpu", None)
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA GPU is visible: run fatune search on a GPU machine, or pass --interpret "
                               "to try it on the CPU through Triton's interpreter (timings are not meaningful there)")
        props = torch.cuda.get_device_properties(0)
        limit = getattr(props, "shared_memory_per_block_optin", None) or 227 * 1024
        return cls(torch.device("cuda"), False, props.name, f"{props.major}.{props.minor}", int(limit),
                   props.multi_processor_count)

    def time_ms(self, fn: Callable[[], object], quick: bool = False, prune_above: float = math.inf) -> float:
        """Median milliseconds of fn() (which ran once already); `quick`: on the short budget (quick_time:
        the faster of two calls past `prune_above`)."""
        if self.interpret:  # one wall-clock run; the number only orders candidates roughly
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        if quick:
            return quick_time(lambda calls: time_calls(fn, calls), lambda: bench(fn, *QUICK_BENCH), prune_above)
        return bench(fn, *FULL_BENCH)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def quick_time(calls_ms: Callable[[int], list[float]], bench_ms: Callable[[], float], prune_above: float) -> float:
    """A quick timing from one call first (`calls_ms(n)`: n timed calls). Past `prune_above`, a second call
    confirms it (noise only ever slows a call): the faster of the two is the answer and the candidate is
    pruned on it, saving do_bench's eight calls or more of a slow kernel. Calls so long that QUICK_CALLS of
    them fill the quick budget (do_bench would repeat them about that often anyway): the median of
    QUICK_CALLS calls. Else do_bench's quick timing (`bench_ms`)."""
    times = calls_ms(1)
    if times[0] > prune_above:
        times += calls_ms(1)
        if min(times) > prune_above:
            return min(times)
    if times[0] * QUICK_CALLS >= QUICK_BENCH[1]:
        return statistics.median(times + calls_ms(QUICK_CALLS - len(times)))
    return bench_ms()


class Stopwatch:
    """Seconds per phase, summed: `with clock("build"): ...` or `clock.add("build", seconds)`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def merge(self, seconds: dict[str, float]) -> None:
        for phase, value in seconds.items():
            self.add(phase, value)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - start)


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


class Checker:
    """torch's output and gradients for one shape, to check every candidate kernel against.

    Per shape: the references in float32, their scales, where torch itself is not finite; per
    candidate: one reduction per output and one synchronisation."""

    # the backward's two studies are timed and checked as the whole backward (fatune.measure.KernelRunner)
    KERNEL_OUTPUTS = {"fwd": ("out",), "dkdv": ("grad_q", "grad_k", "grad_v"), "dq": ("grad_q", "grad_k", "grad_v")}
    REFERENCE_NAMES = {"out": "out", "grad_q": "q", "grad_k": "k", "grad_v": "v"}

    def __init__(self, shape: Shape, inputs: dict[str, torch.Tensor], backward: bool = True):
        from fatune.competitors import sdpa_default

        q, k, v = (inputs[name].detach().clone().requires_grad_(backward) for name in ("q", "k", "v"))
        out = sdpa_default(shape)(q, k, v)
        if backward:
            out.backward(inputs["do"])
            self.reference = {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}
        else:  # a forward-only shape: only the forward's output is checked
            self.reference = {"out": out.detach()}
        self.tolerance = TOLERANCE[shape.dtype]
        self._expected: dict[str, tuple[torch.Tensor, torch.Tensor | None, float]] = {}
        for name, reference in self.reference.items():
            expected = reference.float()
            finite = torch.isfinite(expected)
            unchecked = None if bool(finite.all()) else ~finite  # elements torch itself gets no number for
            scale = expected.abs().masked_fill(~finite, 0).max().item() or 1.0
            self._expected[name] = (expected, unchecked, scale)

    def error(self, kernel: str, runner: KernelRunner) -> float:
        """Largest relative max-abs error of the kernel's outputs; inf if any element is not finite."""
        errors = []
        for name in self.KERNEL_OUTPUTS[kernel]:
            actual = getattr(runner.args, name)
            expected, unchecked, scale = self._expected[self.REFERENCE_NAMES[name]]
            difference = (actual.float() - expected).abs()
            if unchecked is not None:
                difference = difference.masked_fill(unchecked, 0)
            errors.append(torch.where(torch.isfinite(actual).all(), difference.max() / scale, math.inf))
        worst = torch.stack(errors).max().item()
        return math.inf if math.isnan(worst) else worst


def default_space(target: Target) -> SearchSpace:
    return INTERPRETER_SPACE if target.interpret else GPU_SPACE


@functools.lru_cache(maxsize=1024)
def _feasible(space: SearchSpace, kernel: str, shape: Shape, sms: int | None, shared_limit: int | None,
              arch: tuple[int, int]) -> frozenset[LaunchConfig]:
    return frozenset(config for config in space.grid(kernel, shape, sms)
                     if infeasible(kernel, shape.spec, config, shared_limit, arch) is None)


def trial_budget(space: SearchSpace | None, target: Target, shape: Shape, kernel: str, trials: int) -> int:
    """The trials a study of `kernel` runs for `--trials trials`: as many, or every feasible point of a smaller
    space (SearchSpace.feasible)."""
    space = space or default_space(target)
    return min(trials, len(space.feasible(kernel, shape, target)))


def axes_digest(space: SearchSpace, target: Target, shape: Shape, kernel: str) -> str:
    """A short hash of the axes `space` searches for `kernel` on `shape`: changes whenever an axis or a value
    joins or leaves them."""
    axes = space.axes(kernel, shape, target.sms)
    return hashlib.sha256(repr(sorted(axes.items())).encode()).hexdigest()[:8]


def study_name(target: Target, shape: Shape, kernel: str, space: SearchSpace | None = None) -> str:
    """The Optuna study of one kernel of one shape: the installation and kernel spec of the tuned-DB key
    (fatune.db), with the hash of the sources its search can render (launch.search_hash) for the templates'
    part, the hash of its axes in `space` (default: the target's) so that a space that gains or loses an axis
    or a value starts new studies, and the shape itself (its lengths, window, padding and documents, batch and
    heads: two shapes that share a DB key are still different problems, whose trials must not mix in one study)."""
    from fatune import launch

    key = key_columns(target.gpu, target.capability, shape_key(shape))
    templates = launch.search_hash(shape.spec, shape.kv_heads != shape.heads)
    templates += "-" + axes_digest(space or default_space(target), target, shape, kernel)
    sizes = [f"w{shape.window}"] if "window" in key["mask_variant"] else []  # a window the call keeps
    sizes += [f"keys{shape.kept_keys}"] if shape.valid_keys < 1.0 else []
    sizes += [f"docs{shape.documents}"] if shape.documents else []
    return ":".join([
        "fatune", key["gpu"], key["capability"], f"triton{key['triton_version']}", f"templates{templates}",
        key["dtype"], f"d{key['head_dim']}", f"dv{key['head_dim_v']}", key["mask_variant"], "+".join(sizes) or "-",
        f"g{key['group_size']}", f"lq{shape.seqlen_q}", f"lk{shape.seqlen_k}", f"b{shape.batch}h{shape.heads}", kernel,
    ])


# How a study draws its trials (benchmarks/search_quality.py --sampler compares them): multivariate TPE over all
# axes at once, TPE per axis, uniform random draws.
SAMPLERS = ("tpe", "tpe-independent", "random")
SAMPLER = "tpe"  # the one searches use


class TrialSeededSampler(optuna.samplers.BaseSampler):
    """An Optuna sampler (SAMPLERS; multivariate TPE by default) whose random draws for trial n come from
    (seed, n): the same seed gives the same trials, and processes sharing a study do not all draw the same
    startup trials."""

    def __init__(self, seed: int, kind: str = "tpe"):
        if kind not in SAMPLERS:
            raise ValueError(f"sampler: expected one of {', '.join(SAMPLERS)}, got {kind!r}")
        self.seed, self.kind = seed, kind
        self._by_trial: dict[int, optuna.samplers.BaseSampler] = {}

    def _sampler(self, trial: optuna.trial.FrozenTrial) -> optuna.samplers.BaseSampler:
        sampler = self._by_trial.get(trial.number)
        if sampler is None:
            seed = (self.seed * 1_000_003 + trial.number) % 2**32
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                sampler = optuna.samplers.RandomSampler(seed=seed) if self.kind == "random" else \
                    optuna.samplers.TPESampler(seed=seed, n_startup_trials=10, multivariate=self.kind == "tpe",
                                               constant_liar=True)
            self._by_trial[trial.number] = sampler
        return sampler

    def infer_relative_search_space(self, study, trial):
        return self._sampler(trial).infer_relative_search_space(study, trial)

    def sample_relative(self, study, trial, search_space):
        return self._sampler(trial).sample_relative(study, trial, search_space)

    def sample_independent(self, study, trial, param_name, param_distribution):
        return self._sampler(trial).sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study, trial) -> None:
        self._sampler(trial).before_trial(study, trial)

    def after_trial(self, study, trial, state, values) -> None:
        self._sampler(trial).after_trial(study, trial, state, values)
        self._by_trial.pop(trial.number, None)


@contextlib.contextmanager
def _quiet_optuna():
    """Without Optuna's warnings that heartbeats are meant for Study.optimize (fatune records them for
    its trials in flight itself) and that fail_stale_trials is experimental."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Heartbeat of storage", UserWarning)
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield


def _worker_name() -> str:
    """host:pid of this process, kept on each trial it runs (shown by optuna-dashboard)."""
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass
class Candidate:
    """A trial in flight: asked, its kernels compiling ahead (`compiled`), waiting to be timed."""

    search: KernelSearch
    trial: optuna.Trial
    config: LaunchConfig
    compiled: Future | None
    seconds: dict[str, float] = field(default_factory=dict)  # TRIAL_PHASES so far

    def compiled_yet(self) -> bool:
        return self.compiled is None or self.compiled.done()


def heuristic_params(heuristic: AttentionConfig, kernel: str, spec: KernelSpec, axes: dict) -> dict[str, int]:
    """The heuristic's trial of `kernel` (its values on `axes`), as it runs for `spec`: an atomic-dQ kind the
    head dim cannot take runs as the next one down, which is what the space offers (TMA reductions exist
    wherever a heuristic asks for them: Hopper)."""
    if kernel == "dq":  # dQ trials run beside a dK/dV without atomic dQ (base_config): its structure as it is
        heuristic = heuristic.replace(dkdv=dataclasses.replace(heuristic.dkdv, atomic_dq=0))
    runs_as = runnable_backward(heuristic, spec, tma=True)
    return {axis: value for axis, value in dataclasses.asdict(getattr(runs_as, kernel)).items() if axis in axes}


class KernelSearch:
    """One kernel of one shape: its Optuna study, shared by every process that searches the shape on
    this storage, and this process's trials of it."""

    def __init__(self, target: Target, shape: Shape, kernel: str, heuristic: AttentionConfig, space: SearchSpace,
                 storage: optuna.storages.RDBStorage, seed: int, trials: int, deadline: float,
                 warm: tuple[AttentionConfig, ...] = ()):
        self.target, self.shape, self.kernel, self.space = target, shape, kernel, space
        self.storage, self.seed, self.deadline = storage, seed, deadline
        self.axes = space.axes(kernel, shape, target.sms)
        self.points = space.feasible(kernel, shape, target)
        self.trials = trial_budget(space, target, shape, kernel, trials)
        self.exhausted = False  # every feasible point tried or held, as the last ask found
        self.spec = shape.spec
        self.start = heuristic_params(heuristic, kernel, shape.spec, self.axes)
        # what this process knows of the study without asking the storage again: the best trial as of its last
        # census or tell, when it last looked for dead trials, and until when a study it found with all its
        # trials finished or held need not be asked again (only a dead trial can change that, found in >= GRACE_S)
        self.known_best: tuple[float, LaunchConfig | None] = (math.inf, None)
        self.known_best_separate: tuple[float, LaunchConfig | None] = (math.inf, None)  # without atomic dQ
        self._stale_checked = -math.inf
        self._full_until = -math.inf
        with storage_lock(storage.url):
            self.study = optuna.create_study(study_name=study_name(target, shape, kernel, space), storage=storage,
                                             sampler=TrialSeededSampler(seed, SAMPLER), direction="minimize",
                                             load_if_exists=True)
        self.ensure_heuristic()
        self.warm_start(warm)

    def _holds_heuristic(self, trial: optuna.trial.FrozenTrial) -> bool:
        return self.start in (trial.params, trial.system_attrs.get("fixed_params"))

    def ensure_heuristic(self) -> bool:
        """Queue the heuristic config (when in the space) unless a trial of it has finished, waits or
        runs; True if it queued one. The winner is then never slower than what fatune runs untuned."""
        if not all(self.start[axis] in values for axis, values in self.axes.items()):
            return False
        with storage_lock(self.storage.url):
            trials = self.study.get_trials(deepcopy=False, states=(*FINISHED, WAITING, RUNNING))
            if any(self._holds_heuristic(trial) for trial in trials):
                return False
            self.study.enqueue_trial(self.start)
            return True

    def warm_start(self, configs: tuple[AttentionConfig, ...]) -> int:
        """Queue this kernel's config of each of `configs` (winners of related shapes: warm_starts) that is
        a feasible point of the space, unless the study has a trial of it: Optuna runs queued trials before
        its own samples (within the study's budget). How many it queued."""
        queued = 0
        for config in configs:
            params = heuristic_params(config, self.kernel, self.spec, self.axes)
            if params == self.start or not all(params.get(axis) in values for axis, values in self.axes.items()):
                continue
            if infeasible(self.kernel, self.spec, LaunchConfig.from_dict(params), self.target.shared_limit,
                          self.target.arch):
                continue  # it would only be rejected, spending a trial
            with storage_lock(self.storage.url):
                trials = self.study.get_trials(deepcopy=False)
                if any(params in (trial.params, trial.system_attrs.get("fixed_params")) for trial in trials):
                    continue
                self.study.enqueue_trial(params, user_attrs={"warm_start": True})
                queued += 1
        return queued

    def census(self) -> tuple[int, int, bool]:
        """(finished trials, trials live processes hold, whether the heuristic waits in the queue), after
        failing the trials of dead processes (looked for once per heartbeat interval: a trial is dead only
        after GRACE_S without one). Also notes the best trial."""
        now = time.monotonic()
        if now - self._stale_checked >= storage_module.HEARTBEAT_S:
            self._stale_checked = now
            with _quiet_optuna():
                optuna.storages.fail_stale_trials(self.study)
        finished = running = waiting = 0
        heuristic_waits = False
        for trial in self.study.get_trials(deepcopy=False, states=(*FINISHED, WAITING, RUNNING)):
            finished += counts(trial)
            running += trial.state == RUNNING
            waiting += trial.state == WAITING
            heuristic_waits |= trial.state == WAITING and self._holds_heuristic(trial)
            if trial.state == optuna.trial.TrialState.COMPLETE:
                self._note_best(trial.value, trial.params)
        self.exhausted &= not waiting  # a queued trial (a dead one's retry, a warm start) is still to run
        self._full_until = -math.inf  # fresh news: wants_trial decides again
        return finished, running, heuristic_waits

    def _note_best(self, value: float, params: dict) -> None:
        """Note a complete trial in known_best, and in known_best_separate if it has no atomic dQ (a dQ study
        times its candidates beside that one: base_config)."""
        if value < self.known_best[0]:
            self.known_best = (value, LaunchConfig.from_dict(params))
        if not params.get("atomic_dq") and value < self.known_best_separate[0]:
            self.known_best_separate = (value, LaunchConfig.from_dict(params))

    def wants_trial(self) -> bool:
        """Whether this process should start one more trial: a queued heuristic always runs; others
        while the finished and held trials are fewer than the budget and the time lasts."""
        if time.monotonic() < self._full_until:
            return False  # full at the last census, under POLL_S ago
        finished, running, heuristic_waits = self.census()
        wants = heuristic_waits or (time.time() < self.deadline and finished + running < self.trials
                                    and not self.exhausted)
        if not wants:
            self._full_until = time.monotonic() + POLL_S
        return wants

    @property
    def best_ms(self) -> float:
        done = self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        return min((t.value for t in done), default=math.inf)

    def best_config(self) -> LaunchConfig | None:
        done = self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        if not done:
            return None
        return LaunchConfig.from_dict(min(done, key=lambda t: t.value).params)

    def suggest(self, trial: optuna.Trial) -> LaunchConfig:
        return LaunchConfig.from_dict({axis: trial.suggest_categorical(axis, list(values))
                                       for axis, values in self.axes.items()})

    def ask(self, base: AttentionConfig, heartbeat: Heartbeat, pool: CompilePool | None,
            clock: Stopwatch | None = None) -> Candidate | None:
        """Start a trial of a feasible config not tried yet, and its compile in `pool`; None if no such config
        is left (`exhausted`). A draw the resource model rejects (told pruned: the sampler learns to avoid it)
        or one that repeats a config (told failed: the sampler learns nothing) is drawn again; from the
        FREE_DRAWS-th draw on, an untried feasible config is queued first, which the next ask takes."""
        for draw in itertools.count():
            if draw >= FREE_DRAWS and not self._queue_untried():
                self.exhausted = True
                return None
            start = time.perf_counter()
            with _quiet_optuna():
                trial = self.study.ask()
            try:
                heartbeat.hold(trial)
                trial.set_user_attr("worker", _worker_name())
                config = self.suggest(trial)
                reason = infeasible(self.kernel, self.spec, config, self.target.shared_limit, self.target.arch)
                repeated = reason is None and config in self._held_or_tried(trial.number)
            except BaseException:
                self._tell(trial, heartbeat, None, clock=clock)
                raise
            seconds = {"ask": time.perf_counter() - start}
            if reason:
                self._tell(trial, heartbeat, lambda: self._reject(trial, "infeasible", reason), seconds, clock)
            elif repeated:
                trial.set_user_attr("rejected", "repeated")
                self._tell(trial, heartbeat, None, seconds, clock)
            else:
                compiled = pool.submit(self.shape, base.replace(**{self.kernel: config}), self.kernel) if pool else None
                return Candidate(self, trial, config, compiled, seconds)
        raise AssertionError("unreachable")

    def _held_or_tried(self, number: int | None = None) -> set[LaunchConfig]:
        """The configs of the study's trials that finished (infeasible draws aside), run or wait in its queue,
        but trial `number` (the one being asked)."""
        held = set()
        for trial in self.study.get_trials(deepcopy=False, states=(*FINISHED, RUNNING, WAITING)):
            params = trial.params or trial.system_attrs.get("fixed_params") or {}
            if trial.number != number and trial.user_attrs.get("rejected") != "infeasible" and set(self.axes) <= set(params):
                held.add(LaunchConfig.from_dict({axis: params[axis] for axis in self.axes}))
        return held

    def _queue_untried(self) -> bool:
        """Queue a feasible config no trial holds, drawn from (seed, the study's trial count); False if none is left."""
        with storage_lock(self.storage.url):
            untried = sorted(self.points - self._held_or_tried(), key=str)
            if not untried:
                return False
            pick = random.Random(self.seed * 1_000_003 + len(self.study.get_trials(deepcopy=False))).choice(untried)
            self.study.enqueue_trial({axis: getattr(pick, axis) for axis in self.axes}, user_attrs={"untried": True})
        return True

    def finish(self, candidate: Candidate, base: AttentionConfig, inputs: dict[str, torch.Tensor], checker: Checker,
               heartbeat: Heartbeat, clock: Stopwatch | None = None) -> None:
        """Time the candidate (after its compile) and tell the study how it ended."""
        self._tell(candidate.trial, heartbeat, lambda: self.evaluate(
            candidate.trial, candidate.config, base, inputs, checker,
            precompiled(self.describe(candidate.config), candidate.compiled), candidate.seconds),
            candidate.seconds, clock)

    def describe(self, config: LaunchConfig) -> str:
        """A candidate as the terminal and the search log name it: shape, kernel, config."""
        return f"{self.shape.label()} {self.kernel} {config}"

    def _tell(self, trial: optuna.Trial, heartbeat: Heartbeat, run: Callable[[], float] | None,
              seconds: dict[str, float] | None = None, clock: Stopwatch | None = None) -> None:
        """Tell the study how `run` ended: its value, pruned, or failed (re-raising); None: failed. The
        trial's phases so far (`seconds`) become its user attr "seconds"; all of them, telling
        included, are added to `clock`."""
        state, value = optuna.trial.TrialState.FAIL, None
        seconds = {} if seconds is None else seconds
        try:
            if run is not None:
                value, state = run(), optuna.trial.TrialState.COMPLETE
        except optuna.TrialPruned:
            state = optuna.trial.TrialState.PRUNED
        except optuna.exceptions.UpdateFinishedTrialError:
            pass  # another process failed it as dead (no heartbeat for GRACE_S): nothing left to tell
        finally:
            start = time.perf_counter()
            with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
                if seconds:
                    trial.set_user_attr("seconds", {phase: round(spent, 4) for phase, spent in seconds.items()})
                self.study.tell(trial, value, state=state, skip_if_finished=True)
            heartbeat.release(trial)
            self._full_until = -math.inf  # a failed trial no longer counts: look again
            self.exhausted &= state != optuna.trial.TrialState.FAIL  # nor holds its config
            if state == optuna.trial.TrialState.COMPLETE:
                self._note_best(value, trial.params)
            if clock is not None:
                clock.merge(seconds)
                clock.add("tell", time.perf_counter() - start)

    def evaluate(self, trial: optuna.Trial, config: LaunchConfig, base: AttentionConfig,
                 inputs: dict[str, torch.Tensor], checker: Checker, compile_failure: str | None = None,
                 seconds: dict[str, float] | None = None) -> float:
        """The candidate's time; TrialPruned if it does not compile or launch, is wrong, or is slow.

        Its quick timing decides: more than PRUNE_FACTOR x the best so far, pruned (the heuristic
        never is); more than CONTENDER_FACTOR x the best, that is its time (it cannot win); else it
        is timed in full. So the best is always a full timing. Each phase's wall time is added to
        `seconds`."""
        clock = Stopwatch()
        if seconds is not None:
            clock.seconds = seconds
        if compile_failure:
            kind = "out_of_resources" if compile_failure.startswith("OutOfResources") else "compile_error"
            return self._reject(trial, kind, compile_failure)
        attention_config = base.replace(**{self.kernel: config})
        try:
            # its first launch compiles (unless the pool did): the compiler's output goes to the search log
            with clock("build"), compile_log.captured() as output:
                runner = KernelRunner(self.shape, attention_config, inputs)
                runner.prepare()
                for name in Checker.KERNEL_OUTPUTS[self.kernel]:
                    getattr(runner.args, name).fill_(float("nan"))  # poison: an unwritten element fails the check
                run = runner.run(self.kernel)
                run()
                if self.target.device.type == "cuda":
                    torch.cuda.synchronize()
        except Exception as error:  # compile errors, OutOfResources (as a KernelBuildError's cause), launch failures
            causes = (type(error).__name__, type(error.__cause__).__name__)
            kind = "out_of_resources" if "OutOfResources" in causes else "compile_error"
            reason = compile_log.error_line(error)
            compile_log.failed(self.describe(config), reason, output.text + compile_log.details(error))
            return self._reject(trial, kind, reason)
        compile_log.write(self.describe(config), output.text)
        with clock("check"):
            error = checker.error(self.kernel, runner)
        if not error <= checker.tolerance:
            return self._reject(trial, "wrong_result", f"relative error {error:.3g} > {checker.tolerance}")
        best_ms = self.known_best[0]
        heuristic = trial.params == self.start  # the heuristic is always timed in full
        with clock("quick"):
            quick = self.target.time_ms(run, quick=True, prune_above=math.inf if heuristic else PRUNE_FACTOR * best_ms)
        with clock("tell"):
            trial.report(quick, step=0)
        if quick > PRUNE_FACTOR * best_ms and not heuristic:
            with clock("tell"):
                trial.set_user_attr("rejected", "slow")
            raise optuna.TrialPruned(f"quick timing {quick:.3f} ms > {PRUNE_FACTOR} x best {best_ms:.3f} ms")
        if self.target.interpret:
            return quick
        if quick > CONTENDER_FACTOR * best_ms:
            with clock("tell"):
                trial.set_user_attr("timed", "quick")
            return quick
        with clock("full"):
            return self.target.time_ms(run)

    @staticmethod
    def _reject(trial: optuna.Trial, kind: str, reason: str) -> float:
        trial.set_user_attr("rejected", kind)
        trial.set_user_attr("reason", reason)
        raise optuna.TrialPruned(reason)

    def finished(self) -> int:
        return sum(counts(trial) for trial in self.study.get_trials(deepcopy=False, states=FINISHED))

    def rejected(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for trial in self.study.get_trials(deepcopy=False):
            kind = trial.user_attrs.get("rejected")
            if kind:
                counts[kind] = counts.get(kind, 0) + 1
        return counts


def precompiled(what: str, future: Future | None) -> str | None:
    """The compile error the pool found for candidate `what` (None: it compiled, or the pool did not run it).
    What its compile printed goes to the search log; a failure also leaves one line on the terminal."""
    result = precompile.compiled(future)
    if result is None:
        return None
    if result.error:
        compile_log.failed(what, result.error, result.output + result.traceback)
    else:
        compile_log.write(what, result.output)
    return result.error


def base_config(searches: list[KernelSearch], heuristic: AttentionConfig, kernel: str) -> AttentionConfig:
    """What a trial of `kernel` runs besides its candidate: the best so far (as this process knows it) of the
    kernels searched before it (the backward reads the forward's LSE), the heuristic for the others. A dQ
    trial goes with the best dK/dV config without atomic dQ (an atomic one adds dQ itself, and the dQ
    kernel's tile would only size Delta's rows): the dQ study tunes the separate backward, which
    measure_shape weighs against the atomic one."""
    base = heuristic
    for search in searches[:KERNELS.index(kernel)]:
        if kernel == "dq" and search.kernel == "dkdv":
            best = search.known_best_separate[1] or dataclasses.replace(heuristic.dkdv, atomic_dq=0)
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
                with clock("census"):
                    held = any([search.census()[1] for search in searches])
                if held:
                    if poll:
                        return False
                    if idle is None or not idle():
                        with clock("wait"):
                            time.sleep(POLL_S)
                elif wanting() is not None:
                    continue  # a census just failed a dead trial and queued its retry
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


def heuristic_config(shape: Shape, target: Target) -> AttentionConfig:
    """The config the dispatcher would take for `shape` on `target` with no tuned entry (the decode heuristic's
    tests made as it makes them)."""
    decode = forward_only(shape)
    shares = decode and target.sms is not None and shape.decode_shares_sms(target.sms)
    return default_config(shape.spec, None if target.interpret else torch.cuda.get_device_capability(), decode, shares,
                          shape.heads // shape.kv_heads)


def kernel_searches(shape: Shape, target: Target, *, trials: int, seconds: float,
                    storage: optuna.storages.RDBStorage, seed: int, space: SearchSpace,
                    warm: tuple[AttentionConfig, ...] = ()) -> tuple[AttentionConfig, list[KernelSearch]]:
    """(the heuristic config, the shape's studies: three, or the forward's alone for a forward-only shape);
    each kernel may start trials until its share of `seconds` from now has passed; `warm`: configs to
    try early (KernelSearch.warm_start)."""
    started = time.time()
    heuristic = heuristic_config(shape, target)
    kernels = shape_kernels(shape)
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


def sdpa_best(shape: Shape, inputs: dict[str, torch.Tensor], target: Target) -> tuple[str, float]:
    """The fastest torch SDPA backend on this shape, timed as a training step in this run (its forward
    alone for a forward-only shape)."""
    if target.interpret:
        return "", math.nan
    from fatune.competitors import sdpa

    best = ("", math.inf)
    for backend in ("cudnn", "flash", "efficient"):
        runner = sdpa(backend, shape)
        try:
            ms = time_forward(runner, inputs, *SDPA_BENCH)["fwd_ms"] if forward_only(shape) \
                else time_step_only(runner, inputs, *SDPA_BENCH)
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


def measure_shape(run: ShapeRun, target: Target, pool: CompilePool | None = None) -> ShapeResult:
    """The winners of a shape whose studies are finished, measured end to end, and SDPA beside them.

    The winners' combination is compiled in the pool while SDPA is timed (the dK/dV kernel reads the
    dQ kernel's config, so the pair is new). A forward-only shape's forward winner goes with the
    heuristic's backward configs, and only the forward is timed. The result's `breakdown` says where the shape's wall time
    went, its trials' and its measurement's."""
    started = time.perf_counter()
    shape, clock, searches = run.shape, run.clock, run.searches
    chosen: dict[str, LaunchConfig] = {}
    kernel_ms: dict[str, float] = {}
    rejected: dict[str, int] = {}
    with clock("census"):
        for search in searches:
            best = search.best_config()
            if best is None:
                raise RuntimeError(f"{shape.label()}: no {search.kernel} config passed the checks in "
                                   f"{len(search.study.trials)} trials ({search.rejected()}); give more trials or time")
            chosen[search.kernel], kernel_ms[search.kernel] = best, search.best_ms
            search.census()  # known_best and known_best_separate from every process's trials
            for kind, count in search.rejected().items():
                rejected[kind] = rejected.get(kind, 0) + count
        if not forward_only(shape):
            dkdv, dq = (next(s for s in searches if s.kernel == kernel) for kernel in ("dkdv", "dq"))
            separate = separate_backward(dkdv, dq)
            if separate is not None:  # the dQ kernel beside a non-atomic dK/dV beat the atomic backward
                chosen["dkdv"], kernel_ms["dkdv"] = separate, dkdv.known_best_separate[0]
    config = run.heuristic.replace(**chosen)  # every kernel searched, or the forward alone
    only_forward = forward_only(shape)
    compiled = pool.submit(shape, config, "fwd" if only_forward else "dkdv") if pool else None
    inputs = run.fixture.inputs()
    with clock("sdpa"):
        backend, sdpa_ms = sdpa_best(shape, inputs, target)

    import fatune

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
        kernels = shape_kernels(shape)
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
    import fatune

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
    template_hash is the hash of the kernels it measured (`launch.kernel_hash`)."""
    from fatune import launch

    return Entry(
        **{**key_columns(target.gpu, target.capability, shape_key(result.shape)),
           "template_hash": launch.kernel_hash(result.shape.spec, result.config,
                                               result.shape.heads > result.shape.kv_heads)},
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
    from fatune.db import bucket_distance, is_stale

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
