"""Reference attention and the accuracy rule the kernel tests share.

Three computations per check (flash-attn's test-suite convention): a float64 golden,
PyTorch in the kernel's own dtype, and fatune. fatune's max abs error against the golden
must be at most FACTOR x PyTorch's own error, plus a tiny floor for exact-zero cases.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FACTOR = 2.0
FLOOR = {torch.float16: 1e-5, torch.bfloat16: 1e-5, torch.float32: 1e-6}


def attention_reference(q, k, v, *, causal: bool = False, scale: float | None = None, upcast: bool = True):
    """softmax(q k^T * scale) v computed with plain torch ops, differentiable.

    upcast=True: everything in float64 (the golden). upcast=False: matmuls in the inputs'
    dtype and softmax in float32, as PyTorch code in that dtype would compute it.
    Rows with no visible key give 0 (fatune's convention for fully masked rows).
    """
    dtype = q.dtype
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q * scale, k.transpose(-2, -1))
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)
    if causal:
        keep = torch.tril(keep)  # top-left aligned, like torch SDPA
    scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores.float() if not upcast else scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # rows with every key masked
    out = torch.matmul(probs.to(v.dtype), v)
    return out if upcast else out.to(dtype)


@dataclass
class Comparison:
    name: str
    error: float
    torch_error: float
    bound: float

    @property
    def ratio(self) -> float:
        return self.error / max(self.torch_error, 1e-30)


def _first_bad(actual: torch.Tensor, golden: torch.Tensor) -> str:
    worst = (actual.double() - golden).abs().nan_to_num(float("inf")).flatten().argmax().item()
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), actual.shape))
    return f"worst at {index}: fatune {actual[index].item()!r} vs golden {golden[index].item()!r}"


def check_close(name: str, actual: torch.Tensor, golden: torch.Tensor, same_dtype: torch.Tensor) -> Comparison:
    """Assert the accuracy rule for one tensor; returns the measured errors."""
    assert actual.shape == golden.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(golden.shape)}"
    bad = ~torch.isfinite(actual)
    if bad.any():
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"{name}: {int(bad.sum())} non-finite elements (unwritten or NaN), first at {index}")
    error = (actual.double() - golden).abs().max().item()
    torch_error = (same_dtype.double() - golden).abs().max().item()
    bound = FACTOR * torch_error + FLOOR[actual.dtype]
    assert error <= bound, (
        f"{name}: max abs error {error:.3e} > {FACTOR} x torch's {torch_error:.3e} + floor; {_first_bad(actual, golden)}"
    )
    return Comparison(name, error, torch_error, bound)


def random_qkv(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, head_dim_v, dtype, device, layout="bhld"):
    """Random q, k, v (normal, never zero) in the requested memory layout, requiring grad.

    layout: 'bhld' contiguous; 'blhd' as a (B, L, H, D) tensor transposed to (B, H, L, D);
    'strided' with a non-unit head-dim stride (every other element of a wider tensor).
    """

    def make(h, length, d):
        if layout == "bhld":
            t = torch.randn(batch, h, length, d, dtype=dtype, device=device)
        elif layout == "blhd":
            t = torch.randn(batch, length, h, d, dtype=dtype, device=device).transpose(1, 2)
        elif layout == "strided":
            t = torch.randn(batch, h, length, 2 * d, dtype=dtype, device=device)[..., ::2]
        else:
            raise ValueError(f"layout: expected bhld, blhd or strided, got {layout!r}")
        return t.requires_grad_()

    return make(heads, seqlen_q, head_dim), make(kv_heads, seqlen_k, head_dim), make(kv_heads, seqlen_k, head_dim_v)


def run_and_compare(attention_fn, q, k, v, *, causal: bool, scale: float | None = None, grad_layout: str = "dense"):
    """Run fatune forward+backward and both references on fresh random dO; check all four tensors."""
    out = attention_fn(q, k, v, causal, scale)
    grad_out = torch.randn_like(out)
    if grad_layout == "transposed":
        grad_out = grad_out.transpose(1, 2).contiguous().transpose(1, 2)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)

    def through(upcast: bool):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        ref = attention_reference(*leaves, causal=causal, scale=scale, upcast=upcast)
        ref_grads = torch.autograd.grad(ref, leaves, grad_out.to(ref.dtype))
        return ref, ref_grads

    golden, golden_grads = through(upcast=True)
    same, same_grads = through(upcast=False)
    results = [check_close("out", out, golden, same)]
    for name, actual, gold, ref in zip(("dq", "dk", "dv"), grads, golden_grads, same_grads):
        results.append(check_close(name, actual, gold, ref))
    return results
