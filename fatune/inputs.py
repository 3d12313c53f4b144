"""Check and normalise the arguments of `fatune.attention` once, before any kernel runs.

Every error names the argument and the expected form; nothing is silently reshaped,
cast or copied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fatune.spec import DTYPES, MAX_HEAD_DIM, KernelSpec


@dataclass(frozen=True)
class AttentionProblem:
    """One validated call: the kernel spec plus the run-time sizes and scalars."""

    spec: KernelSpec
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    scale: float
    causal_offset: int  # query row i sees key j when j <= i + causal_offset

    @property
    def group_size(self) -> int:
        return self.heads // self.kv_heads


def _check_tensor(name: str, tensor: object) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of shape (B, H, L, D), got {type(tensor).__name__}")
    if tensor.dim() != 4:
        raise ValueError(f"{name}: expected 4 dims (B, H, L, D), got shape {tuple(tensor.shape)}")
    if tensor.dtype not in DTYPES.values():
        raise TypeError(f"{name}: expected dtype float16, bfloat16 or float32, got {tensor.dtype}")
    return tensor


def check_inputs(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> AttentionProblem:
    """Validate an SDPA-shaped call and describe it as an AttentionProblem."""
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        _check_tensor(name, tensor)
    if attn_mask is not None:
        raise NotImplementedError("attn_mask: not implemented yet in fatune; pass attn_mask=None")
    if dropout_p != 0.0:
        raise NotImplementedError(f"dropout_p: only 0.0 is implemented in fatune yet, got {dropout_p!r}")
    for name, tensor in (("key", key), ("value", value)):
        if tensor.device != query.device:
            raise ValueError(f"{name}: expected a tensor on {query.device} like query, got {tensor.device}")
        if tensor.dtype != query.dtype:
            raise TypeError(f"{name}: expected dtype {query.dtype} like query, got {tensor.dtype}")

    batch, heads, seqlen_q, head_dim = query.shape
    _, kv_heads, seqlen_k, _ = key.shape
    if key.shape[0] != batch or value.shape[0] != batch:
        raise ValueError(
            f"key/value: expected batch size {batch} like query, got key {key.shape[0]} and value {value.shape[0]}"
        )
    if key.shape[3] != head_dim:
        raise ValueError(f"key: expected head dim {head_dim} like query, got shape {tuple(key.shape)}")
    if value.shape[1] != kv_heads or value.shape[2] != seqlen_k:
        raise ValueError(
            f"value: expected (B, {kv_heads}, {seqlen_k}, Dv) to match key's heads and length, got {tuple(value.shape)}"
        )
    if kv_heads != heads:
        if not enable_gqa:
            raise ValueError(
                f"key: expected {heads} heads like query (or pass enable_gqa=True for grouped-query attention), "
                f"got {kv_heads}"
            )
        if kv_heads == 0 or heads % kv_heads:
            raise ValueError(f"key: with enable_gqa=True, query heads ({heads}) must be a multiple of key heads ({kv_heads})")
    head_dim_v = value.shape[3]
    for name, dim in (("query", head_dim), ("value", head_dim_v)):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"{name}: expected head dim in 1..{MAX_HEAD_DIM}, got {dim}")
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    elif not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"scale: expected a finite float or None, got {scale!r}")

    spec = KernelSpec(dtype=query.dtype, head_dim=head_dim, head_dim_v=head_dim_v, causal=bool(is_causal))
    return AttentionProblem(
        spec=spec,
        batch=batch,
        heads=heads,
        kv_heads=kv_heads,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        scale=float(scale),
        causal_offset=0,
    )
