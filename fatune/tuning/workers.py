"""A search's worker processes on one host: one per visible GPU (each pinned with
CUDA_VISIBLE_DEVICES), or N CPU processes in Triton's interpreter, all on the same Optuna studies.

The `fatune search` process is the first worker: it tunes every shape and, as each shape's
studies are done (it does not wait for them before starting the next shape's trials), re-times
the winners and stores them in this host's tuned DB. The others
(helpers) only run trials, shape after shape, while the studies want them, then exit; the
same command on other hosts joins the same studies through a shared storage. Each worker
compiles its next candidates in its own pool (fatune.tuning.precompile) of the CPU cores left to it; what
their compiles print goes to the search's one log (fatune.tuning.compile_log).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from dataclasses import dataclass

from fatune.tuning import compile_log
from fatune.tuning.precompile import CompilePool
from fatune.tuning.shape import Shape
from fatune.tuning.space import SearchSpace
from fatune.tuning.storage import open_storage
from fatune.tuning.target import Target
from fatune.tuning.trials import help_search_shape

MAX_COMPILE_WORKERS = 8  # compiles (0.5-2.6 s each) in flight per GPU: enough to outpace its timing
JOIN_S = 60  # how long an interrupted helper may take to fail its trials in flight before it is killed


@dataclass(frozen=True)
class Job:
    """What every worker of a search runs (sent to the helpers as it is)."""

    shapes: tuple[Shape, ...]
    trials: int
    seconds: float
    storage: str
    seed: int
    space: SearchSpace
    interpret: bool
    compile_workers: int
    log: str = ""  # the search's log of compiler output (default: one of the helper's own)


def visible_gpus() -> list[str]:
    """This process's GPUs, named as CUDA_VISIBLE_DEVICES names them to a child."""
    import torch

    count = torch.cuda.device_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(index) for index in range(count)]
    return [name.strip() for name in listed.split(",") if name.strip()][:count]


def worker_count(requested: int | None, interpret: bool) -> int:
    """The number of workers: `requested` (ValueError if more than the visible GPUs: two workers on one
    GPU would time each other's kernels; in the interpreter, more than process_cap()), else one per visible GPU
    (one in the interpreter)."""
    if interpret:
        if requested and requested > process_cap():
            raise ValueError(f"expected at most {process_cap()} with --interpret (four per CPU core), got {requested}")
        return requested or 1
    gpus = len(visible_gpus())
    if requested is None:
        return max(gpus, 1)
    if gpus and requested > gpus:
        raise ValueError(f"expected at most {gpus}, one worker per visible GPU (CUDA_VISIBLE_DEVICES chooses "
                         f"them), got {requested}")
    return requested


def compile_worker_count(requested: int | None, workers: int, interpret: bool) -> int:
    """Compile processes per worker: `requested` (ValueError above process_cap()), else the CPU cores per worker
    less the one that times (at most MAX_COMPILE_WORKERS); none in the interpreter, which compiles nothing."""
    if requested is not None:
        if requested > process_cap():
            raise ValueError(f"expected at most {process_cap()} (four per CPU core), got {requested}")
        return requested
    if interpret:
        return 0
    return max(1, min(MAX_COMPILE_WORKERS, _cores() // workers - 1))


def process_cap() -> int:
    """The most processes of one kind a search starts on this host: four per CPU core, at least 16 (more only
    queue for the cores; a typo of 100000 would start them all)."""
    return max(16, 4 * _cores())


def _cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _helper(job: Job, index: int, gpu: str | None) -> None:
    """A helper process: its share of every shape's trials; exit 130 when interrupted, 1 on an error."""
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the first worker stops the helpers (SIGTERM) on Ctrl-C
    signal.signal(signal.SIGTERM, _interrupt)
    compile_log.start(job.log or None)
    try:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.ERROR)
        storage = open_storage(job.storage)
        target = Target.detect(job.interpret)
        with CompilePool(job.compile_workers, target.device.type) as pool:
            for shape in job.shapes:
                help_search_shape(shape, target, trials=job.trials, seconds=job.seconds, storage=storage,
                                  seed=job.seed, space=job.space, pool=pool)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as error:  # noqa: BLE001 - one line, not a traceback; the other workers go on
        print(f"fatune search: worker {index + 1}{f' (GPU {gpu})' if gpu else ''}: {type(error).__name__}: "
              f"{error}", file=sys.stderr)
        sys.exit(1)


class Helpers:
    """Workers 2..`count` of a search, started on entry and joined on exit; on an error or Ctrl-C in
    the first worker they are stopped (they fail their trials in flight) and killed if they hang."""

    def __init__(self, job: Job, count: int):
        self.job, self.count = job, count
        self.processes: list[multiprocessing.Process] = []

    def __enter__(self) -> Helpers:
        context = multiprocessing.get_context("spawn")  # never fork a process that may hold a CUDA context
        gpus = [] if self.job.interpret else visible_gpus()
        for index in range(1, self.count):
            gpu = gpus[index] if index < len(gpus) else None
            process = context.Process(target=_helper, args=(self.job, index, gpu), name=f"fatune-worker-{index + 1}")
            process.start()
            self.processes.append(process)
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            for process in self.processes:
                process.terminate()
        for process in self.processes:
            process.join(JOIN_S if exc_type is not None else None)
            if process.is_alive():
                process.kill()
                process.join()

    def failures(self) -> list[str]:
        """One line per helper that did not end well (after exit)."""
        return [f"{process.name} exited with code {process.exitcode}" for process in self.processes
                if process.exitcode not in (0, None)]
