"""What the timing suites share: where they run, how a call is timed there, and a shape as row columns.

On a CUDA GPU a call is timed by `fatune.tuning.timing` (warm-up and first call kept out of the timed region,
CUDA events through `triton.testing.do_bench`, L2 flushed before each repeat, the median); in Triton's
interpreter on the CPU (`--interpret`, for smoke runs) by the wall clock of one call after one untimed call:
those numbers only show that every path runs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from fatune.db import MIN_TIME_MS
from fatune.settings import interpreting
from fatune.tuning.shape import Shape
from fatune.tuning.timing import time_forward, time_training_step

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def bench_device() -> torch.device:
    """The CPU in Triton's interpreter, else the current CUDA device."""
    return torch.device("cpu") if interpreting() or not torch.cuda.is_available() else torch.device("cuda")


def on_gpu(device: torch.device) -> bool:
    return device.type == "cuda"


def _wall_ms(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def time_step(attention: Attention, inputs: dict[str, torch.Tensor], warmup_ms: float = 25,
              rep_ms: float = 100) -> dict[str, float]:
    """Forward, backward and forward+backward ms of a training step through autograd (forward, then backward
    from the random dO; gradients reset between repeats), and the first call's seconds (compile_s)."""
    q, k, v, grad_out = inputs["q"], inputs["k"], inputs["v"], inputs["do"]
    if q.device.type == "cuda":
        return time_training_step(attention, inputs, warmup_ms, rep_ms)

    def forward():
        with torch.no_grad():
            attention(q, k, v)

    def step():
        for tensor in (q, k, v):
            tensor.grad = None
        attention(q, k, v).backward(grad_out)

    compile_s = _wall_ms(step) / 1e3
    fwd, total = _wall_ms(forward), _wall_ms(step)
    return {"fwd_ms": fwd, "bwd_ms": max(total - fwd, MIN_TIME_MS), "fwd_bwd_ms": total, "compile_s": compile_s}


def time_inference(attention: Attention, inputs: dict[str, torch.Tensor], warmup_ms: float = 25,
                   rep_ms: float = 100) -> dict[str, float]:
    """Forward-only ms without autograd (as inference runs it) and the first call's seconds."""
    if inputs["q"].device.type == "cuda":
        return time_forward(attention, inputs, warmup_ms, rep_ms)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]

    def forward():
        with torch.no_grad():
            attention(q, k, v)

    compile_s = _wall_ms(forward) / 1e3
    return {"fwd_ms": _wall_ms(forward), "bwd_ms": math.nan, "fwd_bwd_ms": math.nan, "compile_s": compile_s}


def peak_step_bytes(attention: Attention, inputs: dict[str, torch.Tensor]) -> int:
    """Peak CUDA memory a training step allocates beyond what is live before it (0 off the GPU)."""
    if inputs["q"].device.type != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    attention(inputs["q"], inputs["k"], inputs["v"]).backward(inputs["do"])
    torch.cuda.synchronize()
    for name in ("q", "k", "v"):
        inputs[name].grad = None
    return torch.cuda.max_memory_allocated() - base


def error_text(error: BaseException, width: int = 160) -> str:
    """'TypeName: first line of the message' (a competitor that cannot run a case is reported, not fatal)."""
    first = str(error).splitlines()[0][:width] if str(error) else ""
    return f"{type(error).__name__}: {first}"


def shape_columns(shape: Shape) -> dict:
    """A shape as flat row columns: its label and every size and mask field."""
    return {"shape": shape.label(), "dtype": shape.dtype, "batch": shape.batch, "heads": shape.heads,
            "kv_heads": shape.kv_heads, "seqlen_q": shape.seqlen_q, "seqlen_k": shape.seqlen_k,
            "head_dim": shape.head_dim, "head_dim_v": shape.head_dim_v, "causal": shape.causal,
            "bottom_right": shape.bottom_right, "window": shape.window, "valid_keys": shape.valid_keys,
            "documents": shape.documents}


def geomean(values: list[float]) -> float:
    values = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.nan
