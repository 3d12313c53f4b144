"""Timing of attention implementations, as search and bench both need it.

Rules (METHOD): random inputs (never zeros), warm-up and compile kept out of the timed
region, CUDA events through `triton.testing.do_bench` (which also flushes L2 before each
repeat), median of the repeats. Forward+backward is timed as a training step runs it:
forward, then backward from a random dO, gradients reset between repeats.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Callable

import torch

from fatune.db import MIN_TIME_MS
from fatune.spec import DTYPES, AttentionConfig, KernelSpec


def window_pairs(seqlen_q: int, seqlen_k: int, window: int) -> int:
    """(query, key) pairs a sliding window keeps: query i sees keys i + offset - window .. i + offset, offset =
    Lk - Lq (bottom-right, as fatune.attention aligns a window), cut to 0 .. Lk - 1."""
    def capped_sum(a: int, b: int) -> int:  # sum of min(t, window) + 1 for t in a .. b
        if b < a:
            return 0
        below = min(b, window)
        total = (a + below) * (below - a + 1) // 2 if below >= a else 0
        return total + window * max(0, b - max(a, window + 1) + 1) + (b - a + 1)

    offset = seqlen_k - seqlen_q
    return capped_sum(max(offset, 0), seqlen_k - 1)


def top_left_causal_pairs(seqlen_q: int, seqlen_k: int) -> int:
    """(query, key) pairs of a causal mask aligned top-left: query i sees keys 0 .. min(i, Lk - 1)."""
    if seqlen_q <= seqlen_k:
        return seqlen_q * (seqlen_q + 1) // 2
    return seqlen_k * (seqlen_k + 1) // 2 + (seqlen_q - seqlen_k) * seqlen_k


@dataclass(frozen=True)
class Shape:
    """One attention problem size."""

    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: str
    causal: bool = False
    kv_heads: int = 0  # 0: same as heads
    head_dim_v: int = 0  # 0: same as head_dim
    window: int = -1  # >= 0: causal sliding window, keys i + o - window .. i + o, o = Lk - Lq (flash-attn's (window, 0))
    valid_keys: float = 1.0  # < 1: key padding, each sequence keeps this fraction of its keys (seqlens_k)
    # > 0: the batch's batch * seqlen_q tokens packed into one (tokens, H, D) tensor as this many documents of
    # unequal lengths (cu_seqlens_q = cu_seqlens_k; self-attention, seqlen_q == seqlen_k)
    documents: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_heads", self.kv_heads or self.heads)
        object.__setattr__(self, "head_dim_v", self.head_dim_v or self.head_dim)
        if self.documents and (self.seqlen_q != self.seqlen_k or not 0 < self.documents <= self.tokens):
            raise ValueError(f"documents: expected 1..{self.tokens} packed documents of self-attention "
                             f"(seqlen_q == seqlen_k), got {self.documents} for lq{self.seqlen_q} lk{self.seqlen_k}")

    @property
    def kept_keys(self) -> int:
        """Keys each sequence keeps: L_k, or its valid_keys fraction (at least one) when padded."""
        return max(1, int(self.seqlen_k * self.valid_keys)) if self.valid_keys < 1.0 else self.seqlen_k

    @property
    def tokens(self) -> int:
        return self.batch * self.seqlen_q

    def document_lengths(self) -> list[int]:
        """The packed documents' lengths: a fixed pseudo-random cut of the tokens (the same for every run)."""
        cuts = sorted(random.Random(self.documents * 1_000_003 + self.tokens).sample(range(1, self.tokens),
                                                                                     self.documents - 1))
        return [end - start for start, end in zip([0, *cuts], [*cuts, self.tokens])]

    def key_lengths(self) -> tuple[int, int]:
        """The lengths that size the kernels' grid and the tuned-DB key: the longest document when packed."""
        if self.documents:
            longest = max(self.document_lengths())
            return longest, longest
        return self.seqlen_q, self.seqlen_k

    def decode_shares_sms(self, sms: int, packed: bool = True) -> bool:
        """heuristics.decode_shares_sms for this shape on a GPU of `sms` multiprocessors (`packed`: GQA groups
        packed into the tiles, as the decode forward does)."""
        from fatune.heuristics import decode_shares_sms

        group = self.heads // self.kv_heads if packed else 1
        return decode_shares_sms(self.documents or self.batch, self.heads // group, group, self.key_lengths()[0], sms)

    def input_sizes(self) -> dict[str, tuple[int, ...]]:
        """q, k, v and dO sizes: (B, H, L, D), or (tokens, H, D) when packed."""
        def size(heads: int, length: int, dim: int) -> tuple[int, ...]:
            return (self.tokens, heads, dim) if self.documents else (self.batch, heads, length, dim)

        return {"q": size(self.heads, self.seqlen_q, self.head_dim), "k": size(self.kv_heads, self.seqlen_k, self.head_dim),
                "v": size(self.kv_heads, self.seqlen_k, self.head_dim_v),
                "do": size(self.heads, self.seqlen_q, self.head_dim_v)}

    def attention_kwargs(self, device: torch.device | str) -> dict:
        """The fatune.attention keyword arguments that describe this shape's mask variant."""
        kwargs: dict = {"is_causal": self.causal, "enable_gqa": self.kv_heads != self.heads}
        if self.window >= 0:
            kwargs["window_size"] = (self.window, 0)
        if self.valid_keys < 1.0:
            kwargs["seqlens_k"] = torch.full((self.batch,), self.kept_keys,
                                             dtype=torch.int32, device=device)
        if self.documents:
            offsets = torch.tensor([0, *itertools.accumulate(self.document_lengths())], dtype=torch.int32,
                                   device=device)
            longest, _ = self.key_lengths()
            kwargs.update(cu_seqlens_q=offsets, cu_seqlens_k=offsets, max_seqlen_q=longest, max_seqlen_k=longest)
        return kwargs

    @property
    def spec(self) -> KernelSpec:
        """The kernel spec fatune.attention derives for this shape (from stand-in tensors of its sizes)."""
        from fatune.inputs import check_inputs

        def stand_in(*shape):  # the right sizes and dtype, one element of memory
            return torch.empty((), dtype=DTYPES[self.dtype]).expand(*shape)

        sizes = self.input_sizes()
        return check_inputs(stand_in(*sizes["q"]), stand_in(*sizes["k"]), stand_in(*sizes["v"]),
                            **self.attention_kwargs("cpu")).spec

    def with_(self, **changes) -> Shape:
        return replace(self, **changes)

    def flops(self, passes: str = "fwd+bwd") -> float:
        """4 B H Lq Lk D forward (halved when causal), counting the (query, key) pairs the call keeps when a
        window or key padding cuts them; backward 2.5x forward; fwd+bwd 3.5x."""
        if self.documents:
            lengths = [(n, n) for n in self.document_lengths()]
        else:
            lengths = [(self.seqlen_q, self.kept_keys)] * self.batch
        if self.window >= 0:  # bottom-right to the kept keys: i + (kept - Lq) - window .. i + (kept - Lq)
            pairs = sum(window_pairs(lq, lk, self.window) for lq, lk in lengths)
        elif self.causal and self.valid_keys < 1:  # top-left: row i sees keys 0 .. min(i, kept - 1)
            pairs = sum(top_left_causal_pairs(lq, lk) for lq, lk in lengths)
        else:
            pairs = sum(lq * lk for lq, lk in lengths) * (0.5 if self.causal else 1.0)
        forward = 2.0 * pairs * self.heads * (self.head_dim + self.head_dim_v)
        return forward * {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[passes]

    def label(self) -> str:
        gqa = f" hkv{self.kv_heads}" if self.kv_heads != self.heads else ""
        mask = (" causal" if self.causal else "") + (f" window{self.window}" if self.window >= 0 else "")
        mask += f" keys{self.valid_keys:.0%}" if self.valid_keys < 1 else ""
        mask += f" docs{self.documents}" if self.documents else ""
        return f"{self.dtype} b{self.batch} h{self.heads}{gqa} lq{self.seqlen_q} lk{self.seqlen_k} d{self.head_dim}{mask}"


def make_inputs(shape: Shape, device: str | torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random q, k, v (requiring grad) and dO for `shape`, drawn from a seeded generator."""
    generator = torch.Generator(device=device).manual_seed(seed)
    dtype = DTYPES[shape.dtype]

    def randn(*size):
        return torch.randn(*size, generator=generator, device=device, dtype=torch.float32).to(dtype)

    sizes = shape.input_sizes()
    inputs = {name: randn(*sizes[name]) for name in ("q", "k", "v", "do")}
    for name in ("q", "k", "v"):
        inputs[name].requires_grad_()
    return inputs


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
        from fatune import dropout
        from fatune.launch import Plan
        from fatune.plans import Call

        self.shape, self.config = shape, config
        q, k, v = (inputs[name].detach() for name in ("q", "k", "v"))
        call = Call(**shape.attention_kwargs(q.device))
        self.plan = Plan(call.check(q, k, v), config, q.device, q, k, v)
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

    compile_s = compile_seconds(step)
    fwd = bench(forward, warmup_ms, rep_ms)
    total = bench(step, warmup_ms, rep_ms, grad_to_none=[q, k, v])
    # a training step timed no slower than its forward (noise on a tiny problem): the shortest time an entry holds
    return {"fwd_ms": fwd, "bwd_ms": max(total - fwd, MIN_TIME_MS), "fwd_bwd_ms": total, "compile_s": compile_s}


def time_step_only(attention: Callable[..., torch.Tensor], inputs: dict[str, torch.Tensor],
                   warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Forward+backward ms of attention(q, k, v) through autograd, its first call untimed: the training
    step alone, for a yardstick that needs no forward/backward split."""
    q, k, v, grad_out = inputs["q"], inputs["k"], inputs["v"], inputs["do"]

    def step():
        attention(q, k, v).backward(grad_out)

    compile_seconds(step)
    return bench(step, warmup_ms, rep_ms, grad_to_none=[q, k, v])


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
