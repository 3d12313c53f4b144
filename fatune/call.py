"""The call of `fatune.attention`: its arguments (described once, ARGUMENTS), their checks, and its plan key.

The arguments are checked once per call signature, before any kernel runs. Every error names the argument
and the expected form; nothing is silently reshaped, cast or copied. The result, an AttentionProblem
(fatune.kernel.problem), is what every later stage reads: the kernel spec (compile-time), the run-time
scalars, and the optional mask/length tensors. The plan key (`plan_key`) holds every property of a call
that the checks, the dispatcher and the kernels' specialisation read, and no tensor value.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from fatune.kernel.layout import MAX_SLICE_OFFSET, layout_like, slice_offset
from fatune.kernel.problem import OPTIONAL_TENSORS, AttentionProblem
from fatune.kernel.spec import DTYPES, MAX_HEAD_DIM, AttentionConfig, KernelSpec
from fatune.kernel.triton.launch import NO_EXTRAS

ALIGNMENTS = ("top_left", "bottom_right")
MAX_SCALE = float(torch.finfo(torch.float32).max) / math.log2(math.e)  # its product with log2(e) stays a float32


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
    checked to be >= the longest sequence of `cu` whenever `cu` can be read), at most the `total` tokens (no
    sequence is longer: a model's maximum length passed for a short batch sizes no idle programs), else the
    longest sequence of `cu`, whose offsets are checked against the `total` tokens."""
    if cu.device.type == "meta" or not contents_readable():
        if given_max is None:
            raise ValueError(f"max_seqlen_{name[-1]}: pass max_seqlen_q and max_seqlen_k as ints under "
                             f"torch.compile and CUDA-graph capture, and with meta or fake tensors ({name} cannot "
                             f"be read there)")
        return min(given_max, total)
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
    return actual if given_max is None else min(given_max, total)


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
    if scale is not None and abs(scale) > MAX_SCALE:
        raise ValueError(f"scale: expected a magnitude up to {MAX_SCALE:.4g} (the kernels scale the scores by it "
                         f"times log2(e) in float32), got {scale!r:.80}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: expected a float in [0, 1), got {dropout_p!r:.80}")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, (int, torch.SymInt)) and not isinstance(w, bool) for w in window_size)):
        raise TypeError(f"window_size: expected a pair of ints (left, right), -1 = unbounded, got {window_size!r:.80}")
    if window_size[0] < -1 or window_size[1] < -1:
        raise ValueError(f"window_size: expected sizes >= -1 (-1 = unbounded), got {tuple(window_size)}")
    if causal_alignment is not None and causal_alignment not in ALIGNMENTS:
        raise ValueError(f"causal_alignment: expected one of {ALIGNMENTS} or None, got {causal_alignment!r:.80}")


@dataclass(frozen=True)
class Argument:
    """One argument of fatune.attention besides query, key and value, as every path takes it."""

    name: str
    default: Any
    op_type: str  # its type in the custom ops' schema (fatune.ops)
    keyword_only: bool = True


# fatune.attention's arguments after query, key and value, in order: the Call tuple, the custom ops' schema and the
# public signature's test derive from this table (the optional tensors' kernel order: fatune.kernel.problem)
ARGUMENTS = (
    Argument("attn_mask", None, "Tensor?", keyword_only=False),
    Argument("dropout_p", 0.0, "float", keyword_only=False),
    Argument("is_causal", False, "bool", keyword_only=False),
    Argument("scale", None, "float?", keyword_only=False),
    Argument("enable_gqa", False, "bool", keyword_only=False),
    Argument("window_size", (-1, -1), "int[]"),
    Argument("causal_alignment", None, "str?"),
    Argument("alibi_slopes", None, "Tensor?"),
    Argument("seqlens_k", None, "Tensor?"),
    Argument("cu_seqlens_q", None, "Tensor?"),
    Argument("cu_seqlens_k", None, "Tensor?"),
    Argument("max_seqlen_q", None, "int?"),
    Argument("max_seqlen_k", None, "int?"),
    Argument("block_table", None, "Tensor?"),
)
DOUBLE_BACKWARD = "fatune.attention: double backward (create_graph=True) is not supported"
PAGED_GRADIENTS = ("block_table: a paged K/V cache is read for inference only (no gradients); call under "
                   "torch.no_grad() or pass detached tensors")


class _CallFields(NamedTuple):
    attn_mask: Any
    dropout_p: Any
    is_causal: Any
    scale: Any
    enable_gqa: Any
    window_size: Any
    causal_alignment: Any
    alibi_slopes: Any
    seqlens_k: Any
    cu_seqlens_q: Any
    cu_seqlens_k: Any
    max_seqlen_q: Any
    max_seqlen_k: Any
    block_table: Any


class Call(_CallFields):
    """The arguments of one fatune.attention call besides query, key and value (ARGUMENTS, in order)."""

    __slots__ = ()

    def check(self, query, key, value, check_index_values: bool = True) -> AttentionProblem:
        return check_call(query, key, value, self, check_index_values)

    @property
    def extras(self) -> tuple:
        """The optional tensors in the kernels' order (OPTIONAL_TENSORS); NO_EXTRAS when there is none."""
        extras = tuple(getattr(self, name) for name in OPTIONAL_TENSORS)
        return NO_EXTRAS if extras == NO_EXTRAS else extras


assert _CallFields._fields == tuple(argument.name for argument in ARGUMENTS)
_CallFields.__new__.__defaults__ = tuple(argument.default for argument in ARGUMENTS)


def check_inputs(query, key, value, *, check_index_values: bool = True, **arguments) -> AttentionProblem:
    """check_call with the arguments by name (those fatune.attention takes besides query, key and value)."""
    return check_call(query, key, value, Call(**arguments), check_index_values)


def check_call(query, key, value, call: Call, check_index_values: bool = True) -> AttentionProblem:
    """Validate an SDPA-shaped (or packed varlen) call and describe it as an AttentionProblem.

    With `block_table` (int32 (B, pages per sequence)), key and value are a paged cache of shape
    (pages, H_kv, page size, D): sequence b's logical page j is cache page block_table[b, j], so its
    keys run to pages per sequence x page size (fewer with seqlens_k). check_index_values=False skips
    reading seqlens_k / cu_seqlens values (for callers that check them per call with
    `check_contents`, or tensors without data); block_table values are never read on the host (the
    kernels clamp them to the cache's pages).
    """
    packed = call.cu_seqlens_q is not None or call.cu_seqlens_k is not None
    device = _check_qkv(query, key, value, 3 if packed else 4)
    sizes = _packed_sizes(query, key, value, call, device) if packed else _padded_sizes(query, key, value, call, device)
    batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, max_q, max_k = sizes
    head_dim_v = value.shape[-1]
    _check_heads(key, heads, kv_heads, head_dim, head_dim_v, call.enable_gqa)
    check_options(call.dropout_p, call.is_causal, call.scale, call.enable_gqa, call.window_size, call.causal_alignment)
    scale = 1.0 / math.sqrt(head_dim) if call.scale is None else call.scale
    left, right, alignment = _band(call, seqlen_q, seqlen_k, packed)
    mask_kind, mask_view = _check_mask(call.attn_mask, query.dtype, device, (batch, heads, seqlen_q, seqlen_k))
    alibi_view = _check_alibi(call.alibi_slopes, device, batch, heads)
    if call.seqlens_k is not None:
        _check_index_tensor("seqlens_k", call.seqlens_k, batch, device)
    if check_index_values:
        longest_q, longest_k = check_contents(call.seqlens_k, seqlen_k, call.cu_seqlens_q, call.cu_seqlens_k, seqlen_q,
                                              seqlen_k, max_q, max_k)
        if packed:
            max_q, max_k = longest_q, longest_k
    elif packed and (max_q is None or max_k is None):
        raise ValueError("max_seqlen_q: pass max_seqlen_q and max_seqlen_k when the cu_seqlens values are not read")
    _check_layouts(query, key, value, head_dim_v, mask_view, 0 if packed else 2)
    spec = KernelSpec(
        dtype=query.dtype,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        causal=call.is_causal,
        window_left=left >= 0,
        window_right=right >= 0 and not call.is_causal,
        bottom_right=alignment == "bottom_right",
        attn_mask=mask_kind,
        seqlens="varlen" if packed else ("seqlens_k" if call.seqlens_k is not None else "fixed"),
        alibi=call.alibi_slopes is not None,
        dropout=bool(call.dropout_p > 0.0),  # (a numpy float's comparison is numpy's bool)
        paged=call.block_table is not None,
    )
    return AttentionProblem(
        spec=spec, batch=batch, heads=heads, kv_heads=kv_heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        max_seqlen_q=max_q, max_seqlen_k=max_k, scale=float(scale),
        window_left=max(left, 0), window_right=max(right, 0), dropout_p=float(call.dropout_p),
        attn_mask=mask_view, alibi_slopes=alibi_view, seqlens_k=call.seqlens_k,
        cu_seqlens_q=call.cu_seqlens_q, cu_seqlens_k=call.cu_seqlens_k, block_table=call.block_table,
    )


def _check_qkv(query, key, value, dims: int) -> torch.device:
    """query, key and value: tensors of `dims` dims, one floating dtype and one device (that device)."""
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        _check_tensor(name, tensor, dims)
    device = query.device
    for name, tensor in (("key", key), ("value", value)):
        if tensor.device != device:
            raise ValueError(f"{name}: expected a tensor on {device} like query, got {tensor.device}")
        if tensor.dtype != query.dtype:
            raise TypeError(f"{name}: expected dtype {query.dtype} like query, got {tensor.dtype}")
    return device


def _packed_sizes(query, key, value, call: Call, device: torch.device) -> tuple:
    """(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, max q, max k) of packed (total, H, D) inputs."""
    if call.cu_seqlens_q is None or call.cu_seqlens_k is None:
        missing = "cu_seqlens_k" if call.cu_seqlens_k is None else "cu_seqlens_q"
        raise ValueError(f"{missing}: packed (varlen) inputs need both cu_seqlens_q and cu_seqlens_k")
    total_q, heads, head_dim = query.shape
    total_k, kv_heads, _ = key.shape
    if value.shape[0] != total_k or value.shape[1] != kv_heads:
        raise ValueError(f"value: expected ({total_k}, {kv_heads}, Dv) to match key, got {tuple(value.shape)}")
    for name, cu in (("cu_seqlens_q", call.cu_seqlens_q), ("cu_seqlens_k", call.cu_seqlens_k)):
        _check_index_tensor(name, cu, None, device)
        if cu.shape[0] < 2:
            raise ValueError(f"{name}: expected at least 2 entries (0, ..., total tokens), got {cu.shape[0]}")
    if call.cu_seqlens_k.shape[0] != call.cu_seqlens_q.shape[0]:
        raise ValueError(f"cu_seqlens_k: expected {call.cu_seqlens_q.shape[0]} entries like cu_seqlens_q, "
                         f"got {call.cu_seqlens_k.shape[0]}")
    for name, given in (("max_seqlen_q", call.max_seqlen_q), ("max_seqlen_k", call.max_seqlen_k)):
        if given is not None and (not isinstance(given, int) or isinstance(given, bool)):
            raise TypeError(f"{name}: expected a Python int (>= the longest sequence) or None, got "
                            f"{type(given).__name__} {given!r}")
        if given is not None and given < 0:
            raise ValueError(f"{name}: expected an int >= the longest sequence, or None, got {given!r}")
    for name, reason in (("attn_mask", "not supported with packed (cu_seqlens) inputs; use window_size or seqlens"),
                         ("seqlens_k", "not used with packed inputs (cu_seqlens_k already gives key lengths)"),
                         ("block_table", "not used with packed inputs (a paged cache takes (B, H, L_q, D) queries)")):
        if getattr(call, name) is not None:
            raise ValueError(f"{name}: {reason}")
    # no sequence is longer than the packed tokens (see _longest_packed)
    max_q, max_k = (None if given is None else min(given, total) for given, total in
                    ((call.max_seqlen_q, total_q), (call.max_seqlen_k, total_k)))
    return call.cu_seqlens_q.shape[0] - 1, heads, kv_heads, total_q, total_k, head_dim, max_q, max_k


def _padded_sizes(query, key, value, call: Call, device: torch.device) -> tuple:
    """(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, max q, max k) of (B, H, L, D) inputs (key and value
    a paged cache with a block table)."""
    batch, heads, seqlen_q, head_dim = query.shape
    _, kv_heads, seqlen_k, _ = key.shape
    if call.block_table is not None:
        seqlen_k = _check_block_table(call.block_table, batch, key, value, device)
    elif key.shape[0] != batch or value.shape[0] != batch:
        raise ValueError(f"key/value: expected batch size {batch} like query, "
                         f"got key {key.shape[0]} and value {value.shape[0]}")
    if value.shape[1] != kv_heads or value.shape[2] != key.shape[2]:
        raise ValueError(f"value: expected ({value.shape[0]}, {kv_heads}, {key.shape[2]}, Dv) to match key's "
                         f"heads and length, got {tuple(value.shape)}")
    for name in ("max_seqlen_q", "max_seqlen_k"):
        if getattr(call, name) is not None:
            raise ValueError(f"{name}: only used with packed inputs (cu_seqlens_q / cu_seqlens_k)")
    return batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, seqlen_q, seqlen_k


def _check_heads(key, heads: int, kv_heads: int, head_dim: int, head_dim_v: int, enable_gqa: bool) -> None:
    if key.shape[-1] != head_dim:
        raise ValueError(f"key: expected head dim {head_dim} like query, got shape {tuple(key.shape)}")
    if kv_heads != heads:
        if not enable_gqa:
            raise ValueError(f"key: expected {heads} heads like query (or pass enable_gqa=True for "
                             f"grouped-query attention), got {kv_heads}")
        if kv_heads == 0 or heads % kv_heads:
            raise ValueError(f"key: with enable_gqa=True, query heads ({heads}) must be a multiple of "
                             f"key/value heads ({kv_heads})")
    for name, dim in (("query", head_dim), ("value", head_dim_v)):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"{name}: expected head dim in 1..{MAX_HEAD_DIM}, got {dim}")


def _band(call: Call, seqlen_q: int, seqlen_k: int, packed: bool) -> tuple[int, int, str]:
    """(left, right, alignment) of the call's band: -1 where an edge is unbounded; a causal mask's right edge 0."""
    left, right = call.window_size
    windowed = (left, right) != (-1, -1)
    alignment = call.causal_alignment or ("bottom_right" if windowed or packed else "top_left")
    if call.is_causal:
        right = 0 if right == -1 else min(right, 0)
    # a window reaching past every key is no window: the kernels never see sizes beyond int32
    reach = seqlen_q + seqlen_k
    left = -1 if left >= reach else left
    right = -1 if right >= reach else right
    if left == -1 and (right == -1 or call.is_causal) and seqlen_q == seqlen_k and not packed and \
            call.seqlens_k is None:
        # both alignments give the same mask (offset L_k - L_q = 0): take the kernel and tuned entries of the plain
        # call, not those of a window searched at longer lengths (a window covering every key is no window)
        alignment = "top_left"
    return left, right, alignment


def _check_mask(attn_mask, dtype: torch.dtype, device: torch.device, shape: tuple[int, ...]
                ) -> tuple[str, torch.Tensor | None]:
    """The mask's kind ("none", "bool", "additive") and its (B, H, L_q, L_k) broadcast view (bool as uint8)."""
    if attn_mask is None:
        return "none", None
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask: expected a bool or float tensor, got {type(attn_mask).__name__}")
    if attn_mask.device != device:
        raise ValueError(f"attn_mask: expected a tensor on {device} like query, got {attn_mask.device}")
    if attn_mask.dtype == torch.bool:
        kind = "bool"
    elif attn_mask.dtype in (dtype, torch.float32):
        kind = "additive"
        if attn_mask.requires_grad:
            raise ValueError("attn_mask: gradients w.r.t. an additive mask are not computed; pass attn_mask.detach()")
    else:
        allowed = ", ".join(str(t) for t in dict.fromkeys((torch.bool, dtype, torch.float32)))
        raise TypeError(f"attn_mask: expected dtype {allowed}, got {attn_mask.dtype}")
    view = _broadcast_view("attn_mask", attn_mask, shape, "(B, H, L_q, L_k)")
    return kind, view.view(torch.uint8) if kind == "bool" else view


def _check_alibi(alibi_slopes, device: torch.device, batch: int, heads: int) -> torch.Tensor | None:
    """The slopes as a (B, H) view."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes: expected a float32 tensor of shape (H,) or (B, H), got {alibi_slopes!r:.80}")
    if alibi_slopes.device != device:
        raise ValueError(f"alibi_slopes: expected a tensor on {device} like query, got {alibi_slopes.device}")
    if alibi_slopes.requires_grad:
        raise ValueError("alibi_slopes: gradients w.r.t. the slopes are not computed; pass alibi_slopes.detach()")
    if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes: expected shape ({heads},) or ({batch}, {heads}), "
                         f"got {tuple(alibi_slopes.shape)}")
    return alibi_slopes.expand(batch, heads)


def _check_layouts(query, key, value, head_dim_v: int, mask_view: torch.Tensor | None, row_dim: int) -> None:
    """Every tensor the kernels read or write (the outputs and gradients in their layouts) fits their int32 slice
    offsets."""
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


def _tensor_key(tensor: Any) -> tuple | None:
    if tensor is None:
        return None
    return (tensor.shape, tensor.stride(), tensor.dtype, tensor.device, tensor.data_ptr() % 16, tensor.requires_grad)


def qkv_key(query, key, value) -> tuple:
    """What a plan depends on of query, key and value: shapes, strides, dtypes, devices, 16-byte alignment."""
    return (query.shape, query.stride(), query.dtype, query.device, query.data_ptr() % 16,
            key.shape, key.stride(), key.dtype, key.device, key.data_ptr() % 16,
            value.shape, value.stride(), value.dtype, value.device, value.data_ptr() % 16)


def options_key(dropout_p, is_causal, scale, enable_gqa, window_size, causal_alignment, max_seqlen_q, max_seqlen_k,
                config, strict) -> tuple:
    """What a plan depends on of the scalar options (each with its type: True and 1 are different calls)."""
    return (type(dropout_p), dropout_p, type(is_causal), is_causal, type(scale), scale, type(enable_gqa), enable_gqa,
            window_size, causal_alignment, max_seqlen_q, max_seqlen_k, config, strict)


def alignment_key(query, key, value) -> tuple[int, int, int]:
    """The 16-byte alignment of query's, key's and value's data, which the kernels are specialised on."""
    return query.data_ptr() % 16, key.data_ptr() % 16, value.data_ptr() % 16


def plan_key(query, key, value, call: Call, config: AttentionConfig | None, strict: bool | None) -> tuple:
    """Everything about a call that its plan depends on (TypeError/AttributeError for odd arguments): query, key
    and value, the options, and each optional tensor's layout (never its values)."""
    return (*qkv_key(query, key, value),
            *options_key(call.dropout_p, call.is_causal, call.scale, call.enable_gqa, tuple(call.window_size),
                         call.causal_alignment, call.max_seqlen_q, call.max_seqlen_k, config, strict),
            *(_tensor_key(getattr(call, name)) for name in OPTIONAL_TENSORS))
