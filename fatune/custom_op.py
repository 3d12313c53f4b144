"""fatune.attention as torch custom ops, so torch.compile(fullgraph=True) traces it without graph breaks.

`fatune::attention_forward` returns (out, lse, a mask tensor's key spans: int32, empty without
one, handed to the backward so that it does not scan the mask for them again) and
`fatune::attention_backward` the three gradients; both have fake (meta) implementations, and
the backward is registered as the forward's autograd formula. Nothing is decided while tracing: the ops' real
implementations prepare their plan (checks, dispatch, kernel arguments; fatune.plans)
when they run, so a compiled graph picks its configs per call shape, and `dynamic=True`
does not recompile for a new sequence length. Eager calls do not come here: their
autograd.Function costs less on the host.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from fatune import dropout, plans
from fatune.inputs import check_options
from fatune.launch import layout_like, lse_dtype
from fatune.mask_spans import SPAN, compact, is_prepared
from fatune.plans import Call
from fatune.spec import KERNELS, AttentionConfig, LaunchConfig

Tensor = torch.Tensor
_CONFIG_FIELDS = len(dataclasses.fields(LaunchConfig))


def config_to_list(config: AttentionConfig | None) -> list[int]:
    """The op's flat form of a config ([] for none: the op dispatches when it runs)."""
    if config is None:
        return []
    return [value for name in KERNELS for value in dataclasses.astuple(getattr(config, name))]


def config_from_list(values: list[int]) -> AttentionConfig | None:
    if not values:
        return None
    step = _CONFIG_FIELDS
    return AttentionConfig(*(LaunchConfig(*values[i:i + step]) for i in range(0, len(values), step)))


def _call(attn_mask, alibi_slopes, seqlens_k, cu_seqlens_q, cu_seqlens_k, dropout_p, is_causal, scale, enable_gqa,
          window_left, window_right, causal_alignment, max_seqlen_q, max_seqlen_k, block_table) -> Call:
    return Call(attn_mask, dropout_p, is_causal, scale, enable_gqa, (window_left, window_right),
                causal_alignment or None, alibi_slopes, seqlens_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                max_seqlen_k, block_table)


def _lse_rows(q: Tensor, packed: bool) -> tuple:
    return (1, q.shape[1], q.shape[0]) if packed else (q.shape[0], q.shape[1], q.shape[2])


def _lse_dtype(q: Tensor, attn_mask: Optional[Tensor]) -> torch.dtype:
    return lse_dtype(q.dtype, attn_mask is not None and attn_mask.dtype != torch.bool)


def _no_key_spans(q: Tensor, attn_mask: Optional[Tensor]) -> Tensor:
    """The key-spans output where no kernel made them: shaped as the kernels' would be (fatune.mask_spans), empty
    without a mask tensor."""
    if attn_mask is None:
        return q.new_empty((0,), dtype=torch.int32)
    return q.new_zeros((*compact(attn_mask).shape[:3], SPAN), dtype=torch.int32)


@torch.library.custom_op("fatune::attention_forward", mutates_args=())
def attention_forward(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], alibi_slopes: Optional[Tensor],
                      seqlens_k: Optional[Tensor], cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
                      seed: Optional[Tensor], dropout_p: float, is_causal: bool, scale: Optional[float],
                      enable_gqa: bool, window_left: int, window_right: int, causal_alignment: str,
                      max_seqlen_q: Optional[int], max_seqlen_k: Optional[int], block_table: Optional[Tensor],
                      config: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    call = _call(attn_mask, alibi_slopes, seqlens_k, cu_seqlens_q, cu_seqlens_k, dropout_p, is_causal, scale,
                 enable_gqa, window_left, window_right, causal_alignment, max_seqlen_q, max_seqlen_k, block_table)
    prepared = plans.prepare(q, k, v, call, config_from_list(config), None)
    if prepared.plan is None:
        out = plans.run_without_kernels(prepared, q, k, v, call)
        lse = q.new_zeros(_lse_rows(q, cu_seqlens_q is not None), dtype=_lse_dtype(q, attn_mask))
        return out, lse, _no_key_spans(q, attn_mask)
    out, lse, key_spans = prepared.plan.forward_with_spans(q, k, v, call.extras, seed, fresh_workspace=True)
    if key_spans is None:
        return out, lse, _no_key_spans(q, attn_mask)
    return out, lse, key_spans.clone() if is_prepared(key_spans) else key_spans  # an output of its own


@attention_forward.register_fake
def _(q, k, v, attn_mask, alibi_slopes, seqlens_k, cu_seqlens_q, cu_seqlens_k, seed, dropout_p, is_causal, scale,
      enable_gqa, window_left, window_right, causal_alignment, max_seqlen_q, max_seqlen_k, block_table, config):
    out = torch.empty_strided(*layout_like(q.shape, q.stride(), v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = q.new_empty(_lse_rows(q, cu_seqlens_q is not None), dtype=_lse_dtype(q, attn_mask))
    return out, lse, torch.empty_like(_no_key_spans(q, attn_mask))


@torch.library.custom_op("fatune::attention_backward", mutates_args=())
def attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       key_spans: Tensor, attn_mask: Optional[Tensor], alibi_slopes: Optional[Tensor],
                       seqlens_k: Optional[Tensor], cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], seed: Optional[Tensor],
                       dropout_p: float, is_causal: bool, scale: Optional[float], enable_gqa: bool, window_left: int,
                       window_right: int, causal_alignment: str, max_seqlen_q: Optional[int],
                       max_seqlen_k: Optional[int], block_table: Optional[Tensor],
                       config: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    if block_table is not None:
        from fatune.flash_attention import PAGED_GRADIENTS

        raise ValueError(PAGED_GRADIENTS)
    call = _call(attn_mask, alibi_slopes, seqlens_k, cu_seqlens_q, cu_seqlens_k, dropout_p, is_causal, scale,
                 enable_gqa, window_left, window_right, causal_alignment, max_seqlen_q, max_seqlen_k, block_table)
    prepared = plans.prepare(q, k, v, call, config_from_list(config), None)
    if prepared.plan is None:
        return plans.dense_gradients(prepared, q, k, v, call, grad_out)
    spans = key_spans if attn_mask is not None and key_spans.numel() else None  # none made: made again
    return prepared.plan.backward(grad_out, q, k, v, out, lse, call.extras, seed, spans)


@attention_backward.register_fake
def _(grad_out, q, k, v, *rest):
    return tuple(torch.empty_strided(*layout_like(t.shape, t.stride()), dtype=t.dtype, device=t.device)
                 for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, *rest = inputs
    if rest[_INPUTS.index("block_table") - 3] is not None and any(t.requires_grad for t in (q, k, v)):
        from fatune.flash_attention import PAGED_GRADIENTS

        raise ValueError(PAGED_GRADIENTS)
    # the mask and index tensors are saved too: an in-place write to one before the backward raises torch's
    # "modified by an inplace operation" error instead of changing the gradients
    tensors = [i for i, value in enumerate(rest) if isinstance(value, Tensor)]
    ctx.save_for_backward(q, k, v, *output, *(rest[i] for i in tensors))
    ctx.rest, ctx.tensors = rest, tensors


_INPUTS = ("q", "k", "v", "attn_mask", "alibi_slopes", "seqlens_k", "cu_seqlens_q", "cu_seqlens_k", "seed",
           "dropout_p", "is_causal", "scale", "enable_gqa", "window_left", "window_right", "causal_alignment",
           "max_seqlen_q", "max_seqlen_k", "block_table", "config")


def _backward(ctx, grad_out, grad_lse, grad_key_spans):
    q, k, v, out, lse, key_spans, *saved = ctx.saved_tensors
    rest = list(ctx.rest)
    for index, tensor in zip(ctx.tensors, saved):
        rest[index] = tensor
    dq, dk, dv = attention_backward(grad_out, q, k, v, out, lse, key_spans, *rest)
    grads = {"q": dq, "k": dk, "v": dv}
    return tuple(grads.get(name) for name in _INPUTS)


attention_forward.register_autograd(_backward, setup_context=_setup_context)


def attention(q: Tensor, k: Tensor, v: Tensor, call: Call, config: AttentionConfig | None) -> Tensor:
    """fatune.attention through the custom ops (what torch.compile traces). The options are checked here, before
    they become the ops' typed arguments (where is_causal="False" would read as True and a window of 1.5 as 1)."""
    check_options(call.dropout_p, call.is_causal, call.scale, call.enable_gqa, call.window_size,
                  call.causal_alignment)
    seed = dropout.draw_seed(q.device) if call.dropout_p > 0 else None
    window_left, window_right = (min(int(size), 2**62) for size in call.window_size)  # beyond any sequence
    out, _, _ = attention_forward(q, k, v, call.attn_mask, call.alibi_slopes, call.seqlens_k, call.cu_seqlens_q,
                                  call.cu_seqlens_k, seed, float(call.dropout_p), bool(call.is_causal),
                                  None if call.scale is None else float(call.scale), bool(call.enable_gqa),
                                  window_left, window_right, call.causal_alignment or "", call.max_seqlen_q,
                                  call.max_seqlen_k, call.block_table, config_to_list(config))
    return out
