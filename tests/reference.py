"""The accuracy rule the kernel tests share, on top of fatune.kernel.reference's dense attention.

Three computations per check (flash-attn's test-suite convention): a float64 golden,
PyTorch computing in the kernel's dtype, and fatune. fatune's max abs error against the
golden must be at most FACTOR x PyTorch's error, plus a floor: one unit in the last place of the output
dtype at the golden's largest magnitude, and a tiny constant for exact-zero cases. (The exactly rounded answer
is off by up to half a unit; FlashAttention's products take P rounded to the dtype, which can cost one more
half, where PyTorch's own error happens to be small. flash-attn's suite allows about two units.)

"PyTorch in the same dtype" is, by dtype:
- float16 / bfloat16: plain torch ops in that dtype (flash-attn's `attention_ref(upcast=False)`:
  half-precision matmuls, softmax in float32, P rounded to the dtype). torch SDPA on CPU
  computes half inputs in float32 internally, so it is not a same-dtype baseline there.
- float32: torch SDPA, PyTorch's own fused kernel, where SDPA can express the variant
  (plain float32 ops are exact up to float32 rounding, not an implementation of the
  FlashAttention kind; they are the baseline only where SDPA cannot express the variant).
On a GPU, 16-bit cases are checked against both baselines where SDPA can express them, SDPA with
16-bit reductions allowed in its math fallback (by default it computes there in float32).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from fatune.call import check_inputs
from fatune.kernel import reference
from fatune.kernel.problem import AttentionProblem

FACTOR = 2.0
FLOOR = {torch.float16: 1e-5, torch.bfloat16: 1e-5, torch.float32: 1e-6}


def stable_seed(*parts) -> int:
    """A seed that is the same in every process for the same test case (unlike hash())."""
    return zlib.crc32(repr(parts).encode())


@dataclass
class Comparison:
    name: str
    baseline: str
    error: float
    torch_error: float
    bound: float

    @property
    def ratio(self) -> float:
        return self.error / max(self.torch_error, FLOOR[torch.float32])


def rounding_error(golden: torch.Tensor, dtype: torch.dtype) -> float:
    """One unit in the last place of `dtype` at the golden's largest magnitude: the step between neighbouring
    values there, which an answer computed as FlashAttention does (P rounded to the dtype for its products) may
    be off by even where every sum is exact. Part of the floor: the ratio of two max errors means nothing below
    it (flash-attn's Hopper suite adds about two such units)."""
    if not golden.numel():
        return 0.0
    magnitude = golden.abs().max().item()
    if not 0 < magnitude < float("inf"):
        return 0.0
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(magnitude))


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
    error = (actual.double() - golden).abs().max().item() if actual.numel() else 0.0
    torch_error = (same_dtype.double() - golden).abs().max().item() if actual.numel() else 0.0
    if not torch_error < float("inf"):  # an overflowed baseline would make any error pass
        raise AssertionError(f"{name}: {baseline}'s result is not finite: no bound to hold fatune to")
    bound = FACTOR * torch_error + rounding_error(golden, actual.dtype) + FLOOR[actual.dtype]
    assert error <= bound, (
        f"{name}: max abs error {error:.3e} > {FACTOR} x {baseline}'s {torch_error:.3e} + floor "
        f"{bound - FACTOR * torch_error:.1e}; "
        f"{_first_bad(actual, golden)}"
    )
    return Comparison(name, baseline, error, torch_error, bound)


def _sdpa_expressible(problem: AttentionProblem, q: torch.Tensor) -> torch.Tensor | bool | None:
    """SDPA's attn_mask for problem (True: plain is_causal), or None if SDPA cannot compute it exactly."""
    spec = problem.spec
    if problem.packed or spec.dropout or spec.alibi or spec.attn_mask == "additive":
        return None
    if spec.mask_variant == "causal" and not spec.bottom_right:
        return True
    if spec.mask_variant == "none":
        return False
    limit = problem.seqlens_k if problem.seqlens_k is not None else problem.seqlen_k
    keep = reference.visible(problem, problem.seqlen_q, problem.seqlen_k, limit, q.device)
    if problem.attn_mask is not None:
        keep = keep & (problem.attn_mask != 0)
    if not keep.any(-1).all():
        return None  # SDPA gives NaN on rows that see no key
    return keep.expand(problem.batch, problem.heads, problem.seqlen_q, problem.seqlen_k)


def same_dtype_baselines(problem: AttentionProblem, q: torch.Tensor) -> dict[str, Callable]:
    """The PyTorch implementations in q's dtype that fatune's error is held against."""
    plain = lambda q_, k_, v_: reference.attention(q_, k_, v_, problem, precision="plain")  # noqa: E731
    sdpa_mask = _sdpa_expressible(problem, q)
    sdpa = None
    if sdpa_mask is not None:
        def sdpa(q_, k_, v_):
            mask = None if isinstance(sdpa_mask, bool) else sdpa_mask
            # where no fused kernel takes the call (head dims not a multiple of 8, ...), SDPA's math fallback
            # computes 16-bit inputs in float32 unless told otherwise: not a same-dtype implementation
            upcast = not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
            torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
            try:
                return F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, is_causal=sdpa_mask is True,
                                                      scale=problem.scale, enable_gqa=problem.group_size > 1)
            finally:
                torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(not upcast)
    if q.dtype == torch.float32:
        return {"torch-sdpa": sdpa} if sdpa is not None else {"torch-plain": plain}
    if q.is_cuda:
        return {"torch-plain": plain, **({"torch-sdpa": sdpa} if sdpa else {})}
    return {"torch-plain": plain}


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


def run_and_compare(q, k, v, *, grad_layout: str = "dense", dropout_keep: torch.Tensor | None = None,
                    attention: Callable | None = None, **kwargs) -> list[Comparison]:
    """fatune.attention(q, k, v, **kwargs) forward and backward against the golden and baselines.

    dropout_keep: the kernels' keep-mask (fatune.kernel.triton.dropout.keep_mask) when kwargs has dropout_p.
    attention: what is called in fatune.attention's place (compiled, say).
    """
    import fatune

    out = (attention or fatune.attention)(q, k, v, **kwargs)
    grad_out = torch.randn_like(out)
    if grad_layout == "transposed":
        grad_out = grad_out.transpose(-2, -3).contiguous().transpose(-2, -3)
    elif grad_layout == "every-other-lane":  # head-dim stride 2: TMA cannot read it
        wide = torch.zeros(*grad_out.shape[:-1], 2 * grad_out.shape[-1], dtype=grad_out.dtype, device=grad_out.device)
        wide[..., ::2] = grad_out
        grad_out = wide[..., ::2]
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    problem = check_inputs(q, k, v, **{key: value for key, value in kwargs.items() if key not in ("config", "strict")})

    def through(implementation, dtype):
        # leaves in `dtype`: the golden's gradients must stay float64, not round to q's dtype
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        ref = implementation(*leaves)
        ref_grads = torch.autograd.grad(ref, leaves, grad_out.to(ref.dtype))
        return ref, ref_grads

    golden, golden_grads = through(
        lambda q_, k_, v_: reference.attention(q_, k_, v_, problem, "float64", dropout_keep), torch.float64)
    baselines = same_dtype_baselines(problem, q)
    if dropout_keep is not None:
        baselines = {"torch-plain": lambda q_, k_, v_: reference.attention(q_, k_, v_, problem, "plain", dropout_keep)}
    results = []
    for baseline, implementation in baselines.items():
        same, same_grads = through(implementation, q.dtype)
        results.append(check_close("out", out, golden, same, baseline))
        for name, actual, gold, ref in zip(("dq", "dk", "dv"), grads, golden_grads, same_grads):
            results.append(check_close(name, actual, gold, ref, baseline))
    return results
