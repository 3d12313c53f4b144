"""Which keys each query row sees under an attn_mask tensor, and which queries see each key.

A window or a causal mask tells the kernels by formula which tiles hold no visible score; a mask
tensor does not. So a call's mask is first summarised as spans, int32 [first, end) pairs: per query
row, the keys it sees (KEY_SPANS: the forward and dQ kernels stream keys past a query tile); per key,
the query rows that see it (QUERY_SPANS: the dK/dV kernel streams queries past a key tile). An index
that sees nothing gets the empty span [NO_SPAN, 0). A tile loop runs over the union of its rows'
spans only; every tile it skips holds masked scores alone (weight exp(-inf) = 0), so the results
are the dense loop's. A prefix-LM or document mask given as a tensor so skips what is_causal or
cu_seqlens would.

The spans take a few passes over the mask, on the device, in every call that runs kernels (the
forward's key spans; the backward's key and query spans): a mask's memory can change without torch
knowing (a compiled graph reuses a dead mask's buffer for the next one, numpy or another kernel
writes it, a CUDA graph replays), so spans made for one call are never trusted in another.
"""

from __future__ import annotations

import torch

NO_SPAN = 1 << 30  # an empty span's first index: past any sequence (kernel indices are int32), and its end is 0


def compact(mask: torch.Tensor) -> torch.Tensor:
    """A call's attn_mask as 4 dims (leading ones added), each stride-0 dim narrowed to size 1: its distinct
    elements, which broadcast to the call's (B, H, L_q, L_k)."""
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    index = tuple(slice(0, 1) if stride == 0 else slice(None) for stride in mask.stride())
    return mask[index]


SPAN = 4  # int32 per index: first, end (any visible), full_first, full_end (all visible)


def layout(shape: tuple[int, ...], strides: tuple[int, ...], row_dim: int) -> tuple[int, int, int]:
    """Element strides (b, h, l) by which the kernels index the spans of a (B, H, L_q, L_k) mask view of these
    strides along `row_dim` (2: a span per query row; 3: per key): a broadcast dim gets stride 0."""
    sizes = [1 if stride == 0 else size for size, stride in zip(shape, strides)]
    kept = (sizes[0], sizes[1], sizes[row_dim])
    inner = [kept[1] * kept[2] * SPAN, kept[2] * SPAN, SPAN]
    return tuple(stride if size > 1 else 0 for size, stride in zip(kept, inner))


def spans(visible: torch.Tensor, dim: int, length: int, full: bool = True) -> torch.Tensor:
    """int32 (..., SPAN) spans along `dim` of a uint8 (B, H, L_q, L_k) tensor (0 or 1), that dim removed: [first,
    end) of its visible indices and [full_first, end), the run of visible indices that ends at the last one (with
    `full`; else empty). An index with none visible gets [NO_SPAN, 0) for both. `length`: the indices the dim
    stands for when it was broadcast (size 1, every index alike)."""
    size = visible.shape[dim]
    seen = visible.amax(dim).to(torch.int32) if size else visible.sum(dim, dtype=torch.int32)
    if size == 1 and length != 1:  # one element for every index: all or none
        first, end = torch.zeros_like(seen), torch.full_like(seen, length)
        full_first = first
    elif size == 0:
        first = end = full_first = torch.zeros_like(seen)
    else:
        first = visible.argmax(dim).to(torch.int32)  # the first maximum
        end = size - visible.flip(dim).argmax(dim).to(torch.int32)
        full_first = _last_run_start(visible, dim, end) if full else torch.full_like(seen, NO_SPAN)
    seen = seen > 0
    full_seen = seen & (full_first < end) if full else torch.zeros_like(seen)
    return torch.stack((torch.where(seen, first, NO_SPAN), torch.where(seen, end, 0),
                        torch.where(full_seen, full_first, NO_SPAN), torch.where(full_seen, end, 0)),
                       dim=-1).contiguous()


def _last_run_start(visible: torch.Tensor, dim: int, end: torch.Tensor) -> torch.Tensor:
    """Per index of the other dims, where the run of visible entries along `dim` that ends at end - 1 starts: one
    past the last hidden entry before `end` (0 if none)."""
    size = visible.shape[dim]
    shape = [1] * visible.dim()
    shape[dim] = size
    positions = torch.arange(size, device=visible.device, dtype=torch.int32).view(shape)
    hidden = (visible == 0) & (positions < end.unsqueeze(dim))
    last_hidden = size - 1 - hidden.flip(dim).view(torch.uint8).argmax(dim).to(torch.int32)
    return torch.where(hidden.any(dim), last_hidden + 1, 0).to(torch.int32)


def visible(mask: torch.Tensor) -> torch.Tensor:
    """uint8 1 where a (compacted) mask keeps the score: a bool mask's true entries, an additive mask's entries
    other than -inf (NaN included: it reaches the result, so its tile must run)."""
    if mask.dtype in (torch.bool, torch.uint8):  # a bool's bytes need not be 0 or 1 (a uint8 tensor viewed as bool)
        return (mask != 0).view(torch.uint8)
    return (mask != float("-inf")).view(torch.uint8)


def mask_spans(mask: torch.Tensor, shape: tuple[int, int, int, int], want_queries: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(KEY_SPANS, QUERY_SPANS) of a call's attn_mask (bool or additive, broadcastable to `shape`, the call's
    (B, H, L_q, L_k)); QUERY_SPANS None unless `want_queries`. Each is contiguous (B', H', L', 2), B', H', L'
    the mask's own sizes (1 where it broadcasts)."""
    keep = visible(compact(mask))
    full = mask.dtype == torch.bool  # an additive mask is added on every tile: no tile skips it
    key_spans = spans(keep, 3, shape[3], full)
    query_spans = spans(keep, 2, shape[2], full) if want_queries else None
    return key_spans, query_spans
