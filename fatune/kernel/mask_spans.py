"""Which keys each query row sees under an attn_mask tensor, and which queries see each key.

A window or a causal mask tells the kernels by formula which tiles hold no visible score; a mask
tensor does not. So a call's mask is first summarised as spans, SPAN int32 per index: per query row,
over the keys it sees (KEY_SPANS: the forward and dQ kernels stream keys past a query tile); per key,
over the query rows that see it (QUERY_SPANS: the dK/dV kernel streams queries past a key tile).
The mask is read in grains of GRAIN indices along the scan (the kernels' tiles are whole grains): [first, end)
bounds the grains holding everything the index sees; [full_first, full_end) is a run of grains it sees in full,
the one that ends at its last grain that sees something, or just before it (boolean masks only; a grain past
the sequence's end counts its columns inside it only). Both end at the length at most. An index that sees
nothing gets [NO_SPAN, 0) for both. A tile loop runs over the union of its rows' [first, end) only: every
tile it skips holds masked scores alone (weight exp(-inf) = 0), so the results are the dense loop's; tiles
inside every row's full run skip the boolean mask's load too, as Flex's full blocks skip its mask_mod. A
prefix-LM or document mask given as a tensor so runs what is_causal or cu_seqlens would.

A Triton kernel makes them in one pass over the mask per direction (spans_kernel; where a mask has few
rows to summarise, each row's scan is cut into pieces that run in parallel and are then joined), on the mask's
device, in every call that runs kernels (the forward's key spans, which its backward takes over; the
backward's query spans): a mask's memory can change without torch knowing (a compiled graph reuses a
dead mask's buffer for the next one, numpy or another kernel writes it, a CUDA graph replays), so spans
made for one call are never trusted in another. What a scan launches is worked out once per mask layout
(_Scan), and its launches then go straight to Triton's C launcher (fatune.kernel.direct_launch), as the attention
kernels' do: a masked call's host cost is the attention kernels' plus a few allocations and launches.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import weakref
from typing import Sequence

import torch
import triton
import triton.language as tl

from fatune.hardware import sm_count
from fatune.kernel.direct_launch import CachedJit
from fatune.kernel.interpreter import patch_interpreter
from fatune.settings import interpreting

NO_SPAN = 1 << 30  # an empty span's first index: past any sequence (kernel indices are int32), and its end is 0


def compact(mask: torch.Tensor) -> torch.Tensor:
    """A call's attn_mask as 4 dims (leading ones added), each stride-0 dim narrowed to size 1: its distinct
    elements, which broadcast to the call's (B, H, L_q, L_k)."""
    if mask.dim() < 4:
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    strides = mask.stride()
    if 0 not in strides:
        return mask
    sizes = tuple(1 if stride == 0 else size for size, stride in zip(mask.shape, strides))
    return mask.as_strided(sizes, strides)


SPAN = 4  # int32 per index: first, end (any visible), full_first, full_end (all visible)
GRAIN = 16  # indices per grain: the kernels' tiles are 16 or more, powers of two
# (BLOCK_R, BLOCK_C, num_warps) of a scan: along columns nearer in memory than rows (a query row's key spans of a
# mask in its usual layout), a tile's columns are reduced; else (COLUMNWISE) BLOCK_C is GRAIN, folded elementwise
TILES = {"rows": (8, 512, 4), "columns": (512, GRAIN, 4)}


def layout(shape: tuple[int, ...], strides: tuple[int, ...], row_dim: int) -> tuple[int, int, int]:
    """Element strides (b, h, l) by which the kernels index the spans of a (B, H, L_q, L_k) mask view of these
    strides along `row_dim` (2: a span per query row; 3: per key): a broadcast dim gets stride 0."""
    sizes = [1 if stride == 0 else size for size, stride in zip(shape, strides)]
    kept = (sizes[0], sizes[1], sizes[row_dim])
    inner = [kept[1] * kept[2] * SPAN, kept[2] * SPAN, SPAN]
    return tuple(stride if size > 1 else 0 for size, stride in zip(kept, inner))


def spans_kernel(SRC, OUT, n_rows, n_cols, length, heads, piece, stride_sb, stride_sh, stride_sr, stride_sc, stride_ob,
                 stride_oh, stride_or, stride_op, ADDITIVE: tl.constexpr, FULL: tl.constexpr, JOIN: tl.constexpr,
                 PARTIAL: tl.constexpr, NONE: tl.constexpr, GRAIN: tl.constexpr, COLUMNWISE: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Spans of BLOCK_R rows of one (batch, head) of a mask, scanning its `length` columns left to right in grains
    of GRAIN: [first, end) of the grains with a visible column, and (FULL) [full_first, full_end), the run of grains
    without a hidden column that ends at the last grain with a visible one (or just before it, where that grain
    also hides one). A row of the mask is a query row (key spans) or, through swapped strides, a key (query spans).
    Visible: nonzero bytes, or (ADDITIVE) entries other than -inf.

    The scan's state, in grains, (first visible, last visible, last hidden before it, last hidden), summarises any
    run of columns, and two runs' states join as a tile joins the state before it. The last visible grain is kept
    as 2 * grain + (1 if it hides nothing): the larger grain wins a join, and its fullness comes with it. PARTIAL:
    the program scans the `piece` columns of piece program_id(2) and writes its state; JOIN: SRC holds those
    states, n_cols of them per row (BLOCK_C = 1), and the program joins them in column order. COLUMNWISE (rows
    nearer in memory than columns: a key's query spans): a grain's GRAIN columns are loaded one by one as vectors
    along the rows and folded elementwise (BLOCK_C = GRAIN), where a tile's reduction along its columns would
    cross threads."""
    b = (tl.program_id(0) // heads).to(tl.int64)
    h = (tl.program_id(0) % heads).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    row_base = SRC + b * stride_sb + h * stride_sh + rows.to(tl.int64) * stride_sr
    first = tl.full([BLOCK_R], NONE, tl.int32)
    last_seen = tl.full([BLOCK_R], -1, tl.int32)  # the last visible grain so far (2 * grain + full)
    last_hidden = tl.full([BLOCK_R], -1, tl.int32)  # the last hiding grain before last_seen's
    max_hidden = tl.full([BLOCK_R], -1, tl.int32)  # the last hiding grain so far
    begin = tl.program_id(2) * piece
    for start in range(begin, tl.minimum(begin + piece, n_cols), BLOCK_C):
        if JOIN:  # one piece's state
            state = row_base + start * stride_sc
            run_first = tl.load(state, mask=row_ok, other=NONE)
            run_last = tl.load(state + 1, mask=row_ok, other=-1)
            if FULL:
                run_before = tl.load(state + 2, mask=row_ok, other=-1)
                run_hidden = tl.load(state + 3, mask=row_ok, other=-1)
        elif COLUMNWISE:  # one grain's columns, one at a time
            seen = tl.zeros([BLOCK_R], tl.int1)
            hidden = tl.zeros([BLOCK_R], tl.int1)
            for column in tl.static_range(GRAIN):
                inside = row_ok & (start + column < n_cols)
                offset = (tl.zeros([BLOCK_R], tl.int64) + start + column) * stride_sc  # 64-bit: a column of a long mask
                entry = tl.load(row_base + offset, mask=inside, other=0)
                if ADDITIVE:
                    seen = seen | (inside & (entry != float("-inf")))
                    hidden = hidden | (inside & (entry == float("-inf")))
                else:
                    seen = seen | (inside & (entry != 0))
                    hidden = hidden | (inside & (entry == 0))
            grain = start // GRAIN
            run_first = tl.where(seen, grain, NONE)
            run_last = tl.where(seen, 2 * grain + tl.where(hidden, 0, 1), -1)
            if FULL:  # a grain has no hidden grain before its own
                run_before = tl.full([BLOCK_R], -1, tl.int32)
                run_hidden = tl.where(hidden, grain, -1)
        else:  # one tile's columns
            cols = start + tl.arange(0, BLOCK_C)
            inside = row_ok[:, None] & (cols[None, :] < n_cols)
            entry = tl.load(row_base[:, None] + cols.to(tl.int64)[None, :] * stride_sc, mask=inside, other=0)
            if ADDITIVE:
                seen = inside & (entry != float("-inf"))
                hidden = inside & (entry == float("-inf"))
            else:
                seen = inside & (entry != 0)
                hidden = inside & (entry == 0)
            if GRAIN > 1:  # per grain: any visible column, any hidden one
                seen = tl.max(tl.reshape(seen.to(tl.int32), [BLOCK_R, BLOCK_C // GRAIN, GRAIN]), 2) > 0
                hidden = tl.max(tl.reshape(hidden.to(tl.int32), [BLOCK_R, BLOCK_C // GRAIN, GRAIN]), 2) > 0
            grain = start // GRAIN + tl.arange(0, BLOCK_C // GRAIN)
            index = grain[None, :] + tl.zeros([BLOCK_R, BLOCK_C // GRAIN], tl.int32)
            run_first = tl.min(tl.where(seen, index, NONE), 1)
            run_last = tl.max(tl.where(seen, 2 * index + tl.where(hidden, 0, 1), -1), 1)
            if FULL:  # the full run's state: an additive mask has none
                run_before = tl.max(tl.where(hidden & (index < (run_last >> 1)[:, None]), index, -1), 1)
                run_hidden = tl.max(tl.where(hidden, index, -1), 1)
        first = tl.minimum(first, run_first)
        if FULL:
            last_hidden = tl.where(run_last >= 0, tl.maximum(max_hidden, run_before), last_hidden)
            max_hidden = tl.maximum(max_hidden, run_hidden)
        last_seen = tl.maximum(last_seen, run_last)
    out = OUT + b * stride_ob + h * stride_oh + rows * stride_or
    if PARTIAL:
        out = out + tl.program_id(2) * stride_op
        tl.store(out, first, mask=row_ok)
        tl.store(out + 1, last_seen, mask=row_ok)
        tl.store(out + 2, last_hidden, mask=row_ok)
        tl.store(out + 3, max_hidden, mask=row_ok)
    else:  # grains to indices
        any_seen = last_seen >= 0
        end = tl.minimum(((last_seen >> 1) + 1) * GRAIN, length)
        tl.store(out, tl.where(any_seen, tl.where(any_seen, first, 0) * GRAIN, NONE), mask=row_ok)
        tl.store(out + 1, tl.where(any_seen, end, 0), mask=row_ok)
        if FULL:
            full_end = tl.minimum(((last_seen >> 1) + (last_seen & 1)) * GRAIN, length)
            tl.store(out + 2, tl.where(any_seen, (last_hidden + 1) * GRAIN, NONE), mask=row_ok)
            tl.store(out + 3, tl.where(any_seen, full_end, 0), mask=row_ok)
        else:
            tl.store(out + 2, tl.full([BLOCK_R], NONE, tl.int32), mask=row_ok)
            tl.store(out + 3, tl.zeros([BLOCK_R], tl.int32), mask=row_ok)


@functools.cache
def _jitted(interpret: bool) -> triton.JITFunction:
    """spans_kernel as Triton compiles it, or interprets it: Triton reads TRITON_INTERPRET when a function is jitted,
    and the generated attention kernels are loaded when first called (fatune.kernel.triton.codegen), so this one is too."""
    return triton.jit(spans_kernel)


@functools.cache
def _direct() -> CachedJit:
    return CachedJit(_jitted(False))


PROGRAMS_PER_SM = 8  # a scan's programs per multiprocessor: each waits on its loads, so many hide each other's
MIN_PIECE_TILES = 4  # column tiles per piece at least: a piece's state costs a write and a read back
JOIN_ROWS = 128  # rows per program where the pieces' states are joined


def _cdiv(a: int, b: int) -> int:
    """ceil(a / b) of ints (triton.cdiv is a constexpr function: ~2 us a call on the host, 9 calls a masked step)."""
    return -(-a // b)


def scan_pieces(programs: int, length: int, block_c: int, sms: int) -> int:
    """Pieces to cut each row's scan of `length` columns into, so that `programs` row blocks give `sms`
    multiprocessors PROGRAMS_PER_SM programs each where the columns allow (a mask broadcast over heads, or one
    long sequence, has few row blocks: its query spans would otherwise be a few programs' long serial scans)."""
    wanted = -(-PROGRAMS_PER_SM * sms // programs)
    return max(1, min(wanted, length // (MIN_PIECE_TILES * block_c)))


class _Scan:
    """What spans() launches for one mask layout (dtype, shape, strides, device), the scanned dim, the length
    and the pieces, worked out once: the outputs' shapes and each launch's grid and scalar arguments."""

    __slots__ = ("device", "out_shape", "target_shape", "scan", "join")

    def __init__(self, mask: torch.Tensor, row_dim: int, length: int, pieces: int | None):
        if pieces is not None and pieces < 1:
            raise ValueError(f"pieces: expected a positive count or None (chosen by scan_pieces), got {pieces!r}")
        additive = mask.dtype != torch.uint8
        col_dim = 5 - row_dim
        batch, heads, rows = mask.shape[0], mask.shape[1], mask.shape[row_dim]
        self.device = mask.device
        self.out_shape = (batch, heads, rows, SPAN)
        stride_c = mask.stride(col_dim) if mask.shape[col_dim] > 1 else 0
        columnwise = abs(stride_c) > abs(mask.stride(row_dim)) if rows > 1 else False
        block_r, block_c, warps = TILES["columns" if columnwise else "rows"]
        block_c = GRAIN if columnwise else block_c
        row_blocks = _cdiv(rows, block_r)
        if pieces is None:
            pieces = scan_pieces(batch * heads * row_blocks, length, block_c, sm_count(mask.device))
        piece = _cdiv(_cdiv(length, pieces), block_c) * block_c
        pieces = _cdiv(length, piece) if length else 1
        partial = pieces > 1
        self.target_shape = (batch, heads, rows, pieces, SPAN) if partial else None
        # a whole scan writes the spans themselves: no piece stride
        target_strides = _strides(self.target_shape) if partial else _strides(self.out_shape)[:3] + (0,)
        # (batch, head) pairs on the grid's first axis, of 2^31 programs
        self.scan = ((batch * heads, row_blocks, pieces), warps, (
            rows, length, length, heads, piece, mask.stride(0), mask.stride(1), mask.stride(row_dim), stride_c,
            *target_strides[:4], additive, not additive, False, partial, NO_SPAN, GRAIN, columnwise, block_r, block_c))
        self.join = None
        if partial:  # the pieces' states joined, row by row
            self.join = ((batch * heads, _cdiv(rows, JOIN_ROWS), 1), 4, (
                rows, pieces, length, heads, pieces, *target_strides[:4], *_strides(self.out_shape)[:3], 0,
                False, not additive, True, False, NO_SPAN, GRAIN, False, JOIN_ROWS, 1))

    def __call__(self, mask: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.out_shape, dtype=torch.int32, device=self.device)
        if out.numel() == 0:
            return out
        target = out if self.join is None else torch.empty(self.target_shape, dtype=torch.int32, device=self.device)
        _launch(self.scan, (mask, target))
        if self.join is not None:
            _launch(self.join, (target, out))
        return out


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides torch.empty gives `shape` (the spans' buffers are allocated so in each call)."""
    return torch.empty(shape, device="meta").stride()


def _launch(launch: tuple, pointers: tuple[torch.Tensor, torch.Tensor]) -> None:
    """One scan launch (grid, warps, spans_kernel's arguments after its two pointers) on the mask's device:
    directly once compiled for these arguments (fatune.kernel.direct_launch), as the attention kernels launch."""
    grid, warps, tail = launch
    if interpreting():
        patch_interpreter()  # launches from several threads one at a time (and the kernels' other gaps)
        _jitted(True)[grid](*pointers, *tail, num_warps=warps)
        return
    device = pointers[0].device
    if device.index == torch.cuda.current_device():
        _direct()(grid, pointers, tail, device, warps)
        return
    with torch.cuda.device(device):
        _direct()(grid, pointers, tail, device, warps)


_scans: dict[tuple, _Scan] = {}
MAX_SCANS = 256  # kept scan plans: a process summarising ever new mask layouts starts afresh past it


def spans(mask: torch.Tensor, row_dim: int, length: int, pieces: int | None = None) -> torch.Tensor:
    """int32 (B', H', rows, SPAN) spans of a compacted 4-d mask (compact()) per index of `row_dim` (2: query rows,
    scanning keys; 3: keys, scanning query rows), `length` the scanned dim's size in the call (a broadcast one is
    read at stride 0). Full runs for boolean masks only: an additive mask is added on every tile. `pieces`: how
    many programs share a row block's scan (scan_pieces chooses by default)."""
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)  # any nonzero byte keeps, not only 1 (a uint8 tensor viewed as bool)
    key = (mask.device, mask.dtype, mask.shape, mask.stride(), row_dim, length, pieces)
    scan = _scans.get(key)
    if scan is None:
        if len(_scans) >= MAX_SCANS:
            _scans.clear()
        scan = _scans[key] = _Scan(mask, row_dim, length, pieces)
    return scan(mask)


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """A prepared mask's spans, valid while the tensor lives unchanged (its version counter) at these lengths."""

    mask: weakref.ref
    version: int
    layout: tuple  # data_ptr, shape, strides: `.data = other` swaps them without a version bump
    lengths: tuple[int, int]  # the calls' (L_q, L_k): the scans' lengths along broadcast dims
    key_spans: torch.Tensor
    query_spans: torch.Tensor

    def serves(self, mask: torch.Tensor, shape: Sequence[int]) -> bool:
        """Whether these spans are `mask`'s in a call of `shape`: the same tensor, unchanged as far as torch can
        tell, at the same lengths, and not inside a CUDA graph's capture (a replay would not see later changes)."""
        return (self.mask() is mask and self.version == mask._version and self.lengths == (shape[2], shape[3])
                and self.layout == _layout(mask) and not (mask.is_cuda and torch.cuda.is_current_stream_capturing()))


def _layout(mask: torch.Tensor) -> tuple:
    return mask.data_ptr(), mask.shape, mask.stride()


_prepared: dict[int, _Prepared] = {}  # by id() of the prepared tensor; dropped when it dies
MASK_DTYPES = (torch.bool, torch.float16, torch.bfloat16, torch.float32)


def prepare_mask(attn_mask: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """`attn_mask` for every call of `shape` (B, H, L_q, L_k) that shares it, summarised once: a copy whose spans are
    made now, which fatune.attention then takes instead of scanning the mask in each call (forward and backward).

    As FlexAttention's block mask is made once per batch for every layer, so is this: per layer and step it saves
    two passes over the mask (at L = 8192 about 0.2 ms on an H200). The copy holds the mask's distinct elements only
    (a mask broadcast over batch or heads stays so), in `attn_mask`'s dim order where its distinct elements are
    dense. Treat it as read-only: an in-place torch op on it is noticed (its spans are made again, per call), writes
    torch does not count (through `.data`, another kernel, a collective, a pointer) are not. Its spans are made on
    the current stream: calls on another one must be ordered after it, as for the mask itself. Calls of other
    lengths, and calls inside a CUDA graph's capture (whose replays must see later changes), scan it as any mask;
    so does every call where it was prepared during a capture, inside a function torch.compile traces, or on the
    CPU without Triton's interpreter."""
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask: expected a bool or float tensor, got {type(attn_mask).__name__}")
    if attn_mask.dtype not in MASK_DTYPES:
        raise TypeError(f"attn_mask: expected dtype bool, float16, bfloat16 or float32, got {attn_mask.dtype}")
    if attn_mask.requires_grad:
        raise ValueError("attn_mask: gradients w.r.t. an additive mask are not computed; pass attn_mask.detach()")
    try:
        shape = tuple(operator.index(size) for size in shape if not isinstance(size, bool))
    except TypeError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        raise ValueError(f"shape: expected the calls' (B, H, L_q, L_k) as 4 positive ints, got {shape!r}")
    try:
        broadcast = torch.broadcast_shapes(tuple(attn_mask.shape), shape)
    except RuntimeError:
        broadcast = None
    if attn_mask.dim() > 4 or broadcast != shape:
        raise ValueError(f"attn_mask: expected a mask broadcastable to shape {shape} (B, H, L_q, L_k), "
                         f"got {tuple(attn_mask.shape)}")
    if torch.compiler.is_compiling():  # traced: the copy alone (compiled calls summarise their mask in the op)
        return compact(attn_mask).clone().expand((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)).view(
            attn_mask.shape)
    with torch.inference_mode(False):  # a normal tensor, whose in-place changes its version counter records
        distinct = compact(attn_mask).clone()
        own = distinct.expand((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)).view(attn_mask.shape)
    interpreted = interpreting()
    if (own.is_cuda and not torch.cuda.is_current_stream_capturing()) or (interpreted and own.device.type == "cpu"):
        key_spans, query_spans = mask_spans(own, shape)
        key = id(own)
        _prepared[key] = _Prepared(weakref.ref(own, lambda _: _prepared.pop(key, None)), own._version, _layout(own),
                                   (shape[2], shape[3]), key_spans, query_spans)
    return own


def is_prepared(key_spans: torch.Tensor) -> bool:
    """Whether `key_spans` are a prepared mask's (shared by its calls: a torch op must not return them as its own)."""
    return any(prepared.key_spans is key_spans for prepared in _prepared.values())


def mask_spans(mask: torch.Tensor, shape: tuple[int, int, int, int], want_queries: bool = True,
               key_spans: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(KEY_SPANS, QUERY_SPANS) of a call's attn_mask (bool or additive, broadcastable to `shape`, the call's
    (B, H, L_q, L_k)); QUERY_SPANS None unless `want_queries`. Each is contiguous (B', H', L', SPAN), B', H',
    L' the mask's own sizes (1 where it broadcasts). `key_spans`: made earlier in the same call (the forward's,
    for its backward), taken as they are. A mask from prepare_mask, unchanged, at its lengths: its spans."""
    if _prepared:
        prepared = _prepared.get(id(mask))
        if prepared is not None and prepared.serves(mask, shape):
            return prepared.key_spans, prepared.query_spans if want_queries else None
    distinct = compact(mask)
    if key_spans is None:
        key_spans = spans(distinct, 2, shape[3])
    query_spans = spans(distinct, 3, shape[2]) if want_queries else None
    return key_spans, query_spans
