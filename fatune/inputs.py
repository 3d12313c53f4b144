"""Check and normalise the arguments of `fatune.attention` once, before any kernel runs.

Every error names the argument and the expected form; nothing is silently reshaped,
cast or copied. The result, an AttentionProblem, is what every later stage reads: the
kernel spec (compile-time), the run-time scalars, and the optional mask/length tensors.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from fatune.spec import DTYPES, MAX_HEAD_DIM, KernelSpec

ALIGNMENTS = ("top_left", "bottom_right")


@dataclass(eq=False)
class AttentionProblem:
    """One validated call: kernel spec, run-time sizes and scalars, optional tensors."""

    spec: KernelSpec
    batch: int  # sequences: B, or len(cu_seqlens_q) - 1 when packed
    heads: int
    kv_heads: int
    seqlen_q: int  # rows of the query tensor (total tokens when packed)
    seqlen_k: int
    max_seqlen_q: int
    max_seqlen_k: int
    scale: float
    window_left: int = 0
    window_right: int = 0
    dropout_p: float = 0.0
    attn_mask: torch.Tensor | None = field(default=None, repr=False)  # 4-d broadcast view
    alibi_slopes: torch.Tensor | None = field(default=None, repr=False)  # (B, H) view
    seqlens_k: torch.Tensor | None = field(default=None, repr=False)
    cu_seqlens_q: torch.Tensor | None = field(default=None, repr=False)
    cu_seqlens_k: torch.Tensor | None = field(default=None, repr=False)
    block_table: torch.Tensor | None = field(default=None, repr=False)  # (B, pages per sequence) int32

    @property
    def group_size(self) -> int:
        return self.heads // self.kv_heads if self.kv_heads else 1

    @property
    def packed(self) -> bool:
        return self.cu_seqlens_q is not None


def _check_tensor(name: str, tensor: object, dims: int) -> torch.Tensor:
    layout = "(B, H, L, D)" if dims == 4 else "(total_tokens, H, D)"
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of shape {layout}, got {type(tensor).__name__}")
    if tensor.dim() != dims:
        raise ValueError(f"{name}: expected {dims} dims {layout}, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in DTYPES.values():
        raise TypeError(f"{name}: expected dtype float16, bfloat16 or float32, got {tensor.dtype}")
    return tensor


# Key positions are int32 in the kernels, whose tiles reach up to two key tiles past a cache's end (the page
# lookup runs one tile ahead): a margin of 1024 keys below 2**31 covers any tile the search space has.
MAX_PAGED_KEYS = 2**31 - 1024


# Element offsets inside one (batch, head) slice of a tensor (row x row stride + column x column stride, a packed
# sequence's first row included) are int32 in the kernels; batch, head and page offsets are int64.
MAX_SLICE_OFFSET = 2**31 - 1


def slice_offset(shape: Sequence[int], strides: Sequence[int], row_dim: int) -> int:
    """The largest element offset the kernels compute inside one (batch, head) slice of a tensor of this shape
    and strides: its last row's last column (0 for an empty tensor)."""
    if 0 in shape:
        return 0
    return (shape[row_dim] - 1) * strides[row_dim] + (shape[-1] - 1) * strides[-1]


def _check_slice_offsets(problem_tensors: Sequence[tuple[str, Sequence[int], Sequence[int], int]]) -> None:
    """ValueError naming the first (name, shape, strides, row dim) whose slice offsets do not fit int32."""
    for name, shape, strides, row_dim in problem_tensors:
        reach = slice_offset(shape, strides, row_dim)
        if reach > MAX_SLICE_OFFSET:
            raise ValueError(
                f"{name}: {shape[row_dim]} rows at row stride {strides[row_dim]} reach element {reach} of one "
                f"(batch, head) slice; the kernels' offsets inside a slice are int32 (at most {MAX_SLICE_OFFSET}): "
                + _SLICE_HINTS["attn_mask" if name == "attn_mask" else "output" if "(its " in name else row_dim])


_SLICE_HINTS = {
    2: "pass rows that lie closer (a contiguous (B, H, L, D) tensor) or fewer of them",
    0: "pack fewer tokens per call, or lay the packed tensor out as (H, total, D) memory viewed as (total, H, D)",
    "attn_mask": "pass a mask that broadcasts (stride 0) over its query rows, or split the queries into chunks",
    "output": "its rows already lie together: pass fewer rows (split the call) or a smaller head dim",
}


def _check_int32(name: str, tensor: object, dims: int, layout: str, device: torch.device) -> torch.Tensor:
    """An int32 index tensor of `dims` dims (`layout` names them) on the query's device."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != dims:
        raise TypeError(f"{name}: expected a {dims}-d torch.int32 tensor{layout}, got {tensor!r:.80}")
    if tensor.dtype != torch.int32:
        raise TypeError(f"{name}: expected dtype torch.int32, got {tensor.dtype}")
    if tensor.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} like query, got {tensor.device}")
    return tensor


def _check_index_tensor(name: str, tensor: object, length: int | None, device: torch.device) -> torch.Tensor:
    _check_int32(name, tensor, 1, "", device)
    if length is not None and tensor.shape[0] != length:
        raise ValueError(f"{name}: expected {length} entries, got {tensor.shape[0]}")
    if tensor.shape[0] > 1 and tensor.stride(0) != 1:
        raise ValueError(f"{name}: expected a contiguous tensor (stride 1), got stride {tensor.stride(0)}")
    return tensor


def _check_block_table(table: object, batch: int, key: torch.Tensor, value: torch.Tensor,
                       device: torch.device) -> int:
    """A paged cache's block table against its key/value pages; the keys' logical length per sequence."""
    _check_int32("block_table", table, 2, " (B, pages per sequence)", device)
    if table.shape[0] != batch:
        raise ValueError(f"block_table: expected {batch} rows (one per sequence), got {table.shape[0]}")
    if value.shape[0] != key.shape[0]:
        raise ValueError(f"value: expected {key.shape[0]} pages like key (a paged cache: (pages, H_kv, page size, "
                         f"D)), got {value.shape[0]}")
    if table.shape[1] and key.shape[0] == 0:
        raise ValueError("key: a paged cache with no pages cannot serve a block table with pages")
    pages = table.shape[1] * key.shape[2]
    if pages > MAX_PAGED_KEYS:
        raise ValueError(f"block_table: {table.shape[1]} pages of {key.shape[2]} keys exceed the {MAX_PAGED_KEYS} key "
                         "positions a paged cache can hold")
    return pages


def contents_readable() -> bool:
    """Whether index tensors may be read on the host now: not while torch.compile traces and
    not during CUDA-graph capture (a copy to the host would break both). The kernels clamp
    every index they read, so unchecked values cannot make them touch memory out of bounds."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _longest_packed(name: str, cu: torch.Tensor, total: int, given_max: int | None) -> int:
    """The longest sequence the grid must cover: `given_max` when given (as flash-attn sizes its grid;
    checked to be >= the longest sequence of `cu` whenever `cu` can be read), else the longest
    sequence of `cu`, whose offsets are checked against the `total` tokens."""
    if cu.device.type == "meta" or not contents_readable():
        if given_max is None:
            raise ValueError(f"max_seqlen_{name[-1]}: pass max_seqlen_q and max_seqlen_k as ints under "
                             f"torch.compile and CUDA-graph capture ({name} cannot be read there)")
        return given_max
    values = cu.tolist()
    if values[0] != 0 or values[-1] != total:
        raise ValueError(f"{name}: expected to start at 0 and end at the {total} packed tokens, got {values[0]}..{values[-1]}")
    lengths = [b - a for a, b in zip(values, values[1:])]
    if min(lengths) < 0:
        raise ValueError(f"{name}: expected non-decreasing offsets, got {values}")
    actual = max(lengths)
    given_name = f"max_seqlen_{name[-1]}"
    if given_max is not None and given_max < actual:
        raise ValueError(f"{given_name}: expected an int >= the longest sequence ({actual}), got {given_max!r}")
    return actual if given_max is None else given_max


def check_contents(seqlens_k: torch.Tensor | None, seqlen_k: int, cu_seqlens_q: torch.Tensor | None,
                   cu_seqlens_k: torch.Tensor | None, total_q: int, total_k: int, max_seqlen_q: int | None,
                   max_seqlen_k: int | None) -> tuple[int, int]:
    """Check the values of the index tensors (a host copy); for packed inputs, (longest q, longest k)."""
    if seqlens_k is not None and seqlens_k.numel() and seqlens_k.device.type != "meta" and contents_readable():
        lengths = seqlens_k.tolist()
        if min(lengths) < 0 or max(lengths) > seqlen_k:
            raise ValueError(f"seqlens_k: expected key lengths in 0..{seqlen_k}, got {min(lengths)}..{max(lengths)}")
    if cu_seqlens_q is None or cu_seqlens_k is None:
        return 0, 0
    return (_longest_packed("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q),
            _longest_packed("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k))


def _broadcast_view(name: str, tensor: torch.Tensor, shape: tuple[int, ...], form: str) -> torch.Tensor:
    """A view of `tensor` expanded to `shape` by strides (no copy); errors name the argument."""
    if tensor.dim() > len(shape):
        raise ValueError(f"{name}: expected a tensor broadcastable to {form} {shape}, got shape {tuple(tensor.shape)}")
    try:
        return tensor.reshape((1,) * (len(shape) - tensor.dim()) + tuple(tensor.shape)).expand(shape)
    except RuntimeError:
        raise ValueError(
            f"{name}: expected a tensor broadcastable to {form} {shape}, got shape {tuple(tensor.shape)}"
        ) from None


def check_flag(name: str, value: object, optional: bool = False) -> bool:
    """`value` if it is a bool (or None, when `optional`); TypeError naming `name` otherwise, as torch's SDPA
    refuses is_causal="False" (whose truth value would turn causal attention on)."""
    if isinstance(value, bool) or (optional and value is None):
        return value
    raise TypeError(f"{name}: expected True or False{' or None' if optional else ''}, got {value!r:.80}")


def check_options(dropout_p: object, is_causal: object, scale: object, enable_gqa: object, window_size: object,
                  causal_alignment: object) -> None:
    """The call's scalar options, checked alike on every path (eager, and torch.compile's before they become the
    custom op's typed arguments): TypeError or ValueError naming the first one that is off."""
    check_flag("is_causal", is_causal)
    check_flag("enable_gqa", enable_gqa)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
                              or not math.isfinite(scale)):
        raise TypeError(f"scale: expected a finite float or None, got {scale!r:.80}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: expected a float in [0, 1), got {dropout_p!r:.80}")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, (int, torch.SymInt)) and not isinstance(w, bool) for w in window_size)):
        raise TypeError(f"window_size: expected a pair of ints (left, right), -1 = unbounded, got {window_size!r:.80}")
    if window_size[0] < -1 or window_size[1] < -1:
        raise ValueError(f"window_size: expected sizes >= -1 (-1 = unbounded), got {tuple(window_size)}")
    if causal_alignment is not None and causal_alignment not in ALIGNMENTS:
        raise ValueError(f"causal_alignment: expected one of {ALIGNMENTS} or None, got {causal_alignment!r:.80}")


def check_inputs(
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
    block_table: torch.Tensor | None = None,
    check_index_values: bool = True,
) -> AttentionProblem:
    """Validate an SDPA-shaped (or packed varlen) call and describe it as an AttentionProblem.

    With `block_table` (int32 (B, pages per sequence)), key and value are a paged cache of shape
    (pages, H_kv, page size, D): sequence b's logical page j is cache page block_table[b, j], so its
    keys run to pages per sequence x page size (fewer with seqlens_k). check_index_values=False skips
    reading seqlens_k / cu_seqlens values (for callers that check them per call with
    `check_contents`, or tensors without data); block_table values are never read on the host (the
    kernels clamp them to the cache's pages).
    """
    packed = cu_seqlens_q is not None or cu_seqlens_k is not None
    dims = 3 if packed else 4
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        _check_tensor(name, tensor, dims)
    device = query.device
    for name, tensor in (("key", key), ("value", value)):
        if tensor.device != device:
            raise ValueError(f"{name}: expected a tensor on {device} like query, got {tensor.device}")
        if tensor.dtype != query.dtype:
            raise TypeError(f"{name}: expected dtype {query.dtype} like query, got {tensor.dtype}")

    if packed:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            missing = "cu_seqlens_k" if cu_seqlens_k is None else "cu_seqlens_q"
            raise ValueError(f"{missing}: packed (varlen) inputs need both cu_seqlens_q and cu_seqlens_k")
        total_q, heads, head_dim = query.shape
        total_k, kv_heads, _ = key.shape
        if value.shape[0] != total_k or value.shape[1] != kv_heads:
            raise ValueError(f"value: expected ({total_k}, {kv_heads}, Dv) to match key, got {tuple(value.shape)}")
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            _check_index_tensor(name, cu, None, device)
            if cu.shape[0] < 2:
                raise ValueError(f"{name}: expected at least 2 entries (0, ..., total tokens), got {cu.shape[0]}")
        if cu_seqlens_k.shape[0] != cu_seqlens_q.shape[0]:
            raise ValueError(f"cu_seqlens_k: expected {cu_seqlens_q.shape[0]} entries like cu_seqlens_q, "
                             f"got {cu_seqlens_k.shape[0]}")
        for name, given in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if given is not None and (not isinstance(given, int) or isinstance(given, bool) or given < 0):
                raise ValueError(f"{name}: expected an int >= the longest sequence, or None, got {given!r}")
        batch, seqlen_q, seqlen_k = cu_seqlens_q.shape[0] - 1, total_q, total_k
        max_q, max_k = max_seqlen_q, max_seqlen_k
        if attn_mask is not None:
            raise ValueError("attn_mask: not supported with packed (cu_seqlens) inputs; use window_size or seqlens")
        if seqlens_k is not None:
            raise ValueError("seqlens_k: not used with packed inputs (cu_seqlens_k already gives key lengths)")
        if block_table is not None:
            raise ValueError("block_table: not used with packed inputs (a paged cache takes (B, H, L_q, D) queries)")
    else:
        batch, heads, seqlen_q, head_dim = query.shape
        _, kv_heads, seqlen_k, _ = key.shape
        if block_table is not None:
            seqlen_k = _check_block_table(block_table, batch, key, value, device)
        elif key.shape[0] != batch or value.shape[0] != batch:
            raise ValueError(f"key/value: expected batch size {batch} like query, "
                             f"got key {key.shape[0]} and value {value.shape[0]}")
        if value.shape[1] != kv_heads or value.shape[2] != key.shape[2]:
            raise ValueError(f"value: expected ({value.shape[0]}, {kv_heads}, {key.shape[2]}, Dv) to match key's "
                             f"heads and length, got {tuple(value.shape)}")
        max_q, max_k = seqlen_q, seqlen_k
        if max_seqlen_q is not None or max_seqlen_k is not None:
            raise ValueError("max_seqlen_q: only used with packed inputs (cu_seqlens_q / cu_seqlens_k)")

    if key.shape[-1] != head_dim:
        raise ValueError(f"key: expected head dim {head_dim} like query, got shape {tuple(key.shape)}")
    if kv_heads != heads:
        if not enable_gqa:
            raise ValueError(f"key: expected {heads} heads like query (or pass enable_gqa=True for "
                             f"grouped-query attention), got {kv_heads}")
        if kv_heads == 0 or heads % kv_heads:
            raise ValueError(f"key: with enable_gqa=True, query heads ({heads}) must be a multiple of "
                             f"key/value heads ({kv_heads})")
    head_dim_v = value.shape[-1]
    for name, dim in (("query", head_dim), ("value", head_dim_v)):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"{name}: expected head dim in 1..{MAX_HEAD_DIM}, got {dim}")

    check_options(dropout_p, is_causal, scale, enable_gqa, window_size, causal_alignment)
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    left, right = window_size
    windowed = (left, right) != (-1, -1)
    if causal_alignment is None:
        causal_alignment = "bottom_right" if windowed or packed else "top_left"
    if is_causal:
        right = 0 if right == -1 else min(right, 0)
    # a window reaching past every key is no window: the kernels never see sizes beyond int32
    reach = seqlen_q + seqlen_k
    left = -1 if left >= reach else left
    right = -1 if right >= reach else right
    if left == -1 and (right == -1 or is_causal) and seqlen_q == seqlen_k and not packed and seqlens_k is None:
        # both alignments give the same mask (offset L_k - L_q = 0): take the kernel and tuned entries of the plain
        # call, not those of a window searched at longer lengths (a window covering every key is no window)
        causal_alignment = "top_left"

    mask_kind = "none"
    mask_view = None
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask: expected a bool or float tensor, got {type(attn_mask).__name__}")
        if attn_mask.device != device:
            raise ValueError(f"attn_mask: expected a tensor on {device} like query, got {attn_mask.device}")
        if attn_mask.dtype == torch.bool:
            mask_kind = "bool"
        elif attn_mask.dtype in (query.dtype, torch.float32):
            mask_kind = "additive"
            if attn_mask.requires_grad:
                raise ValueError("attn_mask: gradients w.r.t. an additive mask are not computed; "
                                 "pass attn_mask.detach()")
        else:
            allowed = ", ".join(str(t) for t in dict.fromkeys((torch.bool, query.dtype, torch.float32)))
            raise TypeError(f"attn_mask: expected dtype {allowed}, got {attn_mask.dtype}")
        mask_view = _broadcast_view("attn_mask", attn_mask, (batch, heads, seqlen_q, seqlen_k), "(B, H, L_q, L_k)")
        if mask_kind == "bool":
            mask_view = mask_view.view(torch.uint8)

    alibi_view = None
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype != torch.float32:
            raise TypeError(f"alibi_slopes: expected a float32 tensor of shape (H,) or (B, H), got {alibi_slopes!r:.80}")
        if alibi_slopes.device != device:
            raise ValueError(f"alibi_slopes: expected a tensor on {device} like query, got {alibi_slopes.device}")
        if alibi_slopes.requires_grad:
            raise ValueError("alibi_slopes: gradients w.r.t. the slopes are not computed; pass alibi_slopes.detach()")
        if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
            raise ValueError(f"alibi_slopes: expected shape ({heads},) or ({batch}, {heads}), "
                             f"got {tuple(alibi_slopes.shape)}")
        alibi_view = alibi_slopes.expand(batch, heads)

    if seqlens_k is not None:
        _check_index_tensor("seqlens_k", seqlens_k, batch, device)
    if check_index_values:
        longest_q, longest_k = check_contents(seqlens_k, seqlen_k, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k,
                                              max_q, max_k)
        if packed:
            max_q, max_k = longest_q, longest_k
    elif packed and (max_q is None or max_k is None):
        raise ValueError("max_seqlen_q: pass max_seqlen_q and max_seqlen_k when the cu_seqlens values are not read")

    # the layouts of the outputs and gradients the kernels write
    from fatune.launch import layout_like

    row_dim = 0 if packed else 2
    laid_out = [(name, tuple(t.shape), t.stride(), row_dim) for name, t in (("query", query), ("key", key),
                                                                             ("value", value))]
    laid_out += [(f"{name} (its {what})", *layout, row_dim) for name, what, layout in (
        ("query", "output", layout_like(query.shape, query.stride(), head_dim_v)),
        ("query", "gradient", layout_like(query.shape, query.stride())),
        ("key", "gradient", layout_like(key.shape, key.stride())),
        ("value", "gradient", layout_like(value.shape, value.stride())))]
    if mask_view is not None:
        laid_out.append(("attn_mask", tuple(mask_view.shape), mask_view.stride(), 2))
    _check_slice_offsets(laid_out)

    spec = KernelSpec(
        dtype=query.dtype,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        causal=bool(is_causal),
        window_left=left >= 0,
        window_right=right >= 0 and not is_causal,
        bottom_right=causal_alignment == "bottom_right",
        attn_mask=mask_kind,
        seqlens="varlen" if packed else ("seqlens_k" if seqlens_k is not None else "fixed"),
        alibi=alibi_slopes is not None,
        dropout=dropout_p > 0.0,
        paged=block_table is not None,
    )
    return AttentionProblem(
        spec=spec, batch=batch, heads=heads, kv_heads=kv_heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        max_seqlen_q=max_q, max_seqlen_k=max_k, scale=float(scale),
        window_left=max(left, 0), window_right=max(right, 0), dropout_p=float(dropout_p),
        attn_mask=mask_view, alibi_slopes=alibi_view, seqlens_k=seqlens_k,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, block_table=block_table,
    )
