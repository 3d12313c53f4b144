"""fatune.attention as torch custom ops, so torch.compile(fullgraph=True) traces it without graph breaks.

`fatune::attention_forward` returns (out, lse) and `fatune::attention_backward` the three
gradients; both have fake (meta) implementations, and the backward is registered as the
forward's autograd formula. Eager calls do not go through here: fatune.attention calls
its autograd.Function directly, which costs less on the host. Under compilation,
fatune.attention routes here (see flash_attention.attention).
"""

from __future__ import annotations

from typing import Optional

import torch

from fatune.spec import KERNELS, AttentionConfig, LaunchConfig

Tensor = torch.Tensor


def config_to_list(config: AttentionConfig) -> list[int]:
    return [value for name in KERNELS for value in getattr(config, name).to_dict().values()]


def config_from_list(values: list[int]) -> AttentionConfig:
    return AttentionConfig(*(LaunchConfig(*values[i:i + 4]) for i in range(0, 12, 4)))


def _problem(q, k, v, attn_mask, alibi_slopes, seqlens_k, cu_seqlens_q, cu_seqlens_k, dropout_p, is_causal, scale,
             enable_gqa, window_left, window_right, causal_alignment, max_seqlen_q, max_seqlen_k):
    from fatune.inputs import check_inputs

    return check_inputs(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                        window_size=(window_left, window_right), causal_alignment=causal_alignment or None,
                        alibi_slopes=alibi_slopes, seqlens_k=seqlens_k, cu_seqlens_q=cu_seqlens_q,
                        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q or None,
                        max_seqlen_k=max_seqlen_k or None)


def _allocate(problem, q):
    from fatune.flash_attention import _new_like, _new_tensor

    out = _new_like(q, problem.spec.head_dim_v)
    rows = (1, problem.heads, problem.seqlen_q) if problem.packed else (problem.batch, problem.heads, problem.seqlen_q)
    return out, _new_tensor(rows, torch.float32, q.device)


@torch.library.custom_op("fatune::attention_forward", mutates_args=())
def attention_forward(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], alibi_slopes: Optional[Tensor],
                      seqlens_k: Optional[Tensor], cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
                      seed: Tensor, dropout_p: float, is_causal: bool, scale: float, enable_gqa: bool,
                      window_left: int, window_right: int, causal_alignment: str, max_seqlen_q: int,
                      max_seqlen_k: int, config: list[int]) -> tuple[Tensor, Tensor]:
    from fatune import codegen
    from fatune.flash_attention import _kernel_args

    problem = _problem(q, k, v, attn_mask, alibi_slopes, seqlens_k, cu_seqlens_q, cu_seqlens_k, dropout_p, is_causal,
                       scale, enable_gqa, window_left, window_right, causal_alignment, max_seqlen_q, max_seqlen_k)
    out, lse = _allocate(problem, q)
    codegen.load("fwd", problem.spec, config_from_list(config)).launch(
        _kernel_args(problem, q, k, v, out, lse, int(seed.item())))
    return out, lse


@attention_forward.register_fake
def _(q, k, v, attn_mask, alibi_slopes, seqlens_k, cu_seqlens_q, cu_seqlens_k, seed, dropout_p, is_causal, scale,
      enable_gqa, window_left, window_right, causal_alignment, max_seqlen_q, max_seqlen_k, config):
    from fatune.flash_attention import _new_like

    packed = cu_seqlens_q is not None
    out = _new_like(q, v.shape[-1])
    rows = (1, q.shape[1], q.shape[0]) if packed else (q.shape[0], q.shape[1], q.shape[2])
    return out, q.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("fatune::attention_backward", mutates_args=())
def attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       attn_mask: Optional[Tensor], alibi_slopes: Optional[Tensor], seqlens_k: Optional[Tensor],
                       cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], seed: Tensor, dropout_p: float,
                       is_causal: bool, scale: float, enable_gqa: bool, window_left: int, window_right: int,
                       causal_alignment: str, max_seqlen_q: int, max_seqlen_k: int,
                       config: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    from fatune import codegen
    from fatune.flash_attention import _as_bhld, _kernel_args, _new_like, _new_tensor

    problem = _problem(q, k, v, attn_mask, alibi_slopes, seqlens_k, cu_seqlens_q, cu_seqlens_k, dropout_p, is_causal,
                       scale, enable_gqa, window_left, window_right, causal_alignment, max_seqlen_q, max_seqlen_k)
    packed = problem.packed
    dq, dk, dv = _new_like(q), _new_like(k), _new_like(v)
    args = _kernel_args(problem, q, k, v, out, lse, int(seed.item()))
    args.grad_out = _as_bhld(grad_out, packed)
    args.delta = _new_tensor(tuple(lse.shape), torch.float32, lse.device)
    args.grad_q, args.grad_k, args.grad_v = (_as_bhld(t, packed) for t in (dq, dk, dv))
    codegen.load("bwd", problem.spec, config_from_list(config)).launch(args)
    return dq, dk, dv


@attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, *rest):
    from fatune.flash_attention import _new_like

    return _new_like(q), _new_like(k), _new_like(v)


_SCALARS = ("attn_mask", "alibi_slopes", "seqlens_k", "cu_seqlens_q", "cu_seqlens_k", "seed", "dropout_p",
            "is_causal", "scale", "enable_gqa", "window_left", "window_right", "causal_alignment", "max_seqlen_q",
            "max_seqlen_k", "config")


def _setup_context(ctx, inputs, output):
    q, k, v, *rest = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.rest = rest


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attention_backward(grad_out.contiguous() if grad_out.stride(-1) != 1 else grad_out,
                                    q, k, v, out, lse, *ctx.rest)
    grads = {"q": dq, "k": dk, "v": dv}
    return tuple(grads.get(name) for name in ("q", "k", "v", *_SCALARS))


attention_forward.register_autograd(_backward, setup_context=_setup_context)


def attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, window_size, causal_alignment,
              alibi_slopes, seqlens_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              config: AttentionConfig) -> Tensor:
    """fatune.attention through the custom ops (for torch.compile)."""
    seed = torch.randint(0, 2**62, (1,)) if dropout_p > 0 else torch.zeros(1, dtype=torch.int64)
    scale = float(scale) if scale is not None else q.shape[-1] ** -0.5
    out, _ = attention_forward(q, k, v, attn_mask, alibi_slopes, seqlens_k, cu_seqlens_q, cu_seqlens_k, seed,
                               float(dropout_p), bool(is_causal), scale, bool(enable_gqa), int(window_size[0]),
                               int(window_size[1]), causal_alignment or "", int(max_seqlen_q or 0),
                               int(max_seqlen_k or 0), config_to_list(config))
    return out


class FlashAttention(torch.nn.Module):
    """Drop-in attention module: forward(query, key, value, **kwargs) = fatune.attention(..., **defaults, **kwargs)."""

    def __init__(self, **defaults):
        super().__init__()
        self.defaults = defaults

    def forward(self, query: Tensor, key: Tensor, value: Tensor, **kwargs) -> Tensor:
        from fatune.flash_attention import attention as fatune_attention

        return fatune_attention(query, key, value, **{**self.defaults, **kwargs})
