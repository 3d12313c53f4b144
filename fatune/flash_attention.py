"""`fatune.attention`: the public call, its autograd Function and the output allocation.

The generated kernels read Q, K, V, dO through their strides, so no input is copied;
outputs and gradients are allocated in the layout of the tensor they mirror.
"""

from __future__ import annotations

import logging

import torch

from fatune import codegen
from fatune.dispatch import choose_config, interpreting
from fatune.inputs import AttentionProblem, check_inputs
from fatune.spec import AttentionConfig

log = logging.getLogger("fatune")
_fallback_logged: set[str] = set()


def _new_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialised buffer for a kernel to fill (tests replace this to poison outputs)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _new_like(tensor: torch.Tensor, last_dim: int | None = None) -> torch.Tensor:
    """Buffer with tensor's shape (last dim replaced) and its dim order, head dim innermost."""
    shape = list(tensor.shape)
    if last_dim is not None:
        shape[-1] = last_dim
    outer = sorted(range(tensor.dim() - 1), key=lambda i: -tensor.stride(i))
    order = outer + [tensor.dim() - 1]
    buffer = _new_tensor(tuple(shape[i] for i in order), tensor.dtype, tensor.device)
    inverse = [order.index(i) for i in range(tensor.dim())]
    return buffer.permute(inverse)


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, problem: AttentionProblem, config: AttentionConfig):
        out = _new_like(query, problem.spec.head_dim_v)
        lse = _new_tensor((problem.batch, problem.heads, problem.seqlen_q), torch.float32, query.device)
        kernels = codegen.load("fwd", problem.spec, config)
        kernels.launch(query, key, value, out, lse, problem.scale, problem.causal_offset)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.problem = problem
        ctx.config = config
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        problem: AttentionProblem = ctx.problem
        grad = {"query": _new_like(query), "key": _new_like(key), "value": _new_like(value)}
        delta = _new_tensor(tuple(lse.shape), torch.float32, lse.device)
        kernels = codegen.load("bwd", problem.spec, ctx.config)
        kernels.launch(query, key, value, out, lse, grad_out, delta, grad["query"], grad["key"], grad["value"],
                       problem.scale, problem.causal_offset)
        inputs = ("query", "key", "value", "problem", "config")
        return tuple(grad.get(name) for name in inputs)


def _sdpa_fallback(query, key, value, is_causal, scale, enable_gqa, reason: str) -> torch.Tensor:
    if reason not in _fallback_logged:
        _fallback_logged.add(reason)
        log.warning("fatune.attention falls back to torch SDPA: %s", reason)
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
    )


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
    config: AttentionConfig | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention through fatune's generated FlashAttention kernels.

    Shaped like ``torch.nn.functional.scaled_dot_product_attention``:

    - query: (B, H, L_q, D); key: (B, H_kv, L_k, D); value: (B, H_kv, L_k, D_v), any strides,
      float16 / bfloat16 (float32 allowed), all on one CUDA device. H_kv must equal H unless
      ``enable_gqa=True``, then H must be a multiple of H_kv.
    - returns (B, H, L_q, D_v) in query's dtype and dim order; differentiable in query, key, value.
    - is_causal: query i attends to key j <= i (top-left aligned like SDPA; for L_q=2, L_k=4)::

          1 0 0 0
          1 1 0 0

    - scale: defaults to 1 / sqrt(D).
    - config: an AttentionConfig to force launch configs (otherwise the heuristic default).

    On CPU tensors the kernels run in Triton's interpreter when TRITON_INTERPRET=1;
    otherwise the call falls back to torch SDPA and logs why once.
    """
    problem = check_inputs(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if query.device.type != "cuda" and not interpreting():
        return _sdpa_fallback(query, key, value, is_causal, scale, enable_gqa,
                              f"{query.device.type} tensors need a CUDA GPU (or TRITON_INTERPRET=1)")
    chosen = choose_config(problem, query.device, config)
    if problem.seqlen_q == 0 or problem.seqlen_k == 0 or problem.batch == 0 or problem.heads == 0:
        # nothing to attend: rows without keys are 0, like fully masked rows
        return _new_like(query, problem.spec.head_dim_v).zero_() + 0 * (query.sum() + key.sum() + value.sum())
    return _FlashAttention.apply(query, key, value, problem, chosen)
