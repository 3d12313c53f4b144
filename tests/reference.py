"""Reference attention and the accuracy rule the kernel tests share.

Three computations per check (flash-attn's test-suite convention): a float64 golden,
PyTorch computing in the kernel's dtype, and fatune. fatune's max abs error against the
golden must be at most FACTOR x PyTorch's error, plus a tiny floor for exact-zero cases.

"PyTorch in the same dtype" is, by dtype:
- float16 / bfloat16: plain torch ops in that dtype (flash-attn's `attention_ref(upcast=False)`:
  half-precision matmuls, softmax in float32, P rounded to the dtype). torch SDPA on CPU
  computes half inputs in float32 internally, so it is not a same-dtype baseline there.
- float32: torch SDPA, PyTorch's own fused kernel (plain float32 ops are also checked on GPU).
On a GPU every case is checked against both baselines.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FACTOR = 2.0
FLOOR = {torch.float16: 1e-5, torch.bfloat16: 1e-5, torch.float32: 1e-6}


def stable_seed(*parts) -> int:
    """A seed that is the same in every process for the same test case (unlike hash())."""
    return zlib.crc32(repr(parts).encode())


def attention_reference(q, k, v, *, causal: bool = False, scale: float | None = None):
    """softmax(q k^T * scale) v in float64 with plain torch ops, differentiable: the golden.

    Rows with no visible key give 0 (fatune's convention for fully masked rows).
    """
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
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)  # rows with every key masked
    return torch.matmul(probs, v)


def torch_sdpa(q, k, v, *, causal: bool = False, scale: float | None = None):
    """PyTorch's fused implementation in the inputs' dtype: torch SDPA, default backend."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def torch_plain(q, k, v, *, causal: bool = False, scale: float | None = None):
    """Plain torch ops in the inputs' dtype: matmuls in the dtype, softmax in float32, P cast back."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q * scale, k.transpose(-2, -1))
    if causal:
        keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores.float(), dim=-1), nan=0.0).to(q.dtype)
    return torch.matmul(probs, v)


def same_dtype_baselines(q: torch.Tensor) -> dict:
    """The PyTorch implementations fatune's error is held against (see the module docstring)."""
    if q.is_cuda:
        return {"torch-plain": torch_plain, "torch-sdpa": torch_sdpa}
    return {"torch-sdpa": torch_sdpa} if q.dtype == torch.float32 else {"torch-plain": torch_plain}


@dataclass
class Comparison:
    name: str
    baseline: str
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


def check_close(name: str, actual: torch.Tensor, golden: torch.Tensor, same_dtype: torch.Tensor,
                baseline: str = "torch") -> Comparison:
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
        f"{name}: max abs error {error:.3e} > {FACTOR} x {baseline}'s {torch_error:.3e} + floor; "
        f"{_first_bad(actual, golden)}"
    )
    return Comparison(name, baseline, error, torch_error, bound)


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

    def through(implementation, dtype):
        # leaves in `dtype`: the golden's gradients must stay float64, not round to q's dtype
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        ref = implementation(*leaves, causal=causal, scale=scale)
        ref_grads = torch.autograd.grad(ref, leaves, grad_out.to(ref.dtype))
        return ref, ref_grads

    golden, golden_grads = through(attention_reference, torch.float64)
    results = []
    for baseline, implementation in same_dtype_baselines(q).items():
        same, same_grads = through(implementation, q.dtype)
        results.append(check_close("out", out, golden, same, baseline))
        for name, actual, gold, ref in zip(("dq", "dk", "dv"), grads, golden_grads, same_grads):
            results.append(check_close(name, actual, gold, ref, baseline))
    return results
