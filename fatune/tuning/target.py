"""Where a search runs (Target: a GPU or Triton's interpreter) and how it times and checks candidates.

Quick timings decide what is timed in full (quick_time); every candidate's outputs are checked against
torch's before its time counts (Checker); Stopwatch sums each phase's wall time.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from fatune.hardware import Arch, device_identity, shared_memory_per_block, sm_count
from fatune.tuning.competitors import sdpa_default
from fatune.tuning.shape import Shape
from fatune.tuning.timing import KernelRunner, bench, time_calls

TOLERANCE = {"float16": 2e-2, "bfloat16": 4e-2, "float32": 1e-3}  # max |candidate - torch| / max |torch|
GRADIENT_FLOOR = 1e-3  # a gradient's scale is at least this fraction of the largest of dQ, dK and dV's


# do_bench budgets (warm-up ms, repeat ms). The candidate has just run once for the check, do_bench runs it 5 times
# to size its loops, and the full timing follows the quick one: a 1 ms warm-up is always at least one more run.
QUICK_BENCH = (1, 20)


FULL_BENCH = (1, 100)


QUICK_CALLS = 3  # a call this many times longer than the quick budget's: the median of this many calls (quick_time)


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
        return self.arch_or_none or (9, 0)

    @property
    def arch_or_none(self) -> Arch | None:
        """The GPU's compute capability; None for the interpreter (as fatune.hardware.device_arch says)."""
        major, _, minor = self.capability.partition(".")
        return (int(major), int(minor)) if major.isdigit() and minor.isdigit() else None

    @classmethod
    def detect(cls, interpret: bool) -> Target:
        if interpret:
            return cls(torch.device("cpu"), True, "triton-interpreter", "cpu", None)
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA GPU is visible: run fatune search on a GPU machine, or pass --interpret "
                               "to try it on the CPU through Triton's interpreter (timings are not meaningful there)")
        device = torch.device("cuda", torch.cuda.current_device())
        gpu, capability = device_identity(device)
        return cls(torch.device("cuda"), False, gpu, capability, shared_memory_per_block(device), sm_count(device))

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


class Checker:
    """torch's output and gradients for one shape, to check every candidate kernel against.

    Per shape: the references in float32, their scales, where torch itself is not finite; per
    candidate: one reduction per output and one synchronisation."""

    # the backward's two studies are timed and checked as the whole backward (fatune.tuning.timing.KernelRunner)
    KERNEL_OUTPUTS = {"fwd": ("out",), "dkdv": ("grad_q", "grad_k", "grad_v"), "dq": ("grad_q", "grad_k", "grad_v")}
    REFERENCE_NAMES = {"out": "out", "grad_q": "q", "grad_k": "k", "grad_v": "v"}

    def __init__(self, shape: Shape, inputs: dict[str, torch.Tensor], backward: bool = True):

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
            self._expected[name] = (expected, unchecked, expected.abs().masked_fill(~finite, 0).max().item())
        # a gradient that vanishes where the others do not (a window of one key, one kept key: dQ = dK = 0) is
        # torch's rounding noise: measured against its own scale, any exact kernel would fail it
        gradients = max((self._expected[name][2] for name in ("q", "k", "v") if name in self._expected), default=0)
        for name, (expected, unchecked, scale) in self._expected.items():
            floor = GRADIENT_FLOOR * gradients if name != "out" else 0
            self._expected[name] = (expected, unchecked, max(scale, floor) or 1.0)

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
