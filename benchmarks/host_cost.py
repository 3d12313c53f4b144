"""fatune.attention's host (Python) cost per call, measured on the CPU with kernel launches as no-ops.

The GPU measurement is `fatune bench --overhead`; this script isolates what fatune itself
costs on the host, on any machine: plans are built by the real code (in interpreter mode, so
that CPU tensors get a kernel plan), then every `KernelLaunch` calls a no-op instead of Triton's C launcher. What is left
is the Python path of a call: `attention()`, the plan lookup, the autograd.Function, the
output allocations; with a mask tensor, the Python of its spans (their scans' launches are no-ops too).
The same loops with torch SDPA on tiny CPU tensors (its autograd node is C++) and with an empty
autograd.Function give the baselines.

    PYTHONPATH=. python benchmarks/host_cost.py              # table: us per call, median of rounds
    PYTHONPATH=. python benchmarks/host_cost.py --profile    # + cProfile of the fatune step
    PYTHONPATH=. python benchmarks/host_cost.py --gpu-parts  # on a GPU: the pieces with real launches
    PYTHONPATH=. python benchmarks/host_cost.py --gpu-parts --profile  # + cProfile of causal steps there (is_causal, bool mask)

Not measured here (GPU only): `torch._C._cuda_getDevice()`, the current-stream lookup and
the C launcher calls; CPU allocations stand in for the CUDA caching allocator's.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

if "--gpu-parts" not in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # plans for CPU tensors (launches are no-ops below)

import torch

import fatune
from fatune import launch, mask_spans


def _no_kernel(*args, **kwargs):
    return None


_real_call = launch.KernelLaunch.__call__


class _NoScan:
    """fatune.mask_spans' jitted scan with a launch that does nothing (Triton's own launch path, not timed here)."""

    def __getitem__(self, grid):
        return _no_kernel


def _launch_nothing(self, slots, stream):
    """KernelLaunch.__call__ as after a first launch, with a direct launcher that does nothing."""
    if self.direct is None:
        self.binary, self.direct, self.middle = object(), _no_kernel, (None,) * 9
    return _real_call(self, slots, stream)


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


def workloads(shape: tuple[int, int, int, int], sdpa_shape: tuple[int, int, int, int]):
    def inputs(shape, grad):
        gen = torch.Generator().manual_seed(0)
        ts = [torch.randn(shape, generator=gen, dtype=torch.bfloat16).requires_grad_(grad) for _ in range(3)]
        return ts, torch.randn(shape, generator=gen, dtype=torch.bfloat16)

    (q, k, v), do = inputs(shape, True)
    plain = [t.detach() for t in (q, k, v)]
    causal = torch.ones(shape[2], shape[2], dtype=torch.bool).tril().expand(shape[0], 1, shape[2], shape[2])
    prepared = fatune.prepare_mask(causal, (*shape[:3], shape[2]))
    sdpa_causal = torch.ones(sdpa_shape[2], sdpa_shape[2], dtype=torch.bool).tril()
    (sq, sk, sv), sdo = inputs(sdpa_shape, True)
    splain = [t.detach() for t in (sq, sk, sv)]
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def step(fn, grads, grad_out):
        def run():
            for tensor in grads:
                tensor.grad = None
            fn(*grads).backward(grad_out)
        return run

    return {
        "fatune forward": lambda: fatune.attention(*plain, is_causal=True),
        "sdpa forward": lambda: sdpa(*splain, is_causal=True),
        "fatune step": step(lambda a, b, c: fatune.attention(a, b, c, is_causal=True), (q, k, v), do),
        "sdpa step": step(lambda a, b, c: sdpa(a, b, c, is_causal=True), (sq, sk, sv), sdo),
        "fatune step, bool mask": step(lambda a, b, c: fatune.attention(a, b, c, attn_mask=causal), (q, k, v), do),
        "fatune step, prepared mask": step(lambda a, b, c: fatune.attention(a, b, c, attn_mask=prepared), (q, k, v),
                                           do),
        "sdpa step, bool mask": step(lambda a, b, c: sdpa(a, b, c, attn_mask=sdpa_causal), (sq, sk, sv), sdo),
        "empty Function step": step(_Empty.apply, (q, k, v), do),
    }


def measure(runs: dict, calls: int, rounds: int) -> dict[str, list[float]]:
    for run in runs.values():
        for _ in range(200):
            run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.thread_time_ns()
            for _ in range(calls):
                run()
            times[name].append((time.thread_time_ns() - start) / calls / 1e3)
    return times


def parts(shape: tuple[int, int, int, int]) -> dict[str, float]:
    """Microseconds of the pieces of a fatune step (min of 5 repeats, CPU time)."""
    import timeit

    from fatune import flash_attention, plans

    q, k, v = (torch.randn(shape, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(shape, dtype=torch.bfloat16)
    fatune.attention(q, k, v, is_causal=True).backward(do)
    call = plans.Call(is_causal=True)
    plan = plans.prepare(q, k, v, call, None, None).plan
    out, lse = plan.forward(q, k, v)

    def step():
        q.grad = k.grad = v.grad = None
        fatune.attention(q, k, v, is_causal=True).backward(do)

    def empty_step():
        q.grad = k.grad = v.grad = None
        _Empty.apply(q, k, v).backward(do)

    pieces = {
        "step": step,
        "  attention() (forward, grad)": lambda: fatune.attention(q, k, v, is_causal=True),
        "    Call(...)": lambda: plans.Call(None, 0.0, True, None, False, (-1, -1), None, None, None, None, None, None,
                                           None),
        "    prepare() (call_key + lookup)": lambda: plans.prepare(q, k, v, call, None, None),
        "    _FlashAttention.apply": lambda: flash_attention._FlashAttention.apply(q, k, v, plan, launch.NO_EXTRAS),
        "      Plan.forward": lambda: plan.forward(q, k, v),
        "  Plan.backward": lambda: plan.backward(do, q, k, v, out, lse),
        "  torch.empty_strided (one)": lambda: torch.empty_strided(q.shape, q.stride(), dtype=q.dtype),
        "empty Function step": empty_step,
        "  empty Function forward": lambda: _Empty.apply(q, k, v),
    }
    return {name: min(timeit.repeat(fn, timer=time.thread_time, number=3000, repeat=5)) / 3000 * 1e6
            for name, fn in pieces.items()}


def gpu_parts(shape: tuple[int, int, int, int]) -> dict[str, float]:
    """Microseconds of the pieces of a fatune step on a CUDA GPU, real launches (wall time per call,
    min over 50 repeats of 200 calls, synchronized before each repeat so launch queues never fill).

    Includes the two ways of passing pointers to Triton's C launcher: tensors (the launcher calls
    data_ptr() and cuPointerGetAttribute per pointer) and integers (what KernelLaunch passes)."""
    import timeit

    from fatune import plans

    q, k, v = (torch.randn(shape, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(3))
    do = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for _ in range(3):
        fatune.attention(q, k, v, is_causal=True).backward(do)
        sdpa(q, k, v, is_causal=True).backward(do)
    plan = plans.prepare(q, k, v, plans.Call(is_causal=True), None, None).plan
    out, lse = plan.forward(q, k, v)
    plan.backward(do, q, k, v, out, lse)
    (fwd,) = plan.fwd_launches()
    slots = plan.slots(q, k, v, out, lse, launch.NO_EXTRAS, None)
    stream = launch.current_stream(q.device)
    tensors = fwd.pick(slots)
    ints = [None if t is None else t.data_ptr() for t in tensors]

    def direct(pointers):
        return lambda: fwd.direct(*fwd.grid, stream, *fwd.middle, *pointers, *fwd.tail)

    def step(fn):
        def run():
            q.grad = k.grad = v.grad = None
            fn(q, k, v, is_causal=True).backward(do)
        return run

    causal = torch.ones(shape[2], shape[2], dtype=torch.bool, device="cuda").tril().expand(shape[0], 1, shape[2],
                                                                                         shape[2])
    config = fatune.explain(q, k, v, attn_mask=causal).decision.config

    def masked_step(**kwargs):
        def run():
            q.grad = k.grad = v.grad = None
            fatune.attention(q, k, v, attn_mask=causal, **kwargs).backward(do)
        return run

    prepared = fatune.prepare_mask(causal, (*shape[:3], shape[2]))

    def prepared_step():
        q.grad = k.grad = v.grad = None
        fatune.attention(q, k, v, attn_mask=prepared).backward(do)

    for _ in range(3):
        masked_step()()
        prepared_step()
    pieces = {
        "fatune step": step(fatune.attention),
        "sdpa step": step(sdpa),
        "fatune step, bool mask": masked_step(),
        "fatune step, bool mask, config=": masked_step(config=config),
        "fatune step, prepared bool mask": prepared_step,
        "  mask spans (both directions)": lambda: mask_spans.mask_spans(causal, (*shape[:3], shape[2])),
        "fatune forward (grad)": lambda: fatune.attention(q, k, v, is_causal=True),
        "sdpa forward (grad)": lambda: sdpa(q, k, v, is_causal=True),
        "  Plan.forward": lambda: plan.forward(q, k, v),
        "  Plan.backward": lambda: plan.backward(do, q, k, v, out, lse),
        "  forward launch, tensor pointers": direct(tensors),
        "  forward launch, int pointers": direct(ints),
        "  KernelLaunch.__call__ (forward)": lambda: fwd(slots, stream),
        "  torch.empty_strided (one)": lambda: torch.empty_strided(q.shape, q.stride(), dtype=q.dtype, device="cuda"),
        "  current stream": lambda: launch.current_stream(q.device),
    }
    results = {}
    for name, fn in pieces.items():
        times = timeit.repeat(fn, setup=torch.cuda.synchronize, timer=time.perf_counter, number=200, repeat=50)
        results[name] = min(times) / 200 * 1e6
    return results


def gpu_profile(shape: tuple[int, int, int, int], calls: int) -> None:
    """cProfile of a causal training step on a CUDA GPU, real launches (by own time): with `is_causal`, then with
    the same mask as a boolean tensor (the difference is the mask tensor's host cost)."""
    q, k, v = (torch.randn(shape, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(3))
    do = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    causal = torch.ones(shape[2], shape[2], dtype=torch.bool, device="cuda").tril().expand(shape[0], 1, shape[2],
                                                                                         shape[2])
    for name, kwargs in (("is_causal", {"is_causal": True}), ("bool mask", {"attn_mask": causal})):
        def step():
            q.grad = k.grad = v.grad = None
            fatune.attention(q, k, v, **kwargs).backward(do)

        for _ in range(200):
            step()
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            step()
        profiler.disable()
        torch.cuda.synchronize()
        print(f"--- cProfile, {calls} causal steps with {name}")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--shape", default="1,8,128,64", help="fatune's B,H,L,D (launches are no-ops)")
    parser.add_argument("--sdpa-shape", default="1,1,4,8", help="SDPA's (it computes on the CPU: keep it tiny)")
    parser.add_argument("--profile", action="store_true", help="cProfile the fatune step")
    parser.add_argument("--parts", action="store_true", help="time the pieces of a fatune step")
    parser.add_argument("--gpu-parts", action="store_true", help="time the pieces of a step on a CUDA GPU")
    args = parser.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    if args.gpu_parts:
        for name, value in gpu_parts(shape).items():
            print(f"{name:36} {value:7.2f} us")
        if args.profile:
            gpu_profile(shape, min(args.calls, 2000))
        return
    launch.KernelLaunch.__call__ = _launch_nothing
    mask_spans._jitted = lambda interpret: _NoScan()
    sdpa_shape = tuple(int(x) for x in args.sdpa_shape.split(","))
    torch.set_num_threads(1)
    if args.parts:
        for name, value in parts(shape).items():
            print(f"{name:36} {value:7.2f} us")
        return
    runs = workloads(shape, sdpa_shape)
    times = measure(runs, args.calls, args.rounds)
    print(f"host cost per call, us (CPU, launches are no-ops; {args.rounds} rounds x {args.calls} calls; "
          f"the minimum is the least disturbed by other processes):")
    print(f"  {'':24} {'min':>7} {'median':>7}")
    for name, values in times.items():
        print(f"  {name:24} {min(values):7.2f} {statistics.median(values):7.2f}")
    best = {name: min(values) for name, values in times.items()}
    print(f"  fatune - sdpa (min): step {best['fatune step'] - best['sdpa step']:.2f} us, "
          f"forward {best['fatune forward'] - best['sdpa forward']:.2f} us; "
          f"fatune step - empty Function step: {best['fatune step'] - best['empty Function step']:.2f} us")
    if args.profile:
        profiler = cProfile.Profile()
        run = runs["fatune step"]
        profiler.enable()
        for _ in range(args.calls):
            run()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
