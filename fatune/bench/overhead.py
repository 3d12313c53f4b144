"""Suite `overhead`: what a call of fatune.attention costs on the host, beside torch SDPA's.

On a tiny problem (B=1, H=8, L=128, D=64, causal, bf16: the kernels take a few microseconds) the time per call
is the host's: Python, argument checks, the plan lookup, the autograd node, allocations and kernel launches.
Workloads, each called back to back as a user calls them:

- forward: inputs without grad, as inference runs it; fatune, fatune's kernels and SDPA;
- step: a training step, inputs requiring grad, forward then backward from a fixed dO, gradients cleared first;
  fatune with is_causal, fatune's kernels (the dispatcher's config passed as `config`: no route to an SDPA
  backend, which a tuned entry may take), with the same mask as a boolean tensor (its spans are scanned each
  call), with that tensor summarised once by `fatune.prepare_mask`, SDPA with is_causal and with the tensor,
  and an empty Python autograd.Function that only allocates its output and gradients (the floor of any
  Python-level op).

On a CUDA GPU (launches are real): each workload is warmed up, then `calls` calls are timed by the wall clock
up to a final synchronize; a round's time divided by `calls` is one sample, implementations interleaved round
by round, and the median of `rounds` samples is reported (the minimum beside it).

In Triton's interpreter (`--interpret`, any machine) fatune's kernel launches and mask scans are replaced by
no-ops after the real plan is built, so what is timed is fatune's own Python path of a call; the same loops
run torch SDPA on tiny CPU tensors (its autograd node is C++). Time is the process's CPU time (less disturbed
by other processes than the wall clock). Not measured there: the CUDA stream and device lookups and the
launcher's own cost; CPU allocations stand in for the CUDA caching allocator's.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import torch

import fatune
from fatune.bench.common import bench_device, shape_columns
from fatune.bench.results import Report, fmt, markdown_table
from fatune.kernel import mask_spans
from fatune.kernel.triton import launch
from fatune.runtime import plans
from fatune.tuning.shape import Shape, make_inputs

NAME = "overhead"
SHAPE = Shape(batch=1, heads=8, seqlen_q=128, seqlen_k=128, head_dim=64, dtype="bfloat16", causal=True)
HOST_SDPA_SHAPE = Shape(1, 1, 4, 4, 8, "bfloat16", causal=True)  # SDPA computes on the CPU: keep it tiny
WORKLOADS = (("forward", "fatune"), ("forward", "fatune kernels"), ("forward", "sdpa"), ("step", "fatune"),
             ("step", "fatune kernels"), ("step", "sdpa"), ("step", "fatune bool mask"),
             ("step", "fatune prepared mask"), ("step", "sdpa bool mask"), ("step", "empty autograd.Function"))
WARMUP_CALLS = 100


def _no_kernel(*args, **kwargs) -> None:
    return None


class _NoScan:
    """The mask spans' jitted scan with a launch that does nothing."""

    def __getitem__(self, grid):
        return _no_kernel


class _Empty(torch.autograd.Function):
    """The floor: a Python autograd.Function that allocates its output and gradients, nothing else."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@contextlib.contextmanager
def no_launches() -> Iterator[None]:
    """fatune's kernel launches and mask scans do nothing inside (plans are built as usual, in a plan cache of
    their own that is dropped after, so no later call runs a no-op launch); torch on one thread."""
    real_call, real_jitted, real_plans = launch.KernelLaunch.__call__, mask_spans._jitted, plans._plans
    threads = torch.get_num_threads()

    def launch_nothing(self, slots, stream):  # KernelLaunch.__call__ after a first launch, with a no-op launcher
        if self.direct is None:
            self.binary, self.direct, self.middle = object(), _no_kernel, (None,) * 9
        return real_call(self, slots, stream)

    launch.KernelLaunch.__call__ = launch_nothing
    mask_spans._jitted = lambda interpret: _NoScan()
    plans._plans = {}
    torch.set_num_threads(1)
    try:
        yield
    finally:
        launch.KernelLaunch.__call__, mask_spans._jitted, plans._plans = real_call, real_jitted, real_plans
        torch.set_num_threads(threads)


def workloads(shape: Shape, sdpa_shape: Shape, device: torch.device) -> dict[tuple[str, str], Callable[[], None]]:
    """(workload, implementation) -> a call of it with its inputs bound."""
    def inputs(of: Shape):
        made = make_inputs(of, device)
        grads = tuple(made[name] for name in ("q", "k", "v"))
        return grads, tuple(t.detach() for t in grads), made["do"]

    grads, plain, grad_out = inputs(shape)
    sdpa_grads, sdpa_plain, sdpa_grad_out = inputs(sdpa_shape)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    length, sdpa_length = shape.seqlen_q, sdpa_shape.seqlen_q
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril().expand(shape.batch, 1, length, length)
    prepared = fatune.prepare_mask(causal, (shape.batch, shape.heads, length, length))
    sdpa_causal = torch.ones(sdpa_length, sdpa_length, dtype=torch.bool, device=device).tril()

    def step(fn, leaves, dout):
        def run():
            for tensor in leaves:
                tensor.grad = None
            fn(*leaves).backward(dout)
        return run

    kernels = fatune.explain(*plain, is_causal=True).decision.config  # the dispatcher's, given as an argument
    runs = {
        ("forward", "fatune"): lambda: fatune.attention(*plain, is_causal=True),
        ("forward", "fatune kernels"): lambda: fatune.attention(*plain, is_causal=True, config=kernels),
        ("forward", "sdpa"): lambda: sdpa(*sdpa_plain, is_causal=True),
        ("step", "fatune"): step(lambda q, k, v: fatune.attention(q, k, v, is_causal=True), grads, grad_out),
        ("step", "fatune kernels"): step(lambda q, k, v: fatune.attention(q, k, v, is_causal=True, config=kernels),
                                         grads, grad_out),
        ("step", "sdpa"): step(lambda q, k, v: sdpa(q, k, v, is_causal=True), sdpa_grads, sdpa_grad_out),
        ("step", "fatune bool mask"): step(lambda q, k, v: fatune.attention(q, k, v, attn_mask=causal), grads,
                                           grad_out),
        ("step", "fatune prepared mask"): step(lambda q, k, v: fatune.attention(q, k, v, attn_mask=prepared), grads,
                                               grad_out),
        ("step", "sdpa bool mask"): step(lambda q, k, v: sdpa(q, k, v, attn_mask=sdpa_causal), sdpa_grads,
                                         sdpa_grad_out),
        ("step", "empty autograd.Function"): step(_Empty.apply, grads, grad_out),
    }
    return {workload: runs[workload] for workload in WORKLOADS}


def measure(runs: dict, calls: int, rounds: int, gpu: bool) -> dict[tuple[str, str], list[float]]:
    """Microseconds per call of each run, one sample per round (implementations interleaved round by round)."""
    clock = time.perf_counter_ns if gpu else time.thread_time_ns
    for run in runs.values():
        for _ in range(min(WARMUP_CALLS, calls)):
            run()
    if gpu:
        torch.cuda.synchronize()
    samples: dict[tuple[str, str], list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = clock()
            for _ in range(calls):
                run()
            if gpu:
                torch.cuda.synchronize()
            samples[name].append((clock() - start) / calls / 1e3)
    return samples


def rows_of(samples: dict[tuple[str, str], list[float]], shape: Shape, calls: int, rounds: int, gpu: bool) -> list[dict]:
    medians = {name: statistics.median(values) for name, values in samples.items()}
    rows = []
    for (workload, impl), values in samples.items():
        sdpa = medians.get((workload, "sdpa"))
        rows.append({"suite": NAME, "mode": "gpu" if gpu else "host (launches are no-ops)", "workload": workload,
                     "impl": impl, "us": medians[(workload, impl)], "us_min": min(values),
                     "vs_sdpa": medians[(workload, impl)] / sdpa if sdpa else None, "calls": calls, "rounds": rounds,
                     **shape_columns(shape)})
    return rows


def table(rows: list[dict]) -> str:
    return markdown_table(rows, [("workload", "workload"), ("implementation", "impl"),
                                 ("us per call (median)", fmt("us", ".2f")), ("min", fmt("us_min", ".2f")),
                                 ("/ torch SDPA", fmt("vs_sdpa", ".2f"))])


def run(calls: int = 2000, rounds: int = 5, shape: Shape = SHAPE) -> Report:
    """Host cost per call of every workload: real launches on a GPU, no-op launches in the interpreter."""
    device = bench_device()
    gpu = device.type == "cuda"
    context = contextlib.nullcontext() if gpu else no_launches()
    with context:
        runs = workloads(shape, shape if gpu else HOST_SDPA_SHAPE, device)
        samples = measure(runs, calls, rounds, gpu)
    rows = rows_of(samples, shape, calls, rounds, gpu)
    how = ("wall clock up to a final synchronize, real launches" if gpu else
           "CPU time, fatune's launches and mask scans are no-ops, SDPA on tiny CPU tensors")
    markdown = (f"Host cost per call, {shape.label()} ({how}; median of {rounds} rounds of {calls} calls, "
                f"implementations interleaved):\n\n{table(rows)}")
    summary = {f"{row['workload']} {row['impl']}": row["us"] for row in rows}
    return Report(NAME, rows, markdown, summary=summary)
