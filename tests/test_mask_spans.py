"""fatune.kernel.mask_spans: the spans of a mask tensor, and the tiles the kernels skip with them.

The spans are checked against a brute-force scan; the kernels, with masks whose fully-masked tiles
are many (prefix LM, documents, sinks and windows, padding), against the float64 golden under the
accuracy rule; that skipped tiles are never read, by NaN in the keys and values no query sees;
and the per-plan reuse of spans, by writing into a mask between calls.
"""

from __future__ import annotations

import re

import pytest
import torch
import triton
import triton.language as tl

import fatune
import fatune.kernel.mask_spans
from fatune.kernel.mask_spans import (
    GRAIN,
    NO_SPAN,
    PROGRAMS_PER_SM,
    SPAN,
    compact,
    layout,
    mask_spans,
    scan_pieces,
    spans,
)
from fatune.kernel.triton import launch
from fatune.kernel.triton.heuristics import INTERPRETER_CONFIG
from tests.conftest import DEVICE, HAS_GPU
from tests.reference import random_qkv, run_and_compare, stable_seed

F16 = torch.float16


def _scan(keep: torch.Tensor, full: bool, grain: int) -> list[int]:
    """[first, end, full_first, full_end] of one index's visible entries `keep` (1-d bool) in grains of `grain`:
    the grains that see something, and the run of grains that see all, ending at the last grain that sees
    something if that one sees all, else just before it."""
    length = keep.numel()
    grains = [keep[start:start + grain] for start in range(0, length, grain)]
    seen = [index for index, part in enumerate(grains) if part.any()]
    if not seen:
        return [NO_SPAN, 0, NO_SPAN, 0]
    last = seen[-1]
    spans = [seen[0] * grain, min((last + 1) * grain, length)]
    if not full:
        return spans + [NO_SPAN, 0]
    hiding = [index for index, part in enumerate(grains) if not part.all()]
    before = max((index for index in hiding if index < last), default=-1)
    return spans + [(before + 1) * grain, min((last + (last not in hiding)) * grain, length)]


def brute_spans(keep: torch.Tensor, full: bool, grain: int = GRAIN) -> tuple[torch.Tensor, torch.Tensor]:
    """Spans per query row and per key of a (B, H, L_q, L_k) bool tensor, by scanning."""
    b, h, lq, lk = keep.shape
    rows = torch.empty(b, h, lq, SPAN, dtype=torch.int64)
    cols = torch.empty(b, h, lk, SPAN, dtype=torch.int64)
    for index in range(b * h):
        i, j = divmod(index, h)
        for row in range(lq):
            rows[i, j, row] = torch.tensor(_scan(keep[i, j, row], full, grain))
        for col in range(lk):
            cols[i, j, col] = torch.tensor(_scan(keep[i, j, :, col], full, grain))
    return rows, cols


def assert_spans_bound(spans: torch.Tensor, keep: torch.Tensor, full: bool) -> None:
    """What the kernels rely on, checked apart from any scan: (B, H, n, SPAN) spans of `keep` (B, H, n, length)
    hold every visible entry in [first, end), and only visible ones in [full_first, full_end); both start on a grain
    and end on one or at the length."""
    length = keep.shape[-1]
    index = torch.arange(length)
    first, end, full_first, full_end = (spans[..., i, None] for i in range(SPAN))
    assert not (keep & ((index < first) | (index >= end))).any()
    assert (keep.any(-1) == (end[..., 0] > 0)).all()
    assert ((first % GRAIN == 0) | (first == NO_SPAN)).all() and ((end % GRAIN == 0) | (end == length)).all()
    if full:
        assert keep[((index >= full_first) & (index < full_end)).expand(keep.shape)].all()
        assert ((full_first % GRAIN == 0) | (full_first == NO_SPAN)).all()
        assert ((full_end % GRAIN == 0) | (full_end == length)).all()


def as_seen_by_kernels(spans: torch.Tensor, strides: tuple[int, int, int], b: int, h: int, n: int) -> torch.Tensor:
    """(b, h, n, SPAN): the span each (batch, head, index) reads through the kernel's strides."""
    flat = spans.flatten()
    out = torch.empty(b, h, n, SPAN, dtype=torch.int64)
    for i in range(b):
        for j in range(h):
            for index in range(n):
                base = i * strides[0] + j * strides[1] + index * strides[2]
                out[i, j, index] = flat[base:base + SPAN]
    return out


PROBLEM = (2, 3, 37, 45)  # B, H, L_q, L_k: grains of 16 and a ragged one each way
# mask shapes that broadcast to PROBLEM: every dim alone, and as users pass them
SPAN_SHAPES = [(2, 3, 37, 45), (2, 1, 1, 45), (37, 45), (1, 3, 37, 45), (2, 1, 37, 1), (45,), (2, 3, 1, 45),
               (1, 1, 1, 1)]


@pytest.mark.parametrize("grain", [GRAIN, 1])
@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("shape", SPAN_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_spans_match_a_scan_through_the_kernels_strides(shape, kind, grain, monkeypatch):
    """Grains of GRAIN (as the kernels read spans) and of one index (exact spans: the same scan, finest)."""
    monkeypatch.setattr(fatune.kernel.mask_spans, "GRAIN", grain)
    monkeypatch.setattr(fatune.kernel.mask_spans, "_scans", {})  # scan plans made under another grain
    generator = torch.Generator().manual_seed(stable_seed(shape, kind))
    # runs of visible entries over hidden gaps: grains that see all, some, and nothing
    keep = torch.rand(shape, generator=generator) < 0.6
    keep |= torch.rand(shape[:-1] + (1,), generator=generator) < 0.4
    keep.view(-1)[:3] = False  # some rows and keys see nothing
    if kind == "bool":
        mask = keep
    else:  # -inf where masked; NaN is kept (it reaches the result), finite values too
        mask = torch.randn(shape, generator=generator).masked_fill(~keep, float("-inf"))
        mask.view(-1)[-1] = float("nan")
        keep = keep.clone()
        keep.view(-1)[-1] = True
    key_spans, query_spans = mask_spans(mask, PROBLEM)
    def four_dims(t):
        return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)).expand(PROBLEM)

    view = four_dims(mask)  # the call's broadcast view, whose strides the kernels get
    expected_rows, expected_cols = brute_spans(four_dims(keep), full=kind == "bool", grain=grain)
    b, h, lq, lk = PROBLEM
    rows = as_seen_by_kernels(key_spans, layout(view.shape, view.stride(), 2), b, h, lq)
    cols = as_seen_by_kernels(query_spans, layout(view.shape, view.stride(), 3), b, h, lk)
    assert torch.equal(rows, expected_rows) and torch.equal(cols, expected_cols)
    if grain == GRAIN:
        assert_spans_bound(rows, four_dims(keep), full=kind == "bool")
        assert_spans_bound(cols, four_dims(keep).transpose(2, 3), full=kind == "bool")


def _runs_mask(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """Visible runs of random lengths with hidden gaps, rows that see nothing, and one row that sees everything:
    the runs and gaps cross any piece border."""
    keep = torch.zeros(rows, cols, dtype=torch.bool)
    for row in range(rows):
        col = int(torch.randint(0, cols, (1,), generator=generator))
        while col < cols:
            run = int(torch.randint(1, 200, (1,), generator=generator))
            keep[row, col:col + run] = True
            col += run + int(torch.randint(1, 150, (1,), generator=generator))
    keep[3] = False
    keep[-1] = True
    return keep


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("pieces", [2, 3, 7])
def test_spans_scanned_in_pieces_match_one_scan(pieces, kind, monkeypatch):
    """A row's scan cut into pieces (a mask with few rows to summarise on a large GPU) gives the spans of one scan:
    the join takes the last visible index from the last piece that sees one, and the last hidden one before it from
    that piece or any earlier one."""
    monkeypatch.setitem(fatune.kernel.mask_spans.TILES, "rows", (16, 64, 4))  # as many pieces as asked, along 900 keys
    monkeypatch.setattr(fatune.kernel.mask_spans, "_scans", {})  # scan plans made under these tiles stay here
    generator = torch.Generator().manual_seed(stable_seed(pieces, kind))
    keep = _runs_mask(70, 900, generator)
    mask = keep if kind == "bool" else torch.randn(keep.shape, generator=generator).masked_fill(~keep, float("-inf"))
    distinct = mask[None, None]
    expected_rows, expected_cols = brute_spans(keep[None, None], full=kind == "bool")
    for row_dim, length, expected in ((2, keep.shape[1], expected_rows), (3, keep.shape[0], expected_cols)):
        assert torch.equal(spans(distinct, row_dim, length, pieces=1).long(), expected)
        assert torch.equal(spans(distinct, row_dim, length, pieces=pieces).long(), expected)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_a_mask_in_either_memory_order_gets_the_same_spans(kind):
    """A mask whose keys lie far apart (a transposed view) is scanned the other way round in each direction
    (a tile's reduction along its rows, grains folded elementwise along its columns): the spans are the same."""
    generator = torch.Generator().manual_seed(stable_seed("order", kind))
    keep = _runs_mask(70, 300, generator)
    mask = keep if kind == "bool" else torch.randn(keep.shape, generator=generator).masked_fill(~keep, float("-inf"))
    transposed = mask.t().contiguous().t()[None, None]
    assert transposed.stride()[2:] == (1, 70)
    for row_dim, length in ((2, 300), (3, 70)):
        assert torch.equal(spans(transposed, row_dim, length), spans(mask[None, None], row_dim, length))
        assert torch.equal(spans(transposed, row_dim, length, pieces=3), spans(mask[None, None], row_dim, length))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_backward_takes_the_forwards_key_spans(compiled, monkeypatch):
    """A training step scans the mask once per direction: the backward reuses the key spans its forward made
    and scans only for the query spans (eagerly and through the custom ops torch.compile traces), and its
    gradients are the ones of a backward that makes its own."""
    scans = []
    real = fatune.kernel.mask_spans.spans
    monkeypatch.setattr(fatune.kernel.mask_spans, "spans", lambda mask, row_dim, *rest, **kw: (
        scans.append(row_dim), real(mask, row_dim, *rest, **kw))[1])
    keep = prefix_lm(2, 40, 40, [9, 20])
    q, k, v = (t.requires_grad_() for t in _qkv(lq=40, lk=40))
    grad_out = torch.randn_like(q)
    step = torch.compile(fatune.attention, fullgraph=True, backend="aot_eager") if compiled else fatune.attention
    step(q, k, v, attn_mask=keep).backward(grad_out)
    assert sorted(scans) == [2, 3]
    reused = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    made_again = launch.mask_spans
    monkeypatch.setattr(launch, "mask_spans", lambda mask, shape, want_queries=True, key_spans=None:
                        made_again(mask, shape, want_queries))  # every scan made where it is used
    scans.clear()
    fatune.attention(q, k, v, attn_mask=keep).backward(grad_out)
    assert sorted(scans) == [2, 2, 3]
    assert all(torch.equal(a, t.grad) for a, t in zip(reused, (q, k, v)))


_BASE = torch.arange(2 * 3 * 5 * 7).reshape(2, 3, 5, 7) % 3 == 0


@pytest.mark.parametrize("mask, sizes", [
    (_BASE, (2, 3, 5, 7)),                                        # no broadcast: the tensor itself
    (_BASE[:, :1].expand(2, 3, 5, 7), (2, 1, 5, 7)),              # over heads
    (_BASE[:1, :, :1].expand(2, 3, 5, 7), (1, 3, 1, 7)),          # over batch and queries (key padding)
    (_BASE[0, 0], (1, 1, 5, 7)),                                  # 2-d
    (_BASE[1], (1, 3, 5, 7)),                                     # 3-d, a storage offset
    (_BASE[1, 2, :, 3:].expand(4, 2, 5, 4), (1, 1, 5, 4)),       # a sliced view broadcast over (B, H)
    (_BASE.transpose(2, 3), (2, 3, 7, 5)),                        # keys before queries in memory
    (_BASE[:, :, :0], (2, 3, 0, 7)),                              # empty
], ids=["plain", "heads", "batch-queries", "2d", "3d-offset", "sliced-view", "transposed", "empty"])
def test_compact_keeps_one_copy_of_each_distinct_element(mask, sizes):
    """compact(): 4 dims, each broadcast (stride-0) dim narrowed to 1, the same storage, the same values."""
    distinct = compact(mask)
    assert tuple(distinct.shape) == sizes
    assert 0 not in [stride for stride, size in zip(distinct.stride(), distinct.shape) if size > 1]
    if mask.numel():
        assert distinct.data_ptr() == mask.data_ptr()
    shape = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    assert torch.equal(distinct.expand(shape), mask.reshape(shape))


def test_a_piece_count_below_one_is_refused_by_name():
    with pytest.raises(ValueError, match="pieces: expected a positive count"):
        spans(torch.ones(1, 1, 4, 4, dtype=torch.bool), 2, 4, pieces=0)


def test_few_rows_to_summarise_are_scanned_in_pieces():
    """scan_pieces fills the GPU where the row blocks are few, never below MIN_PIECE_TILES column tiles a piece, and
    leaves a mask with many row blocks to one scan per row block."""
    assert scan_pieces(programs=128, length=8192, block_c=32, sms=132) == 9  # query spans of a (2, 1, 8192, 8192) mask
    assert scan_pieces(programs=4096, length=8192, block_c=128, sms=132) == 1
    assert scan_pieces(programs=1, length=300, block_c=128, sms=132) == 1  # shorter than MIN_PIECE_TILES tiles
    assert scan_pieces(programs=1, length=1 << 20, block_c=32, sms=132) == PROGRAMS_PER_SM * 132


def test_a_user_expanded_mask_is_summarised_once_per_distinct_row():
    """A (B, H, L_q, L_k) mask expanded by the user (stride 0 over heads and rows) costs one row's scan."""
    row = torch.rand(2, 1, 1, 45) < 0.5
    key_spans, query_spans = mask_spans(row.expand(PROBLEM), PROBLEM)
    assert key_spans.shape == (2, 1, 1, SPAN) and query_spans.shape == (2, 1, 45, SPAN)


# ------------------------------------------------------------------ the kernels with spans


def _qkv(b=2, h=2, hkv=2, lq=150, lk=150, d=32, dtype=F16, seed=0):
    torch.manual_seed(seed)
    return random_qkv(b, h, hkv, lq, lk, d, d, dtype=dtype, device=DEVICE)


def prefix_lm(b: int, lq: int, lk: int, prefixes: list[int]) -> torch.Tensor:
    """(B, 1, L_q, L_k): causal (bottom-right), plus the first prefixes[b] keys for every query."""
    rows = torch.arange(lq, device=DEVICE)[:, None] + (lk - lq)
    cols = torch.arange(lk, device=DEVICE)[None, :]
    prefix = torch.tensor(prefixes, device=DEVICE)[:, None, None, None]
    return (cols <= rows)[None, None] | (cols[None, None] < prefix)


def documents(lengths: list[int]) -> torch.Tensor:
    """(L, L) block-diagonal causal mask of documents of these lengths (a packed batch as a tensor)."""
    ids = torch.repeat_interleave(torch.arange(len(lengths), device=DEVICE), torch.tensor(lengths, device=DEVICE))
    pos = torch.arange(len(ids), device=DEVICE)
    return (ids[:, None] == ids[None, :]) & (pos[None, :] <= pos[:, None])


def sink_and_window(lq: int, lk: int, sinks: int, window: int) -> torch.Tensor:
    """(L_q, L_k): the first `sinks` keys plus a causal window (StreamingLLM's attention sinks)."""
    rows = torch.arange(lq, device=DEVICE)[:, None]
    cols = torch.arange(lk, device=DEVICE)[None, :]
    return (cols < sinks) | ((cols <= rows) & (cols > rows - window))


def per_head_bands(b: int, h: int, lq: int, lk: int) -> torch.Tensor:
    """(B, H, L_q, L_k): each (batch, head) sees its own band of keys; one head sees nothing past row 40."""
    rows = torch.arange(lq, device=DEVICE)[:, None]
    cols = torch.arange(lk, device=DEVICE)[None, :]
    out = torch.zeros(b, h, lq, lk, dtype=torch.bool, device=DEVICE)
    for i in range(b):
        for j in range(h):
            width = 9 + 23 * (i * h + j)
            out[i, j] = (cols <= rows + j) & (cols > rows - width)
    out[-1, -1, 40:] = False
    return out


MASKS = {
    "prefix-lm": lambda: prefix_lm(2, 150, 150, [37, 100]),
    "prefix-lm-lq-lt-lk": lambda: prefix_lm(2, 70, 150, [20, 64]),
    "documents": lambda: documents([40, 3, 75, 32]),
    "sink-window": lambda: sink_and_window(150, 150, 4, 33),
    "key-padding-tiles": lambda: (torch.arange(150, device=DEVICE) < torch.tensor([17, 96], device=DEVICE)[:, None])
    [:, None, None, :],
    "per-head-bands": lambda: per_head_bands(2, 2, 150, 150),
}


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("name", list(MASKS))
def test_masks_with_many_empty_tiles(name, kind, poison_outputs):
    keep = MASKS[name]()
    lq, lk = keep.shape[-2:]
    q, k, v = _qkv(lq=lq, lk=lk, seed=stable_seed(name, kind))
    mask = keep if kind == "bool" else torch.randn(keep.shape, device=DEVICE).masked_fill(~keep, float("-inf"))
    run_and_compare(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_a_call_whose_spans_are_scanned_in_pieces(kind, poison_outputs, monkeypatch):
    """A whole call (forward and backward) with both directions' scans cut into pieces and joined, as a large GPU cuts
    them for a mask with few rows to summarise (pieces of one column tile here, to keep the interpreter quick)."""
    monkeypatch.setattr(fatune.kernel.mask_spans, "MIN_PIECE_TILES", 1)
    monkeypatch.setattr(fatune.kernel.mask_spans, "_scans", {})  # scan plans made under another piece size
    monkeypatch.setitem(fatune.kernel.mask_spans.TILES, "rows", (16, 64, 4))  # tiles short enough to cut 300 keys
    keep = prefix_lm(1, 150, 300, [70])
    sms = fatune.hardware.sm_count(keep.device)
    rows, columns = fatune.kernel.mask_spans.TILES["rows"], fatune.kernel.mask_spans.TILES["columns"]
    assert fatune.kernel.mask_spans.scan_pieces(triton.cdiv(150, rows[0]), 300, rows[1], sms) > 1  # key spans: 300 keys
    assert fatune.kernel.mask_spans.scan_pieces(triton.cdiv(300, columns[0]), 150, GRAIN, sms) > 1  # query spans: 150 rows
    q, k, v = _qkv(lq=150, lk=300, seed=stable_seed("pieces", kind))
    mask = keep if kind == "bool" else torch.randn(keep.shape, device=DEVICE).masked_fill(~keep, float("-inf"))
    run_and_compare(q, k, v, attn_mask=mask)


def _structures():
    base = INTERPRETER_CONFIG
    return {
        "split-kv-pack": base.replace(fwd=fatune.LaunchConfig(16, 16, num_splits=3, pack_gqa=1)),
        "atomic-dq": base.replace(dkdv=fatune.LaunchConfig(16, 32, atomic_dq=1)),
        "concurrent-dq": base.replace(dq=fatune.LaunchConfig(32, 16, concurrent=1)),
        "split-d": base.replace(dkdv=fatune.LaunchConfig(16, 32, split_d=2)),
    }


@pytest.mark.parametrize("structure", list(_structures()))
def test_spans_under_each_kernel_structure(structure, poison_outputs):
    """GQA with a mask per query head: the forward's packed rows and dK/dV's head loop each take their head's
    spans; Delta (the prep pass of atomic and concurrent dQ) sums over the same key tiles as the dQ kernel."""
    d = 72 if structure == "split-d" else 32  # the split needs halves of 64 lanes (fatune.kernel.triton.structure.split_d_runs)
    q, k, v = random_qkv(2, 4, 2, 100, 130, d, d, dtype=F16, device=DEVICE)
    mask = per_head_bands(2, 4, 100, 130)
    run_and_compare(q, k, v, attn_mask=mask, enable_gqa=True, is_causal=True, causal_alignment="bottom_right",
                    config=_structures()[structure])


def test_tiles_no_query_sees_are_never_read():
    """NaN keys and values where no query looks: a dense loop would spread NaN (0 * NaN) to every row of a tile
    it reads; the spans keep them out of the output, and their gradients are exactly zero."""
    q, k, v = _qkv(lq=96, lk=160, seed=7)
    keep = torch.arange(160, device=DEVICE)[None, :] < torch.tensor([64, 96], device=DEVICE)[:, None]
    mask = keep[:, None, None, :].expand(2, 1, 96, 160)
    with torch.no_grad():
        k[0, :, 96:] = float("nan")  # key tiles past 96 (and past 64 in batch 0): no query sees them
        v[0, :, 96:] = float("nan")
        k[1, :, 128:] = float("nan")
        v[1, :, 128:] = float("nan")
    out = fatune.attention(q, k, v, attn_mask=mask, config=INTERPRETER_CONFIG)
    out.backward(torch.randn_like(out))
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()
    assert (k.grad[0, :, 64:] == 0).all() and (v.grad[1, :, 96:] == 0).all()
    clean = [t.detach().nan_to_num(0.0).requires_grad_() for t in (q, k, v)]
    expected = torch.nn.functional.scaled_dot_product_attention(*(t.float() for t in clean), attn_mask=mask)
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=0)


def test_a_mask_written_between_calls_gets_new_spans(poison_outputs):
    """Spans are made in every call: a mask buffer refilled between calls, in place through torch, behind torch's
    back (numpy, `.data`: no version bump, as a compiled graph reusing a dead mask's buffer) or between the
    forward and the backward, is read as it is now."""
    q, k, v = _qkv(lq=80, lk=80, seed=11)
    mask = prefix_lm(2, 80, 80, [10, 60])
    out = fatune.attention(q, k, v, attn_mask=mask, config=INTERPRETER_CONFIG)
    out.backward(torch.randn_like(out))
    mask.copy_(prefix_lm(2, 80, 80, [70, 3]))  # new contents, same tensor
    q.grad = k.grad = v.grad = None
    run_and_compare(q, k, v, attn_mask=mask, config=INTERPRETER_CONFIG)
    if DEVICE == "cpu":
        mask.numpy()[:] = ~prefix_lm(2, 80, 80, [0, 0]).numpy()  # the anti-causal half; torch's version unchanged
        q.grad = k.grad = v.grad = None
        run_and_compare(q, k, v, attn_mask=mask, config=INTERPRETER_CONFIG)


def test_a_bool_mask_of_other_bytes_than_0_and_1(poison_outputs):
    """A uint8 tensor viewed as bool keeps where its bytes are nonzero, whatever they are."""
    q, k, v = _qkv(lq=32, lk=64, seed=14)
    raw = torch.zeros(32, 64, dtype=torch.uint8, device=DEVICE)
    raw[:, :8] = 1
    raw[:, 40:48] = 2
    raw[5:9, 20] = 255
    run_and_compare(q, k, v, attn_mask=raw.view(torch.bool), config=INTERPRETER_CONFIG)


def test_a_mask_made_under_inference_mode():
    q, k, v = (t.detach() for t in _qkv(lq=40, lk=40, seed=15))
    with torch.inference_mode():
        mask = prefix_lm(2, 40, 40, [5, 30])
        out = fatune.attention(q, k, v, attn_mask=mask, config=INTERPRETER_CONFIG)
    expected = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    torch.testing.assert_close(out.double(), expected, atol=2e-3, rtol=0)


def test_spans_of_another_mask_are_not_reused(poison_outputs):
    q, k, v = _qkv(lq=64, lk=64, seed=12)
    first = prefix_lm(2, 64, 64, [0, 0])
    run_and_compare(q, k, v, attn_mask=first, config=INTERPRETER_CONFIG)
    q.grad = k.grad = v.grad = None
    run_and_compare(q, k, v, attn_mask=~first, config=INTERPRETER_CONFIG)  # the complement: other tiles


def test_plan_launches_take_the_span_pointers():
    """Only a masked spec's kernels take spans: an unmasked kernel's parameters (and source) are unchanged."""
    from fatune.kernel.triton import signature

    q, k, v = _qkv(lq=40, lk=40)
    masked = fatune.call.check_inputs(q, k, v, attn_mask=torch.ones(40, 40, dtype=torch.bool, device=DEVICE)).spec
    plain = fatune.call.check_inputs(q, k, v).spec
    assert "KEY_SPANS" in signature.pointers("attn_fwd", masked)
    assert "QUERY_SPANS" in signature.pointers("attn_bwd_dkdv", masked)
    assert signature.params("attn_fwd", plain) == signature.PARAMS["attn_fwd"]
    assert launch.SLOTS.index("KEY_SPANS") < launch.SLOTS.index("O_PART")


# ------------------------------------------------------------------ prepared masks (fatune.prepare_mask)


@pytest.fixture
def scans(monkeypatch) -> list[int]:
    """Each scan of a mask (fatune.kernel.mask_spans.spans), by the dim it summarises."""
    made: list[int] = []
    real = fatune.kernel.mask_spans.spans

    def counted(mask, row_dim, *rest, **kwargs):
        made.append(row_dim)
        return real(mask, row_dim, *rest, **kwargs)

    monkeypatch.setattr(fatune.kernel.mask_spans, "spans", counted)
    return made


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("name", ["prefix-lm", "sink-window", "key-padding-tiles", "per-head-bands"])
def test_a_prepared_mask_is_scanned_once_for_every_call(name, kind, scans, poison_outputs):
    """Forward and backward of several calls take the spans prepare_mask made, and stay exact."""
    q, k, v = _qkv(seed=21)
    keep = MASKS[name]()
    mask = keep if kind == "bool" else torch.randn(keep.shape, device=DEVICE).masked_fill(~keep, float("-inf"))
    prepared = fatune.prepare_mask(mask, (2, 2, 150, 150))
    assert scans == [2, 3] and torch.equal(prepared, mask) and prepared.stride() == mask.stride()
    for _ in range(2):
        q.grad = k.grad = v.grad = None
        run_and_compare(q, k, v, attn_mask=prepared, config=INTERPRETER_CONFIG)
    assert scans == [2, 3]


def test_a_prepared_mask_through_torch_compile(scans, poison_outputs):
    """The custom ops torch.compile traces take a prepared mask's spans too, and return the forward's as an output
    of their own (a copy: the prepared ones are shared by every call)."""
    q, k, v = (t.requires_grad_() for t in _qkv(lq=40, lk=40, seed=26))
    grad_out = torch.randn_like(q)
    prepared = fatune.prepare_mask(prefix_lm(2, 40, 40, [9, 20]), (2, 2, 40, 40))
    step = torch.compile(fatune.attention, fullgraph=True, backend="aot_eager")
    out = step(q, k, v, attn_mask=prepared)
    out.backward(grad_out)
    compiled = [out.detach()] + [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    out = fatune.attention(q, k, v, attn_mask=prepared.clone())
    out.backward(grad_out)
    assert all(torch.equal(a, b) for a, b in zip(compiled, [out.detach()] + [t.grad for t in (q, k, v)]))


def test_a_prepared_mask_changed_in_place_is_scanned_again(scans, poison_outputs):
    q, k, v = _qkv(lq=80, lk=80, seed=22)
    prepared = fatune.prepare_mask(prefix_lm(2, 80, 80, [10, 60]), (2, 2, 80, 80))
    prepared.copy_(prefix_lm(2, 80, 80, [70, 3]))  # other tiles are visible now
    run_and_compare(q, k, v, attn_mask=prepared, config=INTERPRETER_CONFIG)
    assert len(scans) > 2


def test_a_prepared_mask_given_other_data_is_scanned_again(scans, poison_outputs):
    """`.data = other` swaps a tensor's memory without a version bump: its pointer tells."""
    q, k, v = _qkv(lq=80, lk=80, seed=25)
    prepared = fatune.prepare_mask(prefix_lm(2, 80, 80, [10, 60]), (2, 2, 80, 80))
    prepared.data = prefix_lm(2, 80, 80, [70, 3])
    run_and_compare(q, k, v, attn_mask=prepared, config=INTERPRETER_CONFIG)
    assert len(scans) > 2


def test_a_prepared_mask_at_other_lengths_is_scanned_as_any_mask(scans, poison_outputs):
    """Spans along a broadcast dim depend on the call's length: a key-padding mask prepared for 40 queries,
    called with 72."""
    q, k, v = _qkv(lq=72, lk=96, seed=23)
    keep = (torch.arange(96, device=DEVICE) < torch.tensor([17, 90], device=DEVICE)[:, None])[:, None, None, :]
    prepared = fatune.prepare_mask(keep, (2, 2, 40, 96))
    run_and_compare(q, k, v, attn_mask=prepared, config=INTERPRETER_CONFIG)
    assert len(scans) > 2


def test_a_prepared_mask_keeps_its_distinct_elements_only_and_is_forgotten_with_it():
    import gc

    causal = torch.ones(64, 64, dtype=torch.bool, device=DEVICE).tril()
    prepared = fatune.prepare_mask(causal.expand(4, 8, 64, 64), (4, 8, 64, 64))
    assert prepared.untyped_storage().nbytes() == 64 * 64 and prepared.data_ptr() != causal.data_ptr()
    assert fatune.prepare_mask(causal.t(), (1, 1, 64, 64)).stride() == (1, 64)  # the mask's dim order
    assert len(fatune.kernel.mask_spans._prepared) == 1
    del prepared
    gc.collect()
    assert not fatune.kernel.mask_spans._prepared


def test_a_mask_prepared_under_inference_mode(scans):
    q, k, v = (t.detach() for t in _qkv(lq=40, lk=40, seed=24))
    with torch.inference_mode():
        prepared = fatune.prepare_mask(prefix_lm(2, 40, 40, [5, 30]), (2, 2, 40, 40))
        out = fatune.attention(q, k, v, attn_mask=prepared, config=INTERPRETER_CONFIG)
    expected = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                                attn_mask=prepared)
    torch.testing.assert_close(out.double(), expected, atol=2e-3, rtol=0)
    assert scans == [2, 3] and not prepared.is_inference()


@pytest.mark.parametrize("mask, shape, error", [
    ([[True]], (1, 1, 1, 1), "attn_mask: expected a bool or float tensor"),
    (torch.ones(4, 4, dtype=torch.int32), (1, 1, 4, 4), "attn_mask: expected dtype bool, float16"),
    (torch.ones(4, 4, dtype=torch.uint8), (1, 1, 4, 4), "attn_mask: expected dtype bool, float16"),
    (torch.ones(4, 4, dtype=torch.float64), (1, 1, 4, 4), "attn_mask: expected dtype bool, float16"),
    (torch.ones(4, 4, dtype=torch.bool), (1, 1, 4, True), "shape: expected the calls' (B, H, L_q, L_k)"),
    (torch.ones(4, 4, dtype=torch.bool), (1, 1, 4), "shape: expected the calls' (B, H, L_q, L_k)"),
    (torch.ones(4, 4, dtype=torch.bool), (1, 1, 4, 0), "shape: expected the calls' (B, H, L_q, L_k)"),
    (torch.ones(4, 4, dtype=torch.bool), "1144", "shape: expected the calls' (B, H, L_q, L_k)"),
    (torch.ones(4, 5, dtype=torch.bool), (1, 1, 4, 4), "attn_mask: expected a mask broadcastable to shape"),
    (torch.ones(2, 1, 4, 4, dtype=torch.bool), (1, 1, 4, 4), "attn_mask: expected a mask broadcastable to shape"),
    (torch.zeros(4, 4, requires_grad=True), (1, 1, 4, 4), "attn_mask: gradients"),
])
def test_prepare_mask_refuses_by_name(mask, shape, error):
    with pytest.raises((TypeError, ValueError), match=re.escape(error)):
        fatune.prepare_mask(mask, shape)


GPU_SPAN_CASES = {  # (B, H, H_kv, L_q, L_k, head dim) -> mask factory
    "prefix-lm-d128": ((2, 4, 4, 1000, 1000, 128), lambda: prefix_lm(2, 1000, 1000, [313, 77])),
    "prefix-lm-d256": ((2, 4, 4, 700, 700, 256), lambda: prefix_lm(2, 700, 700, [129, 600])),
    "documents-d64": ((1, 4, 4, 1500, 1500, 64), lambda: documents([700, 13, 400, 387])),
    "sink-window-gqa-d128": ((2, 8, 2, 1200, 1200, 128), lambda: sink_and_window(1200, 1200, 4, 300)),
    "per-head-bands-gqa-d96": ((2, 4, 2, 600, 900, 96), lambda: per_head_bands(2, 4, 600, 900)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(GPU_SPAN_CASES))
def test_gpu_masks_with_many_empty_tiles(name, dtype, kind, poison_outputs, record_gpu_errors):
    """The dispatched (compiled) kernels with span-cut tile loops, at sizes with many tiles per row."""
    (b, h, hkv, lq, lk, d), make = GPU_SPAN_CASES[name]
    torch.manual_seed(stable_seed("gpu-spans", name, dtype, kind))
    q, k, v = random_qkv(b, h, hkv, lq, lk, d, d, dtype=dtype, device="cuda")
    keep = make()
    mask = keep if kind == "bool" else torch.randn(keep.shape, device="cuda", dtype=dtype).masked_fill(
        ~keep, float("-inf"))
    record_gpu_errors(run_and_compare(q, k, v, attn_mask=mask, enable_gqa=hkv != h))


# (mask shape, element offset into its storage, transposed): row-major and key-major layouts, masks whose
# first element is not 16-byte aligned (Triton specialises on it), and few long rows (scanned in pieces, then joined)
DIRECT_SCANS = [((2, 3, 37, 45), 0, False), ((2, 3, 37, 45), 1, False), ((2, 3, 45, 37), 0, True),
                ((1, 1, 4, 3000), 0, False), ((1, 1, 4, 3000), 3, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_gpu_scans_launched_directly_match_a_brute_scan(kind):
    """The scans go through Triton once per specialisation, then straight to its C launcher
    (fatune.kernel.direct_launch): every call's spans must still be the brute scan's, at every alignment and layout."""
    direct = fatune.kernel.mask_spans._direct()
    generator = torch.Generator().manual_seed(stable_seed("direct-scans", kind))
    for shape, offset, transposed in DIRECT_SCANS:
        for repeat in range(3):  # the first launch of a specialisation compiles; the later ones are direct
            keep = torch.rand(shape, generator=generator) < 0.6
            keep |= torch.rand(shape[:-1] + (1,), generator=generator) < 0.3
            values = keep if kind == "bool" else torch.randn(shape, generator=generator).half().masked_fill(
                ~keep, float("-inf"))
            storage = torch.empty(values.numel() + offset, dtype=values.dtype, device="cuda")
            mask = storage[offset:].view(shape)
            mask.copy_(values)
            if transposed:
                mask, keep = mask.transpose(2, 3), keep.transpose(2, 3)
            problem = tuple(mask.shape)
            key_spans, query_spans = mask_spans(mask, problem)
            expected_rows, expected_cols = brute_spans(keep, full=kind == "bool")
            assert torch.equal(key_spans.cpu().long(), expected_rows), (shape, offset, repeat)
            assert torch.equal(query_spans.cpu().long(), expected_cols), (shape, offset, repeat)
    assert any(entry is not None for entry in direct.binaries.values())


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_SPAN_CASES))
def test_gpu_prepared_masks(name, poison_outputs, record_gpu_errors):
    """The dispatched kernels with spans made once by prepare_mask, called twice."""
    (b, h, hkv, lq, lk, d), make = GPU_SPAN_CASES[name]
    torch.manual_seed(stable_seed("gpu-prepared", name))
    q, k, v = random_qkv(b, h, hkv, lq, lk, d, d, dtype=torch.bfloat16, device="cuda")
    prepared = fatune.prepare_mask(make(), (b, h, lq, lk))
    for _ in range(2):
        q.grad = k.grad = v.grad = None
        record_gpu_errors(run_and_compare(q, k, v, attn_mask=prepared, enable_gqa=hkv != h))


@pytest.mark.gpu
def test_gpu_a_prepared_mask_changed_between_cuda_graph_replays(poison_outputs):
    """Inside a capture a prepared mask is scanned as any mask: the graph's replays see its later contents."""
    torch.manual_seed(stable_seed("gpu-prepared-graph"))
    q, k, v = (t.detach() for t in random_qkv(2, 4, 4, 300, 300, 64, 64, dtype=torch.bfloat16, device="cuda"))
    rows = torch.arange(300, device="cuda")
    prepared = fatune.prepare_mask((rows[None, :] <= rows[:, None]).expand(2, 1, 300, 300), (2, 4, 300, 300))
    fatune.attention(q, k, v, attn_mask=prepared)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fatune.attention(q, k, v, attn_mask=prepared)
    prepared[0, 0].copy_(rows[None, :] >= rows[:, None])  # anti-causal: other tiles (the batch shares its elements)
    graph.replay()
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=prepared)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=0)


# ------------------------------------------------------------------ the kernels' tile ranges

_within_spans = None  # the generated module's within_spans, which _probe calls (set by the test below)


def _probe(SPANS, OUT, n, lo, a, b, hi, TILE: tl.constexpr, ROWS: tl.constexpr):
    index = tl.arange(0, ROWS)
    lo, a, b, hi = _within_spans(SPANS + index * 4, index < n, lo, a, b, hi, TILE)
    for i, value in enumerate((lo, a, b, hi)):
        tl.store(OUT + i, value)


@pytest.mark.skipif(HAS_GPU, reason="calls a generated helper from a probe kernel: the interpreter resolves it")
@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("seed", range(6))
def test_tile_ranges_cover_every_visible_key_and_skip_the_mask_only_where_all_see(seed, kind, monkeypatch):
    """within_spans, run by the interpreter on one query tile's spans: the loops [lo, a) [a, b) [b, hi) reach
    every key some row sees; lo is tile-aligned; the unmasked tiles [a, b) lie inside the band's and (boolean
    masks) are seen in full by every row; an additive mask, added on every tile, leaves [a, b) as the band's."""
    import triton

    from fatune.kernel.triton import codegen

    rng = torch.Generator().manual_seed(seed)
    rows, keys, tile = 24, 200, 16
    pattern = seed % 3
    cols = torch.arange(keys)[None, :]
    row_ids = torch.arange(rows)[:, None] + 100
    if pattern == 0:  # prefix LM
        keep = (cols <= row_ids) | (cols < 37)
    elif pattern == 1:  # sinks and a window
        keep = (cols < 3) | ((cols <= row_ids) & (cols > row_ids - 50))
    else:  # random runs in a document that starts mid-tile
        keep = (torch.rand(rows, keys, generator=rng) < 0.9) & (cols >= 21) & (cols < 170)
    keep[5] = False if seed == 4 else keep[5]  # a row that sees nothing
    mask = keep if kind == "bool" else torch.zeros(rows, keys).masked_fill(~keep, float("-inf"))
    key_spans, _ = mask_spans(mask, (1, 1, rows, keys), want_queries=False)
    spec = fatune.KernelSpec("float16", 16, attn_mask="bool" if kind == "bool" else "additive")
    monkeypatch.setitem(globals(), "_within_spans", codegen.load("fwd", spec, INTERPRETER_CONFIG).within_spans)
    probe = triton.jit(_probe)

    band = (0, 48, 160, keys)  # as key_range hands them over: [lo, a) and [b, hi) masked by a band
    out = torch.empty(4, dtype=torch.int32)
    probe[(1,)](key_spans, out, rows, *band, TILE=tile, ROWS=32)
    lo, a, b, hi = out.tolist()
    assert lo % tile == 0 and lo <= a <= b <= hi <= keys
    seen = keep.any(0).nonzero().flatten()
    assert seen.numel() == 0 or (lo <= seen.min() and seen.max() < hi)
    assert band[1] <= a or a == b
    assert b <= band[2] or a == b
    if kind == "bool" and a < b:
        assert a % tile == 0 and b % tile == 0 and keep[:, a:b].all()
    if kind == "additive":
        assert (a, b) == (max(min(band[1], hi), lo), max(min(band[2], hi), max(min(band[1], hi), lo)))


def test_the_spans_kernel_compiles_for_sm90(tmp_path):
    """The spans kernel as the GPU runs it (compiled, not interpreted): one scan and a scan in pieces, in both
    directions' tiles, for a bool and two additive masks, and the join of the pieces' states."""
    from tests.test_codegen import _compile_in_subprocess

    script = (
        "import triton\n"
        "from triton.compiler import ASTSource\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from fatune.kernel.mask_spans import GRAIN, NO_SPAN, TILES, _jitted\n"
        "cases = [(pointer, additive, False, partial, mode) for additive, pointer in\n"
        "         ((False, '*u8'), (True, '*fp32'), (True, '*bf16')) for partial in (False, True) for mode in TILES]\n"
        "cases += [('*i32', False, True, False, 'join'), ('*i32', True, True, False, 'join')]\n"
        "for pointer, additive, join, partial, mode in cases:\n"
        "    block_r, block_c, warps = TILES.get(mode, (128, 1, 4))\n"
        "    block_c = GRAIN if mode == 'columns' else block_c\n"
        "    signature = dict(SRC=pointer, OUT='*i32',\n"
        "                     **dict.fromkeys(('n_rows', 'n_cols', 'length', 'heads', 'piece'), 'i32'),\n"
        "                     **dict.fromkeys(('stride_sb', 'stride_sh', 'stride_sr', 'stride_sc'), 'i64'),\n"
        "                     **dict.fromkeys(('stride_ob', 'stride_oh', 'stride_or', 'stride_op'), 'i32'),\n"
        "                     **dict.fromkeys(('ADDITIVE', 'FULL', 'JOIN', 'PARTIAL', 'NONE', 'GRAIN', 'COLUMNWISE',\n"
        "                                      'BLOCK_R', 'BLOCK_C'), 'constexpr'))\n"
        "    constants = dict(ADDITIVE=additive and not join, FULL=not additive, JOIN=join, PARTIAL=partial,\n"
        "                     NONE=NO_SPAN, GRAIN=GRAIN, COLUMNWISE=mode == 'columns', BLOCK_R=block_r,\n"
        "                     BLOCK_C=block_c)\n"
        "    kernel = triton.compile(ASTSource(fn=_jitted(False), signature=signature, constexprs=constants),\n"
        "                            target=GPUTarget('cuda', 90, 32), options=dict(num_warps=warps))\n"
        "    print(pointer, kernel.metadata.num_warps)\n"
    )
    assert len(_compile_in_subprocess(script, tmp_path).splitlines()) == 14
