"""`fatune.attention`: the public call, its autograd Function and the output allocation.

The generated kernels read Q, K, V, dO through their strides, so no input is copied;
outputs and gradients are allocated in the layout of the tensor they mirror.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from fatune import codegen, dropout, reference
from fatune.dispatch import Decision, dispatcher, interpreting
from fatune.inputs import AttentionProblem, check_inputs
from fatune.kernel_args import KernelArgs
from fatune.spec import AttentionConfig, KernelSpec

log = logging.getLogger("fatune")
STRICT_ENV = "FATUNE_STRICT"
_logged: set[str] = set()


class FallbackError(RuntimeError):
    """Strict mode: fatune would have fallen back to another implementation."""


def strict_mode(strict: bool | None) -> bool:
    """The `strict` argument, or else $FATUNE_STRICT (1/true/yes)."""
    if strict is not None:
        return bool(strict)
    return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def log_once(message: str, *args) -> None:
    key = message % args
    if key not in _logged:
        _logged.add(key)
        log.warning(message, *args)


def _new_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialised buffer for a kernel to fill (tests replace this to poison outputs)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _new_like(tensor: torch.Tensor, last_dim: int | None = None) -> torch.Tensor:
    """Buffer with tensor's shape (last dim replaced) and its dim order, last dim innermost."""
    shape = list(tensor.shape)
    if last_dim is not None:
        shape[-1] = last_dim
    outer = sorted(range(tensor.dim() - 1), key=lambda i: -tensor.stride(i))
    order = outer + [tensor.dim() - 1]
    buffer = _new_tensor(tuple(shape[i] for i in order), tensor.dtype, tensor.device)
    return buffer.permute([order.index(i) for i in range(tensor.dim())])


def _as_bhld(tensor: torch.Tensor, packed: bool) -> torch.Tensor:
    """The kernels' (B, H, L, D) view: packed (total, H, D) becomes (1, H, total, D), no copy."""
    return tensor.transpose(0, 1).unsqueeze(0) if packed else tensor


def _kernel_args(problem: AttentionProblem, q, k, v, out, lse, seed: int) -> KernelArgs:
    packed = problem.packed
    return KernelArgs(
        q=_as_bhld(q, packed), k=_as_bhld(k, packed), v=_as_bhld(v, packed), out=_as_bhld(out, packed), lse=lse,
        batch=problem.batch, max_seqlen_q=problem.max_seqlen_q, max_seqlen_k=problem.max_seqlen_k,
        sm_scale=problem.scale, window_left=problem.window_left, window_right=problem.window_right,
        dropout_p=problem.dropout_p, seed=seed, mask=problem.attn_mask, alibi=problem.alibi_slopes,
        cu_seqlens_q=problem.cu_seqlens_q, cu_seqlens_k=problem.cu_seqlens_k, seqlens_k=problem.seqlens_k,
    )


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, problem: AttentionProblem, config: AttentionConfig):
        seed = dropout.draw_seed() if problem.spec.dropout else 0
        out = _new_like(query, problem.spec.head_dim_v)
        lse_rows = (1, problem.heads, problem.seqlen_q) if problem.packed else (problem.batch, problem.heads,
                                                                                problem.seqlen_q)
        lse = _new_tensor(lse_rows, torch.float32, query.device)
        codegen.load("fwd", problem.spec, config).launch(_kernel_args(problem, query, key, value, out, lse, seed))
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.problem, ctx.config, ctx.seed = problem, config, seed
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        problem: AttentionProblem = ctx.problem
        packed = problem.packed
        grad = {"query": _new_like(query), "key": _new_like(key), "value": _new_like(value)}
        args = _kernel_args(problem, query, key, value, out, lse, ctx.seed)
        args.grad_out = _as_bhld(grad_out, packed)
        args.delta = _new_tensor(tuple(lse.shape), torch.float32, lse.device)
        args.grad_q, args.grad_k, args.grad_v = (_as_bhld(grad[name], packed) for name in ("query", "key", "value"))
        codegen.load("bwd", problem.spec, ctx.config).launch(args)
        inputs = ("query", "key", "value", "problem", "config")
        return tuple(grad.get(name) for name in inputs)


def _fallback(query, key, value, problem: AttentionProblem, reason: str, strict: bool) -> torch.Tensor:
    if strict:
        raise FallbackError(f"fatune.attention would fall back to a dense torch implementation: {reason} "
                            f"(strict mode: strict=True or ${STRICT_ENV})")
    log_once("fatune.attention falls back to a dense torch implementation: %s", reason)
    keep = None
    if problem.spec.dropout:
        shape = (problem.batch, problem.heads, problem.max_seqlen_q, problem.max_seqlen_k)
        keep = torch.rand(shape, device=query.device) >= problem.dropout_p
    return reference.attention(query, key, value, problem, precision="float32", dropout_keep=keep)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    window_size: tuple[int, int] = (-1, -1),
    causal_alignment: str | None = None,
    alibi_slopes: torch.Tensor | None = None,
    seqlens_k: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    config: AttentionConfig | None = None,
    strict: bool | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention through fatune's generated FlashAttention kernels.

    Shaped like ``torch.nn.functional.scaled_dot_product_attention``; differentiable in
    query, key and value. See README.md ("fatune.attention") for the full table.

    - query (B, H, L_q, D), key (B, H_kv, L_k, D), value (B, H_kv, L_k, D_v): any strides,
      float16 / bfloat16 / float32, one device; H % H_kv == 0 with enable_gqa=True.
      Packed variable-length batches: (total, H, D) tensors with cu_seqlens_q/k (int32).
    - attn_mask: bool (True = keep) or additive float, broadcastable to (B, H, L_q, L_k).
    - is_causal: key j visible to query i when j <= i + offset; window_size=(left, right)
      keeps i + offset - left <= j <= i + offset + right (-1 = unbounded). offset is 0
      for causal_alignment="top_left" (torch SDPA; default for is_causal alone) and
      L_k - L_q for "bottom_right" (flash-attn; default with a window or packed inputs).
      For L_q = 2, L_k = 4::

          top_left      bottom_right
          1 0 0 0       1 1 1 0
          1 1 0 0       1 1 1 1

    - alibi_slopes: float32 (H,) or (B, H); adds -slope * |i + offset - j| to the scores.
    - seqlens_k: int32 (B,) keys per batch element; later keys are skipped, not computed.
    - dropout_p: dropout on the attention probabilities (seeded from torch's CPU generator).
    - Rows that see no key return 0 (torch SDPA returns NaN there) and get zero gradients.
    - config: force launch configs; strict (or $FATUNE_STRICT=1): raise instead of falling back.

    On CPU tensors the kernels run in Triton's interpreter when TRITON_INTERPRET=1;
    otherwise the call falls back to a dense torch implementation and logs why, once.
    """
    problem = check_inputs(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
        window_size=window_size, causal_alignment=causal_alignment, alibi_slopes=alibi_slopes,
        seqlens_k=seqlens_k, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
    )
    strict = strict_mode(strict)
    if query.device.type != "cuda" and not interpreting():
        return _fallback(query, key, value, problem,
                         f"{query.device.type} tensors need a CUDA GPU (or TRITON_INTERPRET=1)", strict)
    chosen = dispatcher().decide(problem, query.device, config, strict).config
    if torch.compiler.is_compiling():
        from fatune import custom_op

        return custom_op.attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window_size,
                                   causal_alignment, alibi_slopes, seqlens_k, cu_seqlens_q, cu_seqlens_k,
                                   max_seqlen_q, max_seqlen_k, chosen)
    if problem.seqlen_q == 0 or problem.batch == 0 or problem.heads == 0 or problem.max_seqlen_k == 0:
        # no keys anywhere: every row is a row that sees no key
        zero = (query.sum() + key.sum() + value.sum()) * 0
        return _new_like(query, problem.spec.head_dim_v).zero_() + zero
    return _FlashAttention.apply(query, key, value, problem, chosen)


@dataclass(frozen=True)
class Explanation:
    """What fatune.attention would run for a call, and why."""

    backend: str  # "triton" (compiled), "triton-interpreter" or "torch-fallback"
    spec: KernelSpec
    decision: Decision | None
    sources: dict[str, str]  # kernel module -> generated source file
    reason: str

    def __str__(self) -> str:
        lines = [f"backend: {self.backend}", f"mask variant: {self.spec.mask_variant} ({self.spec.dtype}, "
                 f"d={self.spec.head_dim}, dv={self.spec.head_dim_v})", f"why: {self.reason}"]
        if self.decision is not None:
            lines.append(self.decision.describe())
        lines += [f"source ({kind}): {path}" for kind, path in self.sources.items()]
        return "\n".join(lines)


def explain(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args, config: AttentionConfig | None = None,
            strict: bool | None = None, **kwargs) -> Explanation:
    """Which tuned entry, config, generated source file and DB layer fatune.attention(same arguments) would use."""
    problem = check_inputs(query, key, value, *args, **kwargs)
    if query.device.type != "cuda" and not interpreting():
        return Explanation("torch-fallback", problem.spec, None, {},
                           f"{query.device.type} tensors need a CUDA GPU (or TRITON_INTERPRET=1)")
    decision = dispatcher().decide(problem, query.device, config, strict_mode(strict))
    sources = {kind: str(codegen.source_path(kind, problem.spec, decision.config)) for kind in ("fwd", "bwd")}
    backend = "triton" if query.device.type == "cuda" else "triton-interpreter"
    return Explanation(backend, problem.spec, decision, sources, decision.reason)
