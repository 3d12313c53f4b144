"""The implementations fatune is measured against: torch SDPA per backend, and FlexAttention."""

from __future__ import annotations

import itertools
from typing import Callable

import torch
import torch.nn.functional as F

from fatune.call import check_inputs
from fatune.kernel import reference
from fatune.tuning.shape import Shape

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

SDPA_BACKENDS = ("cudnn", "flash", "efficient", "math")
MATH_BUDGET_BYTES = 8 << 30  # the math backend materialises B x H x Lq x Lk scores (and more for backward)


def dense_mask(shape: Shape, device: torch.device | str) -> torch.Tensor | None:
    """Bool (B or 1, 1, Lq, Lk) keep-mask for shapes SDPA cannot express with is_causal (None otherwise):
    windows, key padding, causal aligned bottom-right where Lq != Lk (SDPA's is_causal is top-left)."""
    bottom_right = shape.causal and shape.bottom_right and shape.seqlen_q != shape.seqlen_k
    if shape.window < 0 and shape.valid_keys >= 1.0 and not bottom_right:
        return None

    dtype = torch.float16
    q = torch.empty(shape.batch, shape.heads, shape.seqlen_q, 1, dtype=dtype, device="meta")
    kwargs = shape.attention_kwargs(device)
    limit = kwargs["seqlens_k"] if "seqlens_k" in kwargs else shape.seqlen_k
    problem_kwargs = {key: value for key, value in kwargs.items() if key != "seqlens_k"}
    k = torch.empty(shape.batch, shape.kv_heads, shape.seqlen_k, 1, dtype=dtype, device="meta")
    problem = check_inputs(q, k, k, **problem_kwargs)
    return reference.visible(problem, shape.seqlen_q, shape.seqlen_k, limit, torch.device(device))


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
    if shape.documents:  # no SDPA call takes packed documents
        return None
    gqa = shape.kv_heads != shape.heads
    masks: dict[torch.device, torch.Tensor | None] = {}

    def run(q, k, v):
        if q.device not in masks:
            masks[q.device] = dense_mask(shape, q.device)
        mask = masks[q.device]
        with sdpa_kernel(chosen):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=shape.causal and mask is None,
                                                  enable_gqa=gqa)

    return run


def sdpa_default(shape: Shape) -> Attention:
    """torch SDPA with its own backend choice (packed documents: one call per document, the reference)."""
    gqa = shape.kv_heads != shape.heads
    if shape.documents:
        return per_document(shape, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal,
                                                                                 enable_gqa=gqa))

    def run(q, k, v):
        mask = dense_mask(shape, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=shape.causal and mask is None,
                                              enable_gqa=gqa)

    return run


def per_document(shape: Shape, attend: Attention) -> Attention:
    """`attend` on each packed document of `shape` (its (1, H, n, D) views of the (tokens, H, D) inputs),
    the outputs concatenated back into (tokens, H, D); differentiable."""
    lengths = shape.document_lengths()
    starts = [0, *itertools.accumulate(lengths)][:-1]

    def run(q, k, v):
        return torch.cat([attend(*(t[start:start + n].transpose(0, 1)[None] for t in (q, k, v)))[0].transpose(0, 1)
                          for start, n in zip(starts, lengths)])

    return run


def flex(shape: Shape, device: torch.device | str = "cuda") -> Attention:
    """torch.compile'd FlexAttention with the shape's mask as a block mask (causal, sliding window,
    key padding, packed documents), so it skips the blocks fatune skips.

    Packed documents: the (tokens, H, D) inputs are viewed as one (1, H, tokens, D) sequence (no
    copy; the layout of a (B, L, H, D) model's transposed projections) under a document mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # a fresh compile per shape: past dynamo's recompile limit (8 per function; a bench's fifth shape) Flex
    # would silently run its unfused eager path, materialising the scores
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    block_mask = None
    # fatune's alignment: top-left for is_causal alone, bottom-right with a window or when asked (equal for Lq == Lk)
    offset = shape.seqlen_k - shape.seqlen_q if shape.window >= 0 or shape.bottom_right else 0
    valid = shape.kept_keys
    q_len, k_len = (shape.tokens, shape.tokens) if shape.documents else (shape.seqlen_q, shape.seqlen_k)
    document = None
    if shape.documents:  # documents are self-attention: a query and a key of one document share its start
        lengths = torch.tensor(shape.document_lengths(), device=device)
        document = torch.repeat_interleave(torch.arange(shape.documents, device=device), lengths)
    if shape.causal or shape.window >= 0 or valid < shape.seqlen_k or document is not None:
        def keep(b, h, q_idx, kv_idx):
            visible = kv_idx < valid if document is None else document[q_idx] == document[kv_idx]
            if shape.causal or shape.window >= 0:
                visible = visible & (kv_idx <= q_idx + offset)
            if shape.window >= 0:
                visible = visible & (kv_idx >= q_idx + offset - shape.window)
            return visible

        block_mask = create_block_mask(keep, None, None, q_len, k_len, device=device)
    gqa = shape.kv_heads != shape.heads
    if document is None:
        return lambda q, k, v: compiled(q, k, v, block_mask=block_mask, enable_gqa=gqa)

    def run(q, k, v):
        one = [t.transpose(0, 1)[None] for t in (q, k, v)]
        return compiled(*one, block_mask=block_mask, enable_gqa=gqa)[0].transpose(0, 1)

    return run


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
