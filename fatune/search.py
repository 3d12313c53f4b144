"""`fatune search`: find the fastest correct launch configs per shape with Optuna, store the winners.

The forward, dK/dV and dQ kernels are independent launches, so each gets its own Optuna
study (TPE sampler, fixed seed) minimising its own median time; a training step's
forward+backward time is their sum plus the small Delta pre-pass, and is measured again
end to end with the winners before anything is stored.

A trial is rejected before compiling when its tiles cannot fit (shared-memory estimate,
too many warps for the tile); a compile error or OutOfResources prunes it; its output is
checked against torch before its time counts (a fast wrong kernel never wins); a trial
whose quick timing is far behind the best so far is pruned before the full timing.
Each study's first trial is the built-in heuristic config, so a winner is never slower than
what fatune runs untuned (a short search on an H200 stored configs slower than the
heuristic before this; BENCHMARKS.md). Studies live in Optuna storage (SQLite by default)
under a name that encodes the whole tuned-DB key, so an interrupted search resumes where it
stopped: only finished trials (complete or pruned) count toward the trial budget, so trials
left failed by Ctrl-C or running by a killed process are run again, and so is the
heuristic's first trial if it did not finish. Several searches may share one storage: its
creation is serialised by a file lock beside an SQLite storage, and trials of a killed
process are marked failed by Optuna's heartbeats.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import optuna
import torch

from fatune.db import DBError, Entry, TunedDB, check_writable, key_columns, shape_key
from fatune.heuristics import default_config
from fatune.measure import KernelRunner, Shape, bench, make_inputs, tflops, time_training_step
from fatune.spec import KERNELS, AttentionConfig, KernelSpec, LaunchConfig, lanes

ELEMENT_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
TOLERANCE = {"float16": 2e-2, "bfloat16": 4e-2, "float32": 1e-3}  # max |candidate - torch| / max |torch|
PRUNE_FACTOR = 1.5  # quick timing this much slower than the best so far: pruned
HEARTBEAT_S, GRACE_S = 10, 60  # a RUNNING trial without a heartbeat for GRACE_S is marked failed
FINISHED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)


@dataclass(frozen=True)
class SearchSpace:
    """Candidate launch configs for one kernel (the same axes for all three kernels)."""

    block_m: tuple[int, ...] = (16, 32, 64, 128)
    block_n: tuple[int, ...] = (16, 32, 64, 128)
    num_warps: tuple[int, ...] = (2, 4, 8)
    num_stages: tuple[int, ...] = (1, 2, 3, 4, 5)

    num_splits: tuple[int, ...] = (0, 1, 2, 4, 8, 16, 32)  # forward only; 0 = chosen at launch
    pack_gqa: tuple[int, ...] = (0, 1)  # forward only, GQA shapes only

    def axes(self, kernel: str, shape: Shape) -> dict[str, tuple[int, ...]]:
        """The axes searched for `kernel` on `shape`: tiles, warps, stages, and the forward's structure."""
        axes = {"block_m": self.block_m, "block_n": self.block_n, "num_warps": self.num_warps,
                "num_stages": self.num_stages}
        if kernel == "fwd":
            axes["num_splits"] = self.num_splits
            if shape.kv_heads != shape.heads:
                axes["pack_gqa"] = self.pack_gqa
        return axes

    def grid(self, kernel: str, shape: Shape) -> list[LaunchConfig]:
        axes = self.axes(kernel, shape)
        return [LaunchConfig(**dict(zip(axes, values))) for values in itertools.product(*axes.values())]


GPU_SPACE = SearchSpace()
# The interpreter runs tiles as numpy arrays: a small space keeps CPU searches short.
INTERPRETER_SPACE = SearchSpace(block_m=(16, 32), block_n=(16, 32), num_warps=(4,), num_stages=(1,), num_splits=(0, 2),
                                pack_gqa=(1,))


def shared_memory_bytes(kernel: str, spec: KernelSpec, config: LaunchConfig) -> int:
    """Estimate of a kernel's shared memory: resident tiles plus num_stages copies of streamed tiles.

    Matches Triton 3.6's reports on sm_90 for the heuristic configs (see fatune.offline).
    """
    element = ELEMENT_BYTES[spec.dtype]
    d, dv = lanes(spec.head_dim), lanes(spec.head_dim_v)
    m, n, stages = config.block_m, config.block_n, config.num_stages
    if kernel == "fwd":  # Q tile resident, K and V tiles streamed
        return element * (m * d + stages * n * (d + dv))
    if kernel == "dkdv":  # K and V tiles resident, Q and dO tiles streamed
        return element * (n * (d + dv) + stages * m * (d + dv))
    return element * (m * (d + dv) + stages * n * (d + dv))  # dq: Q, dO resident, K, V streamed


def infeasible(kernel: str, spec: KernelSpec, config: LaunchConfig, shared_limit: int | None) -> str | None:
    """Why `config` cannot run well for `kernel` on a GPU with `shared_limit` bytes per block (None:
    the interpreter, where only correctness matters), decided without compiling; None if it may."""
    if shared_limit is None:
        return None
    if config.block_m * config.block_n < config.num_warps * 32 * 8:
        return f"{config.num_warps} warps for a {config.block_m}x{config.block_n} tile: under 8 elements per thread"
    if shared_limit is not None:
        needed = shared_memory_bytes(kernel, spec, config)
        if needed > shared_limit:
            return f"needs ~{needed // 1024} KiB shared memory, the GPU has {shared_limit // 1024} KiB per block"
    resident = {"fwd": config.block_m * lanes(spec.head_dim_v), "dkdv": config.block_n * (lanes(spec.head_dim)
                + lanes(spec.head_dim_v)), "dq": config.block_m * lanes(spec.head_dim)}[kernel]
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

    @classmethod
    def detect(cls, interpret: bool) -> Target:
        if interpret:
            return cls(torch.device("cpu"), True, "triton-interpreter", "cpu", None)
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA GPU is visible: run fatune search on a GPU machine, or pass --interpret "
                               "to try it on the CPU through Triton's interpreter (timings are not meaningful there)")
        props = torch.cuda.get_device_properties(0)
        limit = getattr(props, "shared_memory_per_block_optin", None) or 227 * 1024
        return cls(torch.device("cuda"), False, props.name, f"{props.major}.{props.minor}", int(limit))

    def time_ms(self, fn: Callable[[], object], quick: bool = False) -> float:
        if self.interpret:  # one wall-clock run; the number only orders candidates roughly
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        return bench(fn, warmup_ms=10 if quick else 25, rep_ms=20 if quick else 100)


@dataclass
class ShapeResult:
    shape: Shape
    config: AttentionConfig
    kernel_ms: dict[str, float]
    fwd_ms: float
    bwd_ms: float
    fwd_bwd_ms: float
    trials: int
    rejected: dict[str, int] = field(default_factory=dict)  # reason -> count
    sdpa_backend: str = ""
    sdpa_ms: float = math.nan
    seconds: float = 0.0

    @property
    def tflops(self) -> float:
        return tflops(self.shape, "fwd+bwd", self.fwd_bwd_ms)

    @property
    def speedup(self) -> float:
        return self.sdpa_ms / self.fwd_bwd_ms if self.fwd_bwd_ms > 0 else math.nan


class Checker:
    """torch's output and gradients for one shape, to check every candidate kernel against."""

    KERNEL_OUTPUTS = {"fwd": ("out",), "dkdv": ("grad_k", "grad_v"), "dq": ("grad_q",)}
    REFERENCE_NAMES = {"out": "out", "grad_q": "q", "grad_k": "k", "grad_v": "v"}

    def __init__(self, shape: Shape, inputs: dict[str, torch.Tensor]):
        from fatune.competitors import sdpa_default

        q, k, v = (inputs[name].detach().clone().requires_grad_() for name in ("q", "k", "v"))
        out = sdpa_default(shape)(q, k, v)
        out.backward(inputs["do"])
        self.reference = {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}
        self.tolerance = TOLERANCE[shape.dtype]

    def error(self, kernel: str, runner: KernelRunner) -> float:
        """Largest relative max-abs error of the kernel's outputs; inf if any element is not finite."""
        worst = 0.0
        for name in self.KERNEL_OUTPUTS[kernel]:
            actual = getattr(runner.args, name)
            reference = self.reference[self.REFERENCE_NAMES[name]]
            if not torch.isfinite(actual).all():
                return math.inf
            scale = reference.abs().max().item() or 1.0
            worst = max(worst, (actual.float() - reference.float()).abs().max().item() / scale)
        return worst


def default_storage_url(db_path: Path) -> str:
    """The SQLite Optuna storage beside a tuned DB, as a URL that keeps any '?', '%' or '#' in the name."""
    from sqlalchemy.engine import URL

    path = Path(os.path.abspath(db_path)).with_suffix(".optuna.sqlite")
    return URL.create("sqlite", database=str(path)).render_as_string(hide_password=False)


def _storage_file(url: str) -> Path | None:
    """The file an SQLite storage URL names; None for other databases and in-memory SQLite."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    database = parsed.database or ""
    if parsed.get_backend_name() != "sqlite" or database in ("", ":memory:") or database.startswith("file:"):
        return None
    return Path(database)


def _creation_lock(url: str) -> contextlib.AbstractContextManager:
    """A file lock beside an SQLite storage: Optuna's table and study creation race between processes."""
    from filelock import FileLock

    path = _storage_file(url)
    return FileLock(f"{path}.lock", timeout=300) if path is not None else contextlib.nullcontext()


def check_storage(url: str) -> Path | None:
    """ValueError naming what is wrong with an Optuna storage URL or its location, checked without
    creating anything; the SQLite file it names (None for other databases)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        make_url(url).get_dialect()
        path = _storage_file(url)
    except (ArgumentError, ImportError):
        raise ValueError(f"expected an SQLAlchemy URL such as sqlite:///studies.sqlite or postgresql://host/db "
                         f"with its driver installed, got {url!r}") from None
    if path is not None:
        if not path.parent.is_dir():
            raise ValueError(f"{url}: folder {path.parent} does not exist")
        try:
            check_writable(path)
        except DBError as error:
            raise ValueError(f"{url}: {error}") from None
    return path


def open_storage(url: str) -> optuna.storages.RDBStorage:
    """The Optuna storage at `url` (created if new, safely when several searches start at once);
    ValueError naming what is wrong with the URL or its location."""
    path = check_storage(url)
    try:
        with _creation_lock(url), warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}} if path else None,
                                              heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S)
    except Exception as error:  # noqa: BLE001 - unreachable servers, foreign databases
        raise ValueError(f"{url}: cannot open Optuna storage ({type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''})") from None


def study_name(target: Target, shape: Shape, kernel: str) -> str:
    """The Optuna study of one kernel of one shape: the tuned-DB key (fatune.db) plus batch and heads."""
    key = key_columns(target.gpu, target.capability, shape_key(shape))
    return ":".join([
        "fatune", key["gpu"], key["capability"], f"triton{key['triton_version']}", f"templates{key['template_hash']}",
        key["dtype"], f"d{key['head_dim']}", f"dv{key['head_dim_v']}", key["mask_variant"], f"g{key['group_size']}",
        f"lq{key['seqlen_q_bucket']}", f"lk{key['seqlen_k_bucket']}", f"b{shape.batch}h{shape.heads}", kernel,
    ])


class KernelSearch:
    """One Optuna study: the fastest correct LaunchConfig for one kernel of one shape."""

    def __init__(self, target: Target, shape: Shape, kernel: str, inputs: dict[str, torch.Tensor], checker: Checker,
                 base: AttentionConfig, space: SearchSpace, storage: optuna.storages.RDBStorage, seed: int):
        self.target, self.shape, self.kernel = target, shape, kernel
        self.inputs, self.checker, self.base, self.space = inputs, checker, base, space
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=10, multivariate=True)
        with _creation_lock(storage.url):
            self.study = optuna.create_study(study_name=study_name(target, shape, kernel), storage=storage,
                                             sampler=sampler, direction="minimize", load_if_exists=True)
            axes = space.axes(kernel, shape)
            self.start = {axis: value for axis, value in getattr(base, kernel).to_dict().items() if axis in axes}
            waiting = [t.system_attrs.get("fixed_params") for t in self.study.trials
                       if t.state == optuna.trial.TrialState.WAITING]
            if self.heuristic_pending() and self.start not in waiting:
                # the heuristic config goes first (again, if a killed or interrupted run did not finish
                # it): the winner is never slower than what fatune runs untuned
                self.study.enqueue_trial(self.start)

    def heuristic_pending(self) -> bool:
        """True while the heuristic config (when in the space) has no finished trial in the study."""
        axes = self.space.axes(self.kernel, self.shape)
        in_space = all(self.start[axis] in axes[axis] for axis in self.start)
        return in_space and not any(t.state in FINISHED and t.params == self.start for t in self.study.trials)

    @property
    def best_ms(self) -> float:
        done = [t for t in self.study.trials if t.state == optuna.trial.TrialState.COMPLETE]
        return min((t.value for t in done), default=math.inf)

    def best_config(self) -> LaunchConfig | None:
        done = [t for t in self.study.trials if t.state == optuna.trial.TrialState.COMPLETE]
        if not done:
            return None
        return LaunchConfig.from_dict(min(done, key=lambda t: t.value).params)

    def suggest(self, trial: optuna.Trial) -> LaunchConfig:
        return LaunchConfig(**{axis: trial.suggest_categorical(axis, list(values))
                               for axis, values in self.space.axes(self.kernel, self.shape).items()})

    def objective(self, trial: optuna.Trial) -> float:
        config = self.suggest(trial)
        reason = infeasible(self.kernel, self.shape.spec, config, self.target.shared_limit)
        if reason:
            return self._reject(trial, "infeasible", reason)
        attention_config = self.base.replace(**{self.kernel: config})
        try:
            runner = KernelRunner(self.shape, attention_config, self.inputs)
            runner.prepare()
            for name in Checker.KERNEL_OUTPUTS[self.kernel]:
                getattr(runner.args, name).fill_(float("nan"))  # poison: an unwritten element fails the check
            run = runner.run(self.kernel)
            run()
            if self.target.device.type == "cuda":
                torch.cuda.synchronize()
        except Exception as error:  # compile errors, OutOfResources, launch failures
            kind = "out_of_resources" if "OutOfResources" in type(error).__name__ else "compile_error"
            return self._reject(trial, kind, f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}")
        error = self.checker.error(self.kernel, runner)
        if not error <= self.checker.tolerance:
            return self._reject(trial, "wrong_result", f"relative error {error:.3g} > {self.checker.tolerance}")
        quick = self.target.time_ms(run, quick=True)
        trial.report(quick, step=0)
        if quick > PRUNE_FACTOR * self.best_ms:
            trial.set_user_attr("rejected", "slow")
            raise optuna.TrialPruned(f"quick timing {quick:.3f} ms > {PRUNE_FACTOR} x best {self.best_ms:.3f} ms")
        return quick if self.target.interpret else self.target.time_ms(run)

    @staticmethod
    def _reject(trial: optuna.Trial, kind: str, reason: str) -> float:
        trial.set_user_attr("rejected", kind)
        trial.set_user_attr("reason", reason)
        raise optuna.TrialPruned(reason)

    def run(self, n_trials: int, deadline: float, on_trial: Callable[[], None] | None = None) -> None:
        """Run trials until `n_trials` have finished in the study (failed and dead ones do not count),
        and at least the heuristic's if it has not finished."""
        finished = [t for t in self.study.trials if t.state in FINISHED]
        remaining = max(n_trials - len(finished), 1 if self.heuristic_pending() else 0)
        callbacks = [lambda study, trial: on_trial()] if on_trial else []
        if remaining > 0:
            self.study.optimize(self.objective, n_trials=remaining, timeout=max(1.0, deadline - time.time()),
                                callbacks=callbacks, gc_after_trial=False)

    def rejected(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for trial in self.study.trials:
            kind = trial.user_attrs.get("rejected")
            if kind:
                counts[kind] = counts.get(kind, 0) + 1
        return counts


def sdpa_best(shape: Shape, inputs: dict[str, torch.Tensor], target: Target) -> tuple[str, float]:
    """The fastest torch SDPA backend on this shape, timed as a training step in this run."""
    if target.interpret:
        return "", math.nan
    from fatune.competitors import sdpa

    best = ("", math.inf)
    for backend in ("cudnn", "flash", "efficient"):
        runner = sdpa(backend, shape)
        try:
            ms = time_training_step(runner, inputs)["fwd_bwd_ms"]
        except Exception:  # backend unavailable for this shape
            continue
        if ms < best[1]:
            best = (backend, ms)
    for name in ("q", "k", "v"):
        inputs[name].grad = None
    return best


def search_shape(shape: Shape, target: Target, *, trials: int, seconds: float,
                 storage: str | optuna.storages.RDBStorage, seed: int,
                 space: SearchSpace, on_trial: Callable[[str, float], None] | None = None) -> ShapeResult:
    """Search the three kernels of one shape; measure the winners end to end and SDPA beside them."""
    started = time.time()
    deadline = started + seconds
    if isinstance(storage, str):
        storage = open_storage(storage)
    inputs = make_inputs(shape, target.device, seed)
    checker = Checker(shape, inputs)
    base = default_config(shape.spec, None if target.interpret else torch.cuda.get_device_capability())
    chosen: dict[str, LaunchConfig] = {}
    kernel_ms: dict[str, float] = {}
    rejected: dict[str, int] = {}
    total_trials = 0
    for index, kernel in enumerate(KERNELS):
        search = KernelSearch(target, shape, kernel, inputs, checker, base, space, storage, seed)
        share = (deadline - time.time()) / (len(KERNELS) - index)
        search.run(trials, time.time() + share,
                   (lambda s=search, k=kernel: on_trial(k, s.best_ms)) if on_trial else None)
        best = search.best_config()
        if best is None:
            raise RuntimeError(f"{shape.label()}: no {kernel} config passed the checks in {len(search.study.trials)} "
                               f"trials ({search.rejected()}); give more trials or time")
        chosen[kernel], kernel_ms[kernel] = best, search.best_ms
        base = base.replace(**{kernel: best})  # later kernels run after this winner (the backward reads its LSE)
        total_trials += len(search.study.trials)
        for kind, count in search.rejected().items():
            rejected[kind] = rejected.get(kind, 0) + count
    config = AttentionConfig(**chosen)

    import fatune

    kwargs = shape.attention_kwargs(target.device)
    step = time_training_step(lambda q, k, v: fatune.attention(q, k, v, config=config, **kwargs), inputs) \
        if not target.interpret else _interpreted_step(shape, config, inputs)
    backend, sdpa_ms = sdpa_best(shape, inputs, target)
    return ShapeResult(shape, config, kernel_ms, step["fwd_ms"], step["bwd_ms"], step["fwd_bwd_ms"], total_trials,
                       rejected, backend, sdpa_ms, time.time() - started)


def _interpreted_step(shape: Shape, config: AttentionConfig, inputs: dict[str, torch.Tensor]) -> dict[str, float]:
    import fatune

    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    start = time.perf_counter()
    out = fatune.attention(q, k, v, config=config, **shape.attention_kwargs(q.device))
    middle = time.perf_counter()
    out.backward(inputs["do"])
    end = time.perf_counter()
    return {"fwd_ms": (middle - start) * 1e3, "bwd_ms": (end - middle) * 1e3, "fwd_bwd_ms": (end - start) * 1e3}


def to_entry(result: ShapeResult, target: Target) -> Entry:
    """The tuned-DB entry of a shape's winners; its key is built by fatune.db like the dispatcher's."""
    return Entry(
        **key_columns(target.gpu, target.capability, shape_key(result.shape)),
        fwd_config=result.config.fwd.to_dict(),
        bwd_config={"dkdv": result.config.dkdv.to_dict(), "dq": result.config.dq.to_dict()},
        fwd_ms=result.fwd_ms, bwd_ms=result.bwd_ms, fwd_bwd_ms=result.fwd_bwd_ms, tflops=_measured(result.tflops),
        sdpa_backend=result.sdpa_backend, sdpa_ms=_measured(result.sdpa_ms), speedup=_measured(result.speedup),
        batch=result.shape.batch, heads=result.shape.heads, seqlen_q=result.shape.seqlen_q,
        seqlen_k=result.shape.seqlen_k, trials=result.trials, interpreted=target.interpret,
    )


def _measured(value: float) -> float:
    """A measured number as the DB keeps it: NaN (not measured) unless finite and positive (no SDPA
    backend ran: infinite ms)."""
    return value if math.isfinite(value) and value > 0 else math.nan


def store(db: TunedDB, result: ShapeResult, target: Target) -> bool:
    """Upsert the shape's winners; True if they were faster than what the DB held."""
    return db.upsert(to_entry(result, target))


def default_shapes(head_dim: int, dtype: str, *, lengths=(512, 1024, 2048, 4096, 8192, 16384), causal=(False, True),
                   tokens: int = 16384, model_dim: int = 2048, kv_heads: int = 0) -> list[Shape]:
    """The standard sweep: B * L = tokens and H * D = model_dim fill an H100/H200-class GPU."""
    heads = max(1, model_dim // head_dim)
    return [Shape(batch=max(1, tokens // length), heads=heads, seqlen_q=length, seqlen_k=length, head_dim=head_dim,
                  dtype=dtype, causal=c, kv_heads=kv_heads or heads) for c in causal for length in lengths]
