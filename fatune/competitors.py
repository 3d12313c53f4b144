"""The implementations fatune is measured against: torch SDPA per backend, and FlexAttention."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from fatune.measure import Shape

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

SDPA_BACKENDS = ("cudnn", "flash", "efficient", "math")
MATH_BUDGET_BYTES = 8 << 30  # the math backend materialises B x H x Lq x Lk scores (and more for backward)


def sdpa(backend: str, shape: Shape) -> Attention | None:
    """torch SDPA forced onto one backend; None when that backend cannot take `shape`."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }[backend]
    if backend == "math" and 12 * shape.batch * shape.heads * shape.seqlen_q * shape.seqlen_k > MATH_BUDGET_BYTES:
        return None
    gqa = shape.kv_heads != shape.heads

    def run(q, k, v):
        with sdpa_kernel(chosen):
            return F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal, enable_gqa=gqa)

    return run


def sdpa_default(shape: Shape) -> Attention:
    """torch SDPA with its own backend choice."""
    gqa = shape.kv_heads != shape.heads
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal, enable_gqa=gqa)


def flex(shape: Shape, device: torch.device | str = "cuda") -> Attention:
    """torch.compile'd FlexAttention, with a causal block mask when the shape is causal."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    block_mask = None
    if shape.causal:
        def causal(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        block_mask = create_block_mask(causal, None, None, shape.seqlen_q, shape.seqlen_k, device=device)
    gqa = shape.kv_heads != shape.heads
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask, enable_gqa=gqa)


def competitors(shape: Shape, names: tuple[str, ...] = ("cudnn", "flash", "efficient", "math", "flex")
                ) -> dict[str, Attention]:
    """Every requested competitor that can run `shape`, by name ('sdpa-cudnn', ..., 'flex')."""
    found: dict[str, Attention] = {}
    for name in names:
        if name == "flex":
            found["flex"] = flex(shape)
        else:
            runner = sdpa(name, shape)
            if runner is not None:
                found[f"sdpa-{name}"] = runner
    return found
