"""One kernel's Optuna study for one shape (KernelSearch), shared by every process that searches the shape.

Each of the forward, dK/dV and dQ configs gets its own study (multivariate TPE, seeded per trial). Every trial
tries a config no other trial of its study has tried: a draw whose tiles cannot fit (shared-memory estimate,
too many warps for the tile) is rejected before compiling and drawn again, as is one that repeats a tried
config, and neither counts as a trial. A compile error or OutOfResources prunes a trial (one line on the
terminal; the compiler's output goes to the search's log: fatune.tuning.compile_log); a trial's output is
checked against torch before its time counts; a trial whose quick timing is far behind the best is pruned
before the full timing. Each study runs the built-in heuristic config first, once however many processes share
it, so a winner is never slower than what fatune runs untuned. A study's name (study_name) encodes the whole
tuned-DB key, so an interrupted search resumes where it stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import random
import socket
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import optuna
import torch

from fatune.db import is_decode, key_columns, seqlen_bucket
from fatune.hardware import sm_count
from fatune.kernel.family import family
from fatune.kernel.gluon.family import default_backward, default_forward
from fatune.kernel.spec import KERNELS, AttentionConfig, GluonBackwardConfig, GluonConfig, KernelSpec, LaunchConfig
from fatune.kernel.triton.structure import runnable_backward
from fatune.tuning import compile_log, precompile
from fatune.tuning import storage as storage_module
from fatune.tuning.precompile import CompilePool
from fatune.tuning.shape import Shape, shape_key
from fatune.tuning.space import (GLUON_BACKWARD, GLUON_FORWARD, GLUON_STUDIES, SearchSpace, axes_digest, default_space, infeasible, make_config,
                                  slot, trial_budget)
from fatune.tuning.storage import Heartbeat, storage_lock
from fatune.tuning.target import Checker, Stopwatch, Target
from fatune.tuning.timing import KernelRunner

PRUNE_FACTOR = 1.5  # quick timing this much slower than the best so far: pruned


CONTENDER_FACTOR = 1.1  # quick timing within this factor of the best so far: timed in full (else its quick time counts)


FINISHED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)


# A draw the resource model rejects (nothing compiled or timed) or that repeats a config already tried or in flight
# costs no trial: the sampler draws again, up to this many times; then an untried feasible config is queued instead
# (a TPE that has converged on a categorical space keeps drawing its best: in the sampler's offline run over the
# H200's d128 spaces, 8-14 of 30 draws were such)
FREE_DRAWS = 8


RUNNING = optuna.trial.TrialState.RUNNING


WAITING = optuna.trial.TrialState.WAITING


POLL_S = 0.5  # how often a process waiting for others' trials of a shape looks again


# Where a process's wall time on a shape goes (ShapeResult.breakdown, seconds): per trial, the phases each trial
# records as its user attr "seconds" (ask, compile_wait, build, check, quick, full) and telling it to its
# study (tell); per shape, the fixed costs.
TRIAL_PHASES = ("ask", "compile_wait", "build", "check", "quick", "full", "tell")


def counts(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether `trial` is one of the study's trials (its budget, its checkpoints): a finished config that was
    compiled or timed, not a draw the resource model rejected before compiling (nor a repeated one: FAIL)."""
    return trial.state in FINISHED and trial.user_attrs.get("rejected") != "infeasible"


def forward_only(shape: Shape) -> bool:
    """An inference shape (decode: at most DECODE_QUERIES queries per sequence, the test the heuristic
    uses): only its forward is searched and timed; its backward configs are the heuristic's."""
    return is_decode(seqlen_bucket(shape.seqlen_q))


def shape_kernels(shape: Shape, target: Target | None = None, space: SearchSpace | None = None) -> tuple[str, ...]:
    """The studies searched for `shape`, in search order: the Triton family's kernels (the forward's alone for a
    forward-only shape), with the Gluon forward's (GLUON_FORWARD) after the forward's and the Gluon backward's
    (GLUON_BACKWARD) after dK/dV's where `space` (default: the target's) searches that family and it serves the
    shape on `target`'s GPU."""
    kernels = ("fwd",) if forward_only(shape) else KERNELS
    if target is None or "gluon" not in (space or default_space(target)).families:
        return kernels
    gluon = family("gluon")
    studies = []
    for kernel in kernels:
        studies.append(kernel)
        if kernel == "fwd" and gluon.serves(shape.spec, target.device) is None:
            studies.append(GLUON_FORWARD)
        if kernel == "dkdv" and gluon.serves_backward(shape.spec, target.device) is None:
            studies.append(GLUON_BACKWARD)
    return tuple(studies)


def study_family(kernel: str) -> str:
    """The kernel family a study's configs belong to."""
    return "gluon" if kernel in GLUON_STUDIES else "triton"


def study_name(target: Target, shape: Shape, kernel: str, space: SearchSpace | None = None) -> str:
    """The Optuna study of one kernel of one shape: the installation and kernel spec of the tuned-DB key
    (fatune.db), with the hash of the sources its search can render (its family's search_hash) for the
    templates' part, the hash of its axes in `space` (default: the target's) so that a space that gains or loses an axis
    or a value starts new studies, and the shape itself (its lengths, window, padding and documents, batch and
    heads: two shapes that share a DB key are still different problems, whose trials must not mix in one study)."""

    key = key_columns(target.gpu, target.capability, shape_key(shape), "")
    templates = family(study_family(kernel)).search_hash(shape.spec, shape.kv_heads != shape.heads)
    templates += "-" + axes_digest(space or default_space(target), target, shape, kernel)
    sizes = [f"w{shape.window}"] if "window" in key["mask_variant"] else []  # a window the call keeps
    sizes += [f"keys{shape.kept_keys}"] if shape.valid_keys < 1.0 else []
    sizes += [f"docs{shape.documents}"] if shape.documents else []
    return ":".join([
        "fatune", key["gpu"], key["capability"], f"triton{key['triton_version']}", f"templates{templates}",
        key["dtype"], f"d{key['head_dim']}", f"dv{key['head_dim_v']}", key["mask_variant"], "+".join(sizes) or "-",
        f"g{key['group_size']}", f"lq{shape.seqlen_q}", f"lk{shape.seqlen_k}", f"b{shape.batch}h{shape.heads}", kernel,
    ])


# How a study draws its trials (`fatune bench --suite search-quality --sampler` compares them): multivariate TPE over all
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
    config: LaunchConfig | GluonConfig
    compiled: Future | None
    seconds: dict[str, float] = field(default_factory=dict)  # TRIAL_PHASES so far

    def compiled_yet(self) -> bool:
        return self.compiled is None or self.compiled.done()


def heuristic_params(heuristic: AttentionConfig, kernel: str, spec: KernelSpec, axes: dict) -> dict[str, int]:
    """The heuristic's trial of `kernel` (its values on `axes`), as it runs for `spec`: an atomic-dQ kind the
    head dim cannot take runs as the next one down, which is what the space offers (TMA reductions exist
    wherever a heuristic asks for them: Hopper). The Gluon forward's study starts from `heuristic`'s forward if
    it is a Gluon one, else from the family's default (default_forward); a config of the other family has no
    values on a study's axes ({})."""
    if kernel == GLUON_FORWARD:
        forward = heuristic.fwd if isinstance(heuristic.fwd, GluonConfig) else default_forward(spec)
        return {axis: value for axis, value in dataclasses.asdict(forward).items() if axis in axes}
    if kernel == GLUON_BACKWARD:
        backward = heuristic.dkdv if isinstance(heuristic.dkdv, GluonBackwardConfig) else default_backward(spec)
        return {axis: value for axis, value in dataclasses.asdict(backward).items() if axis in axes}
    if kernel == "fwd" and isinstance(heuristic.fwd, GluonConfig) or \
            kernel == "dkdv" and isinstance(heuristic.dkdv, GluonBackwardConfig):
        return {}
    if isinstance(heuristic.dkdv, GluonBackwardConfig):  # the dQ study's runs beside the Triton family's dK/dV
        heuristic = heuristic.replace(dkdv=family("gluon").triton_part(spec, heuristic).dkdv)
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
        self.slot = slot(kernel)  # the AttentionConfig field its configs fill
        self.storage, self.seed, self.deadline = storage, seed, deadline
        self.axes = space.axes(kernel, shape, target.sms)
        self.points = space.feasible(kernel, shape, target)
        self.trials = trial_budget(space, target, shape, kernel, trials)
        self.exhausted = False  # every feasible point tried or held, as the last ask found
        self.spec = shape.spec
        if kernel in KERNELS and not isinstance(getattr(heuristic, kernel), LaunchConfig):
            # the built-in config runs a Gluon kernel here: this Triton study starts from the Triton family's own
            triton = family().heuristic(shape.problem, target.arch_or_none, target.sms or sm_count(target.device))
            heuristic = heuristic.replace(**{kernel: getattr(triton, kernel)})
        self.heuristic = heuristic
        self.start = heuristic_params(heuristic, kernel, shape.spec, self.axes)
        # what this process knows of the study without asking the storage again: the best trial as of its last
        # census or tell, when it last looked for dead trials, and until when a study it found with all its
        # trials finished or held need not be asked again (only a dead trial can change that, found in >= GRACE_S)
        self.known_best: tuple[float, LaunchConfig | GluonConfig | None] = (math.inf, None)
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
        if not all(self.start.get(axis) in values for axis, values in self.axes.items()):
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
            if infeasible(self.kernel, self.spec, make_config(self.kernel, params), self.target.shared_limit,
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
            self.known_best = (value, make_config(self.kernel, params))
        if self.kernel == "dkdv" and not params.get("atomic_dq") and value < self.known_best_separate[0]:
            self.known_best_separate = (value, LaunchConfig.from_dict(params))

    def wants_trial(self) -> bool:
        """Whether this process should start one more trial: a queued heuristic always runs; others
        while the finished and held trials are fewer than the budget and the time lasts."""
        if time.monotonic() < self._full_until:
            return False  # full at the last census, under POLL_S ago
        return self.wants(*self.census())

    def wants(self, finished: int, running: int, heuristic_waits: bool) -> bool:
        """Whether a census (`census`'s tuple) leaves room for one more trial of this process."""
        wants = heuristic_waits or (time.time() < self.deadline and finished + running < self.trials
                                    and not self.exhausted)
        if not wants:
            self._full_until = time.monotonic() + POLL_S
        return wants

    @property
    def best_ms(self) -> float:
        done = self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        return min((t.value for t in done), default=math.inf)

    def best_config(self) -> LaunchConfig | GluonConfig | None:
        done = self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        if not done:
            return None
        return make_config(self.kernel, min(done, key=lambda t: t.value).params)

    def suggest(self, trial: optuna.Trial) -> tuple[LaunchConfig | GluonConfig | None, str | None]:
        """The trial's config and why it cannot run (None if it may): a combination its family refuses (no
        config) or the resource model rejects."""
        params = {axis: trial.suggest_categorical(axis, list(values)) for axis, values in self.axes.items()}
        try:
            config = make_config(self.kernel, params)
        except ValueError as error:
            return None, str(error)
        return config, infeasible(self.kernel, self.spec, config, self.target.shared_limit, self.target.arch)

    def ask(self, base: AttentionConfig, heartbeat: Heartbeat, pool: CompilePool | None,
            clock: Stopwatch | None = None) -> Candidate | None:
        """Start a trial of a feasible config not tried yet, and its compile in `pool`; None if no such config
        is left (`exhausted`). A draw the resource model rejects (told pruned: the sampler learns to avoid it) is
        drawn again; from the FREE_DRAWS-th draw on, an untried feasible config is queued first, which the next
        ask takes. A draw that repeats a config (told failed: the sampler learns nothing) queues the untried
        feasible config nearest to it: the sampler has settled there, and drawing again mostly repeats it (each
        draw costs a trial in the storage)."""
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
                config, reason = self.suggest(trial)
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
                if not self._queue_untried(near=config):
                    self.exhausted = True
                    return None
            else:
                compiled = pool.submit(self.shape, base.replace(**{self.slot: config}), self.slot) if pool else None
                return Candidate(self, trial, config, compiled, seconds)
        raise AssertionError("unreachable")

    def _held_or_tried(self, number: int | None = None) -> set[LaunchConfig | GluonConfig]:
        """The configs of the study's trials that finished (infeasible draws aside), run or wait in its queue,
        but trial `number` (the one being asked)."""
        held = set()
        for trial in self.study.get_trials(deepcopy=False, states=(*FINISHED, RUNNING, WAITING)):
            params = trial.params or trial.system_attrs.get("fixed_params") or {}
            if trial.number != number and trial.user_attrs.get("rejected") != "infeasible" and set(self.axes) <= set(params):
                held.add(make_config(self.kernel, {axis: params[axis] for axis in self.axes}))
        return held

    def _queue_untried(self, near: LaunchConfig | GluonConfig | None = None) -> bool:
        """Queue a feasible config no trial holds, drawn from (seed, the study's trial count) among all of them, or
        among those nearest to `near` (fewest steps along the axes' values); False if none is left."""
        with storage_lock(self.storage.url):
            untried = sorted(self.points - self._held_or_tried(), key=str)
            if not untried:
                return False
            if near is not None:
                steps = {config: self._steps(config, near) for config in untried}
                nearest = min(steps.values())
                untried = [config for config in untried if steps[config] == nearest]
            pick = random.Random(self.seed * 1_000_003 + len(self.study.get_trials(deepcopy=False))).choice(untried)
            self.study.enqueue_trial({axis: getattr(pick, axis) for axis in self.axes}, user_attrs={"untried": True})
        return True

    def _steps(self, config: LaunchConfig | GluonConfig, other: LaunchConfig | GluonConfig) -> int:
        """How far apart two configs are: the steps between their values along each axis (in the axis' order)."""
        def position(values: tuple, value) -> int:
            return values.index(value) if value in values else len(values)

        return sum(abs(position(values, getattr(config, axis)) - position(values, getattr(other, axis)))
                   for axis, values in self.axes.items())

    def finish(self, candidate: Candidate, base: AttentionConfig, inputs: dict[str, torch.Tensor], checker: Checker,
               heartbeat: Heartbeat, clock: Stopwatch | None = None) -> None:
        """Time the candidate (after its compile) and tell the study how it ended."""
        self._tell(candidate.trial, heartbeat, lambda: self.evaluate(
            candidate.trial, candidate.config, base, inputs, checker,
            precompiled(self.describe(candidate.config), candidate.compiled), candidate.seconds),
            candidate.seconds, clock)

    def describe(self, config: LaunchConfig | GluonConfig) -> str:
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

    def evaluate(self, trial: optuna.Trial, config: LaunchConfig | GluonConfig, base: AttentionConfig,
                 inputs: dict[str, torch.Tensor], checker: Checker, compile_failure: str | None = None,
                 seconds: dict[str, float] | None = None) -> float:
        """The candidate's time; TrialPruned if it does not compile or launch, is wrong, or is slow.

        Its quick timing decides: more than PRUNE_FACTOR x the best so far, pruned (the heuristic
        never is, nor a trial the interpreter times: its wall times are noise, and a pruned trial's
        state would vary from run to run); more than CONTENDER_FACTOR x the best, that is its time
        (it cannot win); else it
        is timed in full. So the best is always a full timing. Each phase's wall time is added to
        `seconds`."""
        clock = Stopwatch()
        if seconds is not None:
            clock.seconds = seconds
        if compile_failure:
            kind = "out_of_resources" if compile_failure.startswith("OutOfResources") else "compile_error"
            return self._reject(trial, kind, compile_failure)
        attention_config = base.replace(**{self.slot: config})
        try:
            # its first launch compiles (unless the pool did): the compiler's output goes to the search log
            with clock("build"), compile_log.captured() as output:
                runner = KernelRunner(self.shape, attention_config, inputs)
                runner.prepare()
                for name in Checker.KERNEL_OUTPUTS[self.slot]:
                    getattr(runner.args, name).fill_(float("nan"))  # poison: an unwritten element fails the check
                run = runner.run(self.slot)
                run()
                runner.check_built()
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
            error = checker.error(self.slot, runner)
        if not error <= checker.tolerance:
            return self._reject(trial, "wrong_result", f"relative error {error:.3g} > {checker.tolerance}")
        best_ms = self.known_best[0]
        # the heuristic is always timed in full; an interpreter's wall times (noise) prune nothing
        prunable = trial.params != self.start and not self.target.interpret
        with clock("quick"):
            quick = self.target.time_ms(run, quick=True, prune_above=PRUNE_FACTOR * best_ms if prunable else math.inf)
        with clock("tell"):
            trial.report(quick, step=0)
        if quick > PRUNE_FACTOR * best_ms and prunable:
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
