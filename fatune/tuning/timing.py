"""Timing of attention implementations, as search and bench both need it.

Rules (METHOD): random inputs (never zeros), warm-up and compile kept out of the timed
region, CUDA events through `triton.testing.do_bench` (which also flushes L2 before each
repeat), median of the repeats. Forward+backward is timed as a training step runs it:
forward, then backward from a random dO, gradients reset between repeats.
"""

from __future__ import annotations

import math
import time
from types import SimpleNamespace
from typing import Callable

import torch

from fatune.call import Call
from fatune.db import MIN_TIME_MS
from fatune.kernel.family import family
from fatune.kernel.spec import AttentionConfig
from fatune.kernel.triton import dropout
from fatune.kernel.triton.launch import KernelBuildError
from fatune.tuning.shape import Shape


def bench(fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 100,
          grad_to_none: list[torch.Tensor] | None = None) -> float:
    """Median milliseconds of fn() on the current CUDA device (do_bench: events, L2 flushed)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none,
                                         return_mode="median"))


_flush_buffers: dict[int, torch.Tensor] = {}  # per CUDA device: what time_calls writes over to flush L2


def time_calls(fn: Callable[[], object], calls: int) -> list[float]:
    """Milliseconds of each of `calls` calls of fn() on the current CUDA device (events; L2 flushed before
    each, as do_bench does); fn must have run once already (compiled, loaded)."""
    from triton import runtime

    driver = runtime.driver.active
    device = driver.get_device_interface()
    cache = _flush_buffers.get(device.current_device())
    if cache is None:
        cache = _flush_buffers[device.current_device()] = driver.get_empty_cache_for_benchmark()
    events = [(device.Event(enable_timing=True), device.Event(enable_timing=True)) for _ in range(calls)]
    for start, end in events:
        driver.clear_cache(cache)
        start.record()
        fn()
        end.record()
    device.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def kernel_times(fn: Callable[[], object], calls: int = 50) -> dict[str, float]:
    """GPU microseconds per call of each kernel that fn launches (torch.profiler), after a warm-up:
    which kernel of a call is the slow one."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] = totals.get(event.name, 0.0) + event.device_time / calls
    return totals


def tflops(shape: Shape, passes: str, ms: float) -> float:
    return shape.flops(passes) / (ms * 1e-3) / 1e12 if ms > 0 and math.isfinite(ms) else 0.0


class KernelRunner:
    """Launches fatune's kernels one at a time on fixed inputs and buffers, for per-kernel timing.

    `args` holds the buffers the kernels write (out, lse, delta, grad_q, grad_k, grad_v) and grad_out.
    """

    def __init__(self, shape: Shape, config: AttentionConfig, inputs: dict[str, torch.Tensor]):

        self.shape, self.config = shape, config
        q, k, v = (inputs[name].detach() for name in ("q", "k", "v"))
        call = Call(**shape.attention_kwargs(q.device))
        self.plan = family(config.family).plan(call.check(q, k, v), config, q.device, q, k, v, None, None)
        out, lse = self.plan.allocate_forward()
        buffers = self.plan.allocate_backward(atomic=True)  # the config's kernels as configured, whatever torch's mode
        delta, grad_q, grad_k, grad_v, _ = buffers
        grad_out = inputs["do"]
        self.args = SimpleNamespace(out=out, lse=lse, delta=delta, grad_q=grad_q, grad_k=grad_k, grad_v=grad_v,
                                    grad_out=grad_out)
        seed = dropout.draw_seed(q.device) if self.plan.uses_seed else None
        self.slots = self.plan.slots(q, k, v, out, lse, call.extras, seed, backward=True) + (grad_out, *buffers)

    def run(self, kernel: str) -> Callable[[], None]:
        """A no-argument callable launching the forward ('fwd', split-KV's merge included) or the
        whole backward ('dq', 'dkdv' or 'bwd': its two configs share the work, and with atomic dQ one
        kernel does both's, so either is timed as the backward a training step runs)."""
        if kernel == "fwd":
            return lambda: self.plan.run_forward(self.slots)
        if kernel not in ("dq", "dkdv", "bwd"):
            raise ValueError(f"kernel: expected 'fwd', 'dq', 'dkdv' or 'bwd', got {kernel!r}")
        launches = self.plan.bwd_launches(self.args.grad_out, atomic=True)
        beside = self.plan.beside()
        return lambda: self.plan.run_backward(self.slots, launches, beside)

    def prepare(self) -> None:
        """Run the forward once so the backward reads a real O and LSE."""
        self.run("fwd")()

    def check_built(self) -> None:
        """KernelBuildError if a kernel of the config did not run as configured: a Gluon forward that could not
        be built here hands its calls to the Triton forward, whose time must not count as the Gluon config's."""
        failure = getattr(self.plan, "build_failure", None)
        if failure:
            raise KernelBuildError(failure)


def compile_seconds(fn: Callable[[], object]) -> float:
    """Wall time of the first call (compile + one launch), synchronised."""
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def time_training_step(attention: Callable[..., torch.Tensor], inputs: dict[str, torch.Tensor],
                       warmup_ms: float = 25, rep_ms: float = 100) -> dict[str, float]:
    """Forward ms, forward+backward ms (and backward as their difference) of attention(q, k, v)."""
    q, k, v, grad_out = inputs["q"], inputs["k"], inputs["v"], inputs["do"]

    def forward():
        with torch.no_grad():
            return attention(q, k, v)

    def step():
        attention(q, k, v).backward(grad_out)

    compile_s = compile_seconds(step) + compile_seconds(forward)  # without autograd, a forward may build apart
    fwd = bench(forward, warmup_ms, rep_ms)
    total = bench(step, warmup_ms, rep_ms, grad_to_none=[q, k, v])
    # a training step timed no slower than its forward (noise on a tiny problem): the shortest time an entry holds
    return {"fwd_ms": fwd, "bwd_ms": max(total - fwd, MIN_TIME_MS), "fwd_bwd_ms": total, "compile_s": compile_s}


def time_step_only(attention: Callable[..., torch.Tensor], inputs: dict[str, torch.Tensor],
                   warmup_ms: float = 25, rep_ms: float = 100) -> dict[str, float]:
    """Forward+backward ms of attention(q, k, v) through autograd, and the seconds of its first call (a
    backend's plan or a kernel's build) apart: the training step alone, for a yardstick that needs no
    forward/backward split."""
    q, k, v, grad_out = inputs["q"], inputs["k"], inputs["v"], inputs["do"]

    def step():
        attention(q, k, v).backward(grad_out)

    compile_s = compile_seconds(step)
    return {"fwd_bwd_ms": bench(step, warmup_ms, rep_ms, grad_to_none=[q, k, v]), "compile_s": compile_s}


def time_forward(attention: Callable[..., torch.Tensor], inputs: dict[str, torch.Tensor],
                 warmup_ms: float = 25, rep_ms: float = 100) -> dict[str, float]:
    """Forward ms of attention(q, k, v) without autograd, as inference runs it; the backward is not timed
    (bwd_ms and fwd_bwd_ms NaN)."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]

    def forward():
        with torch.no_grad():
            return attention(q, k, v)

    compile_s = compile_seconds(forward)
    return {"fwd_ms": bench(forward, warmup_ms, rep_ms), "bwd_ms": math.nan, "fwd_bwd_ms": math.nan,
            "compile_s": compile_s}
