"""Compiling a search's next candidates ahead on the CPU cores while the GPU times the current one.

Compiling a candidate is the first launch of its kernels. Triton's `JITFunction.warmup`
compiles without launching and writes the binary into Triton's on-disk cache
(TRITON_CACHE_DIR, default ~/.triton/cache), so the timing process's first launch of the
candidate is a cache hit. A hit needs the identical specialisation: argument dtypes, integer
values (Triton specialises them on == 1 and % 16), pointer alignment (16 bytes), constexprs
and options. So a pool process runs the trial exactly as the timing process does --
`KernelRunner` on inputs of the same sizes, strides, dtype and device (allocated, never
written), `prepare()`, then the kernel -- with every `launch.KernelLaunch` call turned into a
`warmup` of the same function with the same arguments, grid and options.

In Triton's interpreter nothing is compiled; the pool then only renders and imports the modules.

What a compile writes to the pool process's fds 1 and 2 (Triton's C++ side prints there: an MLIR
pass's failure and its IR dump) is captured and sent back with its result (Compiled), for the
search to log rather than show.
"""

from __future__ import annotations

import multiprocessing
import signal
import sys
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass

import torch

from fatune.kernel.spec import DTYPES, AttentionConfig
from fatune.kernel.triton import launch
from fatune.tuning.compile_log import captured, details, error_line
from fatune.tuning.shape import Shape
from fatune.tuning.timing import KernelRunner


def stand_in_inputs(shape: Shape, device: torch.device | str) -> dict[str, torch.Tensor]:
    """q, k, v and dO with the sizes, strides, dtype and device of measure.make_inputs', never written."""
    dtype = DTYPES[shape.dtype]
    return {name: torch.empty(size, dtype=dtype, device=device) for name, size in shape.input_sizes().items()}


@dataclass(frozen=True)
class Compiled:
    """How a pool process's compile of a trial ended: `error`, one line (None: it compiled), `output`, what
    the compile wrote to fds 1 and 2, and the error's `traceback`."""

    error: str | None
    output: str = ""
    traceback: str = ""


def _compile(shape: Shape, config: AttentionConfig, kernel: str, device: str) -> None:
    try:
        runner = KernelRunner(shape, config, stand_in_inputs(shape, device))
        runner.prepare()
        runner.check_built()  # a Gluon forward that cannot be built here compiled the Triton one instead
        runner.run(kernel)()
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()  # the stand-ins' memory goes back to the GPU the timing process uses


def compile_trial(shape: Shape, config: AttentionConfig, kernel: str, device: str) -> str | None:
    """Compile, without launching, what a trial of `kernel` with `config` launches; None, or why it does
    not compile (the trial is then rejected without compiling it again)."""
    try:
        _compile(shape, config, kernel, device)
    except Exception as error:  # noqa: BLE001 - Triton's compile errors have many types
        return error_line(error)
    return None


def compile_candidate(shape: Shape, config: AttentionConfig, kernel: str, device: str) -> Compiled:
    """compile_trial, with what the compile writes to fds 1 and 2 captured instead of reaching the
    terminal (what the pool runs)."""
    error, traceback = None, ""
    with captured() as output:
        try:
            _compile(shape, config, kernel, device)
        except Exception as failure:  # noqa: BLE001 - Triton's compile errors have many types
            error, traceback = error_line(failure), details(failure)
    return Compiled(error, output.text, traceback)


def _start_compiler() -> None:
    """A pool process: launches compile instead (the pool does nothing else); Ctrl-C is the timing
    process's to handle (it fails its trials, then shuts the pool down)."""

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    launch.compile_only()


def _warm_up(device: str) -> None:
    """What a pool process's first compile would otherwise wait for: the device's context and Triton's
    backend for it."""
    if device == "cuda":
        import triton

        torch.empty(1, device=device)
        triton.runtime.driver.active.get_current_target()


class CompilePool:
    """`processes` spawned processes compiling candidates; once the pool breaks, `submit` returns None
    and the timing process compiles as it would alone."""

    def __init__(self, processes: int, device: str = "cuda"):
        self.processes, self.device = processes, device
        self._executor: ProcessPoolExecutor | None = None
        if processes > 0:
            self._executor = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=_start_compiler)
            for _ in range(processes):  # start them all now (each imports torch and Triton for seconds), not on
                self._executor.submit(_warm_up, device)  # the first candidates' submits

    def submit(self, shape: Shape, config: AttentionConfig, kernel: str) -> Future | None:
        if self._executor is None:
            return None
        try:
            return self._executor.submit(compile_candidate, shape, config, kernel, self.device)
        except RuntimeError:  # BrokenProcessPool, or shut down
            self._executor = None
            return None

    def __enter__(self) -> CompilePool:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=exc_type is None, cancel_futures=True)


def compiled(future: Future | None) -> Compiled | None:
    """How a precompile ended (waiting for it); None when it did not run (a broken pool, a stand-in it
    could not build: the timing process compiles as usual)."""
    if future is None:
        return None
    try:
        return future.result()
    except Exception:  # noqa: BLE001
        return None


def compile_error(future: Future | None) -> str | None:
    """What a precompile found (waiting for it): the compile error, or None when it compiled or did not
    run. What the compile printed is printed here, as it would have been without the pool's capture."""
    result = compiled(future)
    if result is None:
        return None
    if result.output:
        print(result.output, end="" if result.output.endswith("\n") else "\n", file=sys.stderr, flush=True)
    return result.error
