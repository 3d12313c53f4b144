"""Mask variants and the wider input space: attn_mask, seqlens_k, packed varlen, windows,
bottom-right causal, GQA, any head dim, ALiBi, dropout and fully masked rows.

Forward and gradients against the float64 golden with the accuracy rule (reference.py),
on the real generated kernels (Triton interpreter on CPU).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import fatune
from fatune.kernel.triton import dropout
from tests.conftest import DEVICE
from tests.reference import random_qkv, run_and_compare, stable_seed

F16 = torch.float16


def _qkv(b=2, h=2, hkv=2, lq=37, lk=53, d=32, dv=32, dtype=F16, seed=0):
    torch.manual_seed(seed)
    return random_qkv(b, h, hkv, lq, lk, d, dv, dtype=dtype, device=DEVICE)


# ------------------------------------------------------------------ attn_mask

MASK_SHAPES = {
    "full": (2, 2, 37, 53),
    "key-padding": (2, 1, 1, 53),
    "2d": (37, 53),
    "per-head": (1, 2, 37, 53),
    "per-row": (2, 1, 37, 1),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kind", ["bool", "additive-f32", "additive-f16"])
@pytest.mark.parametrize("shape_name", list(MASK_SHAPES))
def test_attn_mask(shape_name, kind, causal, poison_outputs):
    q, k, v = _qkv(seed=stable_seed(shape_name, kind, causal))
    shape = MASK_SHAPES[shape_name]
    if kind == "bool":
        mask = torch.rand(shape, device=DEVICE) < 0.7
    else:
        mask = torch.randn(shape, device=DEVICE, dtype=torch.float32 if kind == "additive-f32" else F16)
        mask = mask.masked_fill(torch.rand(shape, device=DEVICE) < 0.2, float("-inf"))
    run_and_compare(q, k, v, attn_mask=mask, is_causal=causal)


LOW_BIASES = {"float32-min": (torch.float32, torch.finfo(torch.float32).min),
              "bfloat16-min": (torch.bfloat16, torch.finfo(torch.bfloat16).min),
              "float16-min": (F16, torch.finfo(F16).min), "minus-1e9": (torch.float32, -1e9)}


@pytest.mark.parametrize("low", list(LOW_BIASES))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_most_negative_finite_bias_is_finite(low, causal, poison_outputs):
    """A bias of the dtype's most negative finite value (Hugging Face transformers' padding value) is a
    weight as tiny as it says, not -inf: a row whose visible keys all carry it weighs them as SDPA does (alike,
    where the bias swallows the scores: float32's and bfloat16's), a row with one such key among -inf keys returns
    that key's value, and -inf keys stay hidden."""
    q, k, v = _qkv(lq=33, lk=40, seed=stable_seed("finite-bias", low, causal))
    mask_dtype, lowest = LOW_BIASES[low]
    mask = torch.randn(2, 2, 33, 40, device=DEVICE).to(mask_dtype)
    mask[:, :, 3] = lowest  # every key at the lowest bias
    mask[:, :, 7] = float("-inf")
    mask[:, :, 7, 2] = lowest  # one key at the lowest bias, the others hidden
    mask[0, 1, 20:, 10:] = lowest  # a padded block: rows 20.. see keys < 10 at full weight
    mask[1, 0, 12] = float("-inf")  # a row that sees no key: 0
    if mask_dtype == torch.bfloat16:
        mask = mask.to(torch.float32)  # an additive mask is float32 or the inputs' dtype
    out = fatune.attention(q, k, v, attn_mask=mask, is_causal=causal)
    assert torch.isfinite(out).all()
    if mask_dtype != F16:  # -65504 leaves the scores their say
        mean_of_visible = v.mean(dim=2) if not causal else v[:, :, :4].mean(dim=2)
        torch.testing.assert_close(out[:, :, 3], mean_of_visible.to(out.dtype), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(out[:, :, 7], v[:, :, 2].to(out.dtype), atol=1e-3, rtol=1e-3)
    assert (out[1, 0, 12] == 0).all()
    run_and_compare(q, k, v, attn_mask=mask, is_causal=causal)


def test_key_padding_mask_is_not_expanded(poison_outputs):
    """A (B, 1, 1, L_k) mask is read through zero strides: no (B, H, L_q, L_k) copy is made."""
    q, k, v = _qkv(lq=40, lk=70)
    mask = torch.arange(70, device=DEVICE)[None, None, None, :] < torch.tensor([50, 70], device=DEVICE)[:, None, None, None]
    problem = fatune.call.check_inputs(q, k, v, attn_mask=mask)
    assert problem.attn_mask.stride()[1:3] == (0, 0)
    assert problem.attn_mask.untyped_storage().data_ptr() == mask.untyped_storage().data_ptr()
    run_and_compare(q, k, v, attn_mask=mask)


def test_fully_masked_rows_give_zero_output_and_gradients(poison_outputs):
    q, k, v = _qkv(lq=33, lk=40)
    mask = torch.rand(2, 2, 33, 40, device=DEVICE) < 0.6
    mask[:, :, 5] = False
    mask[1, 0, 20:] = False
    out = fatune.attention(q, k, v, attn_mask=mask)
    out.backward(torch.randn_like(out))
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()
    assert (out[:, :, 5] == 0).all() and (out[1, 0, 20:] == 0).all()
    assert (q.grad[:, :, 5] == 0).all() and (q.grad[1, 0, 20:] == 0).all()
    q.grad = k.grad = v.grad = None
    run_and_compare(q, k, v, attn_mask=mask)


# ------------------------------------------------------------------ lengths

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_seqlens_k(causal, poison_outputs):
    q, k, v = _qkv(b=4, lq=45, lk=77, seed=stable_seed("seqlens", causal))
    seqlens = torch.tensor([77, 0, 13, 50], dtype=torch.int32, device=DEVICE)
    run_and_compare(q, k, v, seqlens_k=seqlens, is_causal=causal, causal_alignment="bottom_right")


def test_keys_past_seqlens_k_are_never_read():
    """Keys past each sequence's length hold NaN: any read of them would poison the result."""
    q, k, v = _qkv(b=3, lq=40, lk=96)
    seqlens = torch.tensor([96, 17, 64], dtype=torch.int32, device=DEVICE)
    with torch.no_grad():
        for b, n in enumerate(seqlens.tolist()):
            k[b, :, n:] = float("nan")
            v[b, :, n:] = float("nan")
    out = fatune.attention(q, k, v, seqlens_k=seqlens)
    out.backward(torch.randn_like(out))
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()
    for b, n in enumerate(seqlens.tolist()):
        assert torch.isfinite(k.grad[b, :, :n]).all() and (k.grad[b, :, n:] == 0).all()
        assert (v.grad[b, :, n:] == 0).all()


def _written_in_place():
    """(case, call kwargs, an in-place write to one of its tensors): every tensor besides q, k, v a call reads."""
    keep = torch.rand(2, 1, 37, 53, device=DEVICE) < 0.7
    return [
        ("bool-mask", {"attn_mask": keep}, lambda kw: kw["attn_mask"].fill_(True)),
        ("additive-mask", {"attn_mask": torch.randn(2, 2, 37, 53, device=DEVICE)}, lambda kw: kw["attn_mask"].add_(1)),
        ("prepared-mask", {"attn_mask": fatune.prepare_mask(keep, (2, 2, 37, 53))},
         lambda kw: kw["attn_mask"].fill_(True)),
        ("seqlens-k", {"seqlens_k": torch.tensor([20, 53], dtype=torch.int32, device=DEVICE)},
         lambda kw: kw["seqlens_k"].fill_(53)),
        ("alibi", {"alibi_slopes": torch.rand(2, device=DEVICE)}, lambda kw: kw["alibi_slopes"].mul_(2)),
    ]


@pytest.mark.parametrize("path", ["eager", "compiled-op", "torch-func"])
@pytest.mark.parametrize("case", [case[0] for case in _written_in_place()])
def test_a_tensor_written_in_place_before_the_backward_raises(case, path):
    """A mask or index tensor changed between forward and backward (a buffer the next micro-batch reuses) raises
    torch's in-place error, as for any tensor autograd saved, instead of giving gradients of the new values."""
    q, k, v = _qkv()
    _, kwargs, write = next(c for c in _written_in_place() if c[0] == case)
    if path == "torch-func":  # the tensors are the function's inputs (torch.func refuses writes to captured ones)
        def loss(q_, kwargs_):
            out = fatune.attention(q_, k.detach(), v.detach(), **kwargs_).sum()
            write(kwargs_)
            return out
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.func.grad(loss)(q.detach(), kwargs)
        return
    if path == "eager":
        out = fatune.attention(q, k, v, **kwargs)
    else:  # what torch.compile traces: the custom ops
        out = fatune.ops.attention(q, k, v, fatune.call.Call(**kwargs), None)
    write(kwargs)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(torch.ones_like(out))


def test_packed_offsets_written_in_place_before_the_backward_raise():
    q, k, v, cu_q, cu_k = _packed([5, 20, 12], [9, 20, 3], 2, 2, 16, 16)
    out = fatune.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, is_causal=True)
    cu_k.copy_(cu_q)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(torch.ones_like(out))


def _packed(lengths_q, lengths_k, heads, kv_heads, d, dv, dtype=F16, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(sum(lengths_q), heads, d, dtype=dtype, device=DEVICE).requires_grad_()
    k = torch.randn(sum(lengths_k), kv_heads, d, dtype=dtype, device=DEVICE).requires_grad_()
    v = torch.randn(sum(lengths_k), kv_heads, dv, dtype=dtype, device=DEVICE).requires_grad_()

    def cu(lengths):
        return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=DEVICE)

    return q, k, v, cu(lengths_q), cu(lengths_k)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("group", [1, 2])
def test_packed_varlen(causal, group, poison_outputs):
    rng = random.Random(stable_seed("varlen", causal, group))
    lengths_q = [rng.randint(1, 70) for _ in range(4)] + [1]
    lengths_k = [rng.randint(1, 90) for _ in range(4)] + [33]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 2 * group, 2, 32, 32, seed=rng.randint(0, 99))
    run_and_compare(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lengths_q),
                    max_seqlen_k=max(lengths_k), is_causal=causal, enable_gqa=group > 1)


# ------------------------------------------------------------------ windows and alignment

WINDOWS = [(8, 8), (0, 0), (20, -1), (-1, 5), (3, 30), (40, 0)]


@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("seqlens", [(61, 61), (40, 97), (97, 40)], ids=str)
def test_sliding_window(window, seqlens, alignment, poison_outputs):
    q, k, v = _qkv(lq=seqlens[0], lk=seqlens[1], seed=stable_seed(window, seqlens, alignment))
    run_and_compare(q, k, v, window_size=window, causal_alignment=alignment)


@pytest.mark.parametrize("seqlens", [(30, 70), (70, 30)], ids=str)
def test_causal_bottom_right(seqlens, poison_outputs):
    q, k, v = _qkv(lq=seqlens[0], lk=seqlens[1], seed=stable_seed("br", seqlens))
    run_and_compare(q, k, v, is_causal=True, causal_alignment="bottom_right")


def test_causal_with_window(poison_outputs):
    q, k, v = _qkv(lq=64, lk=64)
    run_and_compare(q, k, v, is_causal=True, window_size=(10, 10))


# Every row sees exactly one key, so softmax's backward gives dS = P (dP - sum P dP) = 0 exactly: the
# golden's dQ is 0 and PyTorch's is 0 too, which leaves fatune only the accuracy rule's floor.
ONE_KEY_ROWS = {  # case: (_qkv's sizes, fatune.attention's arguments)
    "diagonal-window": ({"lq": 37, "lk": 53}, {"window_size": (0, 0), "causal_alignment": "top_left"}),
    "decode-top-left-causal": ({"b": 3, "h": 4, "hkv": 2, "lq": 1, "lk": 40}, {"is_causal": True, "enable_gqa": True}),
    "diagonal-dropout": ({"lq": 20, "lk": 20}, {"window_size": (0, 0), "dropout_p": 0.3}),
}


@pytest.mark.parametrize("dtype, atomic", [(F16, 0), (F16, 1), (F16, 2), (torch.float32, 0)],  # float32: no atomic dQ
                         ids=["fp16-dq-kernel", "fp16-atomic-dq", "fp16-tma-reduce", "fp32"])
@pytest.mark.parametrize("case", list(ONE_KEY_ROWS))
def test_rows_that_see_one_key_get_exact_gradients(case, dtype, atomic, monkeypatch, poison_outputs):
    """The backward recomputes P = 1 exactly from the forward's LSE (kept in log2 units, so no conversion
    rounds it: dQ was up to 5e-7 off), and Delta is summed from the same P and dP, also in the pass before
    atomic dQ (Delta from the rounded O, with dropout's 1 / (1 - p), missed by up to 1e-2): dQ is exactly 0.
    (dK too on a GPU, where S^T = K Q^T is S's own FMA chain; the interpreter's numpy products of the
    transposed tiles may differ in the last bit, so dK is held to the accuracy rule here.)"""
    sizes, kwargs = ONE_KEY_ROWS[case]
    q, k, v = _qkv(**sizes, dtype=dtype, seed=stable_seed("one-key", case, dtype))
    keep = None
    if "dropout_p" in kwargs:
        monkeypatch.setattr(dropout, "draw_seed", lambda device: torch.tensor([77], device=device))
        keep = dropout.keep_mask(77, kwargs["dropout_p"], q.shape[0], q.shape[1], q.shape[2], k.shape[2], DEVICE)
    config = _atomic_dq(kind=atomic)
    out = fatune.attention(q, k, v, config=config, **kwargs)
    (dq,) = torch.autograd.grad(out, (q,), torch.randn_like(out))
    assert torch.count_nonzero(dq) == 0
    run_and_compare(q, k, v, config=config, dropout_keep=keep, **kwargs)


@pytest.mark.parametrize("lq, lk", [(1, 39), (40, 97)], ids=str)
def test_peaked_rows_keep_dq_accurate(lq, lk, poison_outputs):
    """Rows dominated by one key with a large score (S ~ 30, P ~ 1): the recomputed P carries the LSE's
    rounding as a common factor, which Delta = sum P dP (~10 here) would turn into dS; Delta divided by
    sum P keeps it a relative error (before: dQ up to 7x PyTorch's error)."""
    q, k, v = _qkv(b=1, h=2, hkv=2, lq=lq, lk=lk, d=144, dv=144, seed=stable_seed("peaked", lq, lk))
    with torch.no_grad():
        for row in range(lq):  # key (5 row) mod L_k lies along query row: its score is 2.5 |q|^2 / sqrt(d) ~ 30
            k[:, :, (5 * row + 3) % lk] = 2.5 * q[:, :, row]
    for _ in range(4):  # a fresh dO each time
        run_and_compare(q, k, v)


def test_alignment_defaults_document_sdpa_and_flash_attn():
    """is_causal alone is SDPA's top-left; with a window the default is flash-attn's bottom-right."""
    q, k, v = _qkv(lq=3, lk=6)
    top_left = fatune.call.check_inputs(q, k, v, is_causal=True)
    windowed = fatune.call.check_inputs(q, k, v, window_size=(2, 0))
    assert not top_left.spec.bottom_right and windowed.spec.bottom_right


# ------------------------------------------------------------------ tile ranges

def test_tile_ranges_are_safe_and_tight():
    """key_range/query_range against brute force: skipped tiles are fully invisible, unmasked ones fully visible."""
    import triton
    import triton.language as tl

    from fatune.kernel.spec import KernelSpec
    from fatune.kernel.triton import codegen
    from fatune.kernel.triton.heuristics import INTERPRETER_CONFIG

    spec = KernelSpec("float16", 16, causal=False, window_left=True, window_right=True, bottom_right=True)
    module = codegen.load("bwd", spec, INTERPRETER_CONFIG)
    # a @triton.jit function resolves the functions it calls among its module's globals
    globals().update(key_range=module.key_range, query_range=module.query_range)

    @triton.jit
    def ranges(OUT, first_row, last_row, start_n, seqlen_q, seqlen_k, offset, left, right, TM: tl.constexpr,
               TN: tl.constexpr):
        lo, a, b, hi = key_range(first_row, last_row, seqlen_k, offset, left, right, TN)
        tl.store(OUT + 0, lo)
        tl.store(OUT + 1, a)
        tl.store(OUT + 2, b)
        tl.store(OUT + 3, hi)
        lo, a, b, hi = query_range(start_n, seqlen_q, seqlen_k, offset, left, right, TM, TN)
        tl.store(OUT + 4, lo)
        tl.store(OUT + 5, a)
        tl.store(OUT + 6, b)
        tl.store(OUT + 7, hi)

    rng = random.Random(1)
    out = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    for _ in range(150):
        tm, tn = rng.choice([16, 32]), rng.choice([16, 32])
        seqlen_q, seqlen_k = rng.randint(1, 120), rng.randint(1, 120)
        left, right = rng.randint(0, 60), rng.randint(0, 60)
        offset = seqlen_k - seqlen_q
        rows = torch.arange(seqlen_q)[:, None]
        cols = torch.arange(seqlen_k)[None, :]
        sees = (cols >= rows + offset - left) & (cols <= rows + offset + right)
        # query rows first .. last: a tile's (start_m .. start_m + tm - 1), or the positions of a GQA-packed tile
        first = rng.randrange(0, seqlen_q, tm) if rng.random() < 0.5 else rng.randrange(0, seqlen_q)
        last = first + (tm - 1 if rng.random() < 0.5 else rng.randint(0, 40))
        start_n = rng.randrange(0, seqlen_k, tn)
        ranges[(1,)](out, first, last, start_n, seqlen_q, seqlen_k, offset, left, right, tm, tn)
        lo, a, b, hi = out[:4].tolist()
        block = sees[first:last + 1]
        visible_cols = block.any(0).nonzero().flatten().tolist()
        assert lo <= a <= b <= hi <= seqlen_k and lo % tn == 0 and (a % tn == 0 or a == hi)
        if visible_cols:
            assert lo <= visible_cols[0] and visible_cols[-1] < hi, (lo, hi, visible_cols)
            assert lo // tn == visible_cols[0] // tn and (hi - 1) // tn == visible_cols[-1] // tn  # tight
        for tile in range(a, b, tn):
            assert block[:, tile:tile + tn].all() or last >= seqlen_q, "an unmasked tile hides masked keys"
        # query tiles for key columns start_n .. start_n + tn - 1
        lo, a, b, hi = out[4:].tolist()
        block = sees[:, start_n:start_n + tn]
        visible_rows = block.any(1).nonzero().flatten().tolist()
        assert lo <= a <= b <= hi <= seqlen_q and lo % tm == 0 and (a % tm == 0 or a == hi)
        if visible_rows:
            assert lo <= visible_rows[0] and visible_rows[-1] < hi
            assert lo // tm == visible_rows[0] // tm and (hi - 1) // tm == visible_rows[-1] // tm
        for tile in range(a, b, tm):
            assert block[tile:tile + tm].all() or start_n + tn > seqlen_k


# ------------------------------------------------------------------ GQA, head dims

@pytest.mark.parametrize("group", [1, 3, 4])
def test_gqa_ratios(group, poison_outputs):
    q, k, v = _qkv(h=2 * group, hkv=2, seed=group)
    run_and_compare(q, k, v, is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("dims", [(40, 40), (80, 80), (96, 96), (111, 111), (160, 160), (192, 192), (256, 256),
                                  (96, 40), (1, 7)], ids=str)
def test_any_head_dim(dims, poison_outputs):
    q, k, v = _qkv(b=1, lq=33, lk=45, d=dims[0], dv=dims[1], seed=dims[0] * 1000 + dims[1])
    run_and_compare(q, k, v, is_causal=True)


# ------------------------------------------------------------------ ALiBi

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("slopes_shape", ["H", "BH"])
def test_alibi(slopes_shape, causal, poison_outputs):
    q, k, v = _qkv(lq=41, lk=57, seed=stable_seed("alibi", slopes_shape, causal))
    shape = (2,) if slopes_shape == "H" else (2, 2)
    slopes = torch.rand(shape, device=DEVICE, dtype=torch.float32) * 0.5
    run_and_compare(q, k, v, alibi_slopes=slopes, is_causal=causal, causal_alignment="bottom_right")


# ------------------------------------------------------------------ split-KV and GQA packing (forward structure)

def _structure(splits: int, pack: int):
    from fatune.kernel.triton.heuristics import INTERPRETER_CONFIG

    return INTERPRETER_CONFIG.replace(fwd=fatune.LaunchConfig(16, 16, num_splits=splits, pack_gqa=pack))


# (case id, factory -> (q, k, v, kwargs)): inference shapes (1 or a few queries against a long cache) and the
# variants whose per-row values (mask, ALiBi slope, dropout counters) differ between the packed heads
STRUCTURE_CASES = [
    ("decode-gqa", lambda: (*_qkv(b=3, h=8, hkv=2, lq=1, lk=117, seed=1), {"enable_gqa": True})),
    ("chunk-causal-cache", lambda: (*_qkv(b=2, h=4, hkv=2, lq=7, lk=90, seed=2),
                                    {"enable_gqa": True, "is_causal": True, "causal_alignment": "bottom_right",
                                     "seqlens_k": torch.tensor([61, 90], dtype=torch.int32, device=DEVICE)})),
    ("prefill-window", lambda: (*_qkv(b=1, h=6, hkv=2, lq=45, lk=60, seed=3),
                                {"enable_gqa": True, "window_size": (9, 4)})),
    ("mask-alibi", lambda: (*_qkv(b=2, h=4, hkv=2, lq=9, lk=70, seed=4),
                            {"enable_gqa": True, "attn_mask": torch.rand(2, 4, 9, 70, device=DEVICE) < 0.7,
                             "alibi_slopes": torch.rand(2, 4, device=DEVICE) * 0.3})),
    ("no-gqa", lambda: (*_qkv(b=2, h=2, hkv=2, lq=3, lk=50, seed=5), {"is_causal": True})),
]


@pytest.mark.parametrize("splits, pack", [(1, 1), (3, 0), (3, 1), (16, 1), (0, 1)],
                         ids=["pack", "split3", "split3-pack", "split16-pack", "auto-pack"])
@pytest.mark.parametrize("make", [case[1] for case in STRUCTURE_CASES], ids=[case[0] for case in STRUCTURE_CASES])
def test_split_kv_and_gqa_packing(make, splits, pack, poison_outputs):
    """Forward structure variants give the same attention (and the LSE the backward needs: gradients too).

    16 splits of these short caches leave some splits without a key tile: they must weigh nothing."""
    q, k, v, kwargs = make()
    run_and_compare(q, k, v, config=_structure(splits, pack), **kwargs)


@pytest.mark.parametrize("splits, pack, lengths_q, lengths_k", [
    (3, 1, [1, 6, 2, 1], [40, 75, 3, 61]),
    (5, 0, [1, 6, 2, 1], [40, 75, 3, 61]),
    # query tiles past a short (or empty) sequence return before their splits count in: the counts and the
    # other tiles' merges must not notice
    (2, 0, [40, 3, 0, 17], [45, 30, 7, 17]),
    (3, 1, [40, 3, 0, 17], [45, 30, 7, 17]),
], ids=["split3-pack", "split5", "early-return-split2", "early-return-split3-pack"])
def test_split_kv_packed_varlen(splits, pack, lengths_q, lengths_k, poison_outputs):
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 4, 2, 32, 32, seed=splits)
    run_and_compare(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lengths_q),
                    max_seqlen_k=max(lengths_k), is_causal=True, enable_gqa=True, config=_structure(splits, pack))


def test_split_kv_leaves_its_arrival_counts_zero():
    """Each tile's last split resets its arrival count, so the one buffer all launches on a stream
    share is zero again after every launch (else the next launch would merge too early)."""
    from fatune.kernel.triton import launch

    q, k, v, kwargs = STRUCTURE_CASES[0][1]()
    launch._split_counts.clear()
    for splits in (3, 16, 2):
        fatune.attention(q, k, v, config=_structure(splits, 1), **kwargs)
        (counts,) = launch._split_counts.values()
        assert not counts.any(), f"{splits} splits left arrival counts {counts.nonzero().flatten().tolist()} non-zero"


def test_gqa_packing_with_dropout_regenerates_each_heads_mask(monkeypatch, poison_outputs):
    seed, p = 77, 0.3
    monkeypatch.setattr(dropout, "draw_seed", lambda device: torch.tensor([seed], device=device))
    q, k, v = _qkv(b=2, h=4, hkv=2, lq=5, lk=48, seed=6)
    keep = dropout.keep_mask(seed, p, 2, 4, 5, 48, DEVICE)
    run_and_compare(q, k, v, dropout_p=p, enable_gqa=True, dropout_keep=keep, config=_structure(2, 1))


# ------------------------------------------------------------------ atomic dQ (backward structure)

def _atomic_dq(dkdv=(16, 32), kind=1):
    from fatune.kernel.triton.heuristics import INTERPRETER_CONFIG

    return INTERPRETER_CONFIG.replace(dkdv=fatune.LaunchConfig(*dkdv, atomic_dq=kind))


# (case id, factory -> (q, k, v, kwargs)): every code path of the dK/dV kernel's query loop (band edges,
# score terms, dropout, GQA's head loop, ragged and packed rows), now also writing dQ
ATOMIC_DQ_CASES = [
    ("plain-ragged", lambda: (*_qkv(lq=37, lk=53, seed=11), {})),
    ("causal-gqa", lambda: (*_qkv(b=2, h=4, hkv=2, lq=45, lk=45, seed=12), {"is_causal": True, "enable_gqa": True})),
    ("window-bottom-right", lambda: (*_qkv(lq=30, lk=61, seed=13), {"window_size": (7, 3)})),
    ("mask-alibi", lambda: (*_qkv(lq=21, lk=40, seed=14), {"attn_mask": torch.rand(2, 1, 21, 40, device=DEVICE) < 0.7,
                                                          "alibi_slopes": torch.rand(2, device=DEVICE) * 0.3})),
    ("seqlens-k", lambda: (*_qkv(lq=33, lk=50, seed=15),
                           {"is_causal": True, "seqlens_k": torch.tensor([50, 9], dtype=torch.int32, device=DEVICE)})),
    ("odd-head-dim", lambda: (*_qkv(lq=19, lk=35, d=24, dv=40, seed=16), {"is_causal": True})),
    ("float32", lambda: (*_qkv(lq=25, lk=33, dtype=torch.float32, seed=17), {"is_causal": True})),  # falls back to dQ
]


@pytest.mark.parametrize("kind", [1, 2], ids=["atomics", "tma-reduce"])
@pytest.mark.parametrize("dkdv", [(16, 32), (32, 16)], ids=["16x32", "32x16"])
@pytest.mark.parametrize("make", [case[1] for case in ATOMIC_DQ_CASES], ids=[case[0] for case in ATOMIC_DQ_CASES])
def test_atomic_dq(make, dkdv, kind, poison_outputs):
    """The dK/dV kernel that also accumulates dQ (element atomics, or TMA reductions: emulated in the
    interpreter) gives the same gradients as the separate dQ kernel."""
    q, k, v, kwargs = make()
    run_and_compare(q, k, v, config=_atomic_dq(dkdv, kind), **kwargs)


@pytest.mark.parametrize("kind", [1, 2], ids=["atomics", "tma-reduce"])
def test_atomic_dq_packed_varlen_and_dropout(kind, monkeypatch, poison_outputs):
    q, k, v, cu_q, cu_k = _packed([1, 16, 7], [40, 21, 3], 4, 2, 32, 32, seed=3)
    run_and_compare(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=16, max_seqlen_k=40,
                    is_causal=True, enable_gqa=True, config=_atomic_dq(kind=kind))
    seed, p = 99, 0.25
    monkeypatch.setattr(dropout, "draw_seed", lambda device: torch.tensor([seed], device=device))
    q, k, v = _qkv(lq=20, lk=36, seed=18)
    keep = dropout.keep_mask(seed, p, 2, 2, 20, 36, DEVICE)
    run_and_compare(q, k, v, dropout_p=p, is_causal=True, dropout_keep=keep, config=_atomic_dq(kind=kind))


# ------------------------------------------------------------------ TMA loads in dK/dV (backward structure)

def _tma_dkdv(atomic=0):
    from fatune.kernel.triton.heuristics import INTERPRETER_CONFIG

    return INTERPRETER_CONFIG.replace(dkdv=fatune.LaunchConfig(16, 32, tma=1, atomic_dq=atomic))


@pytest.mark.parametrize("atomic", [0, 2], ids=["dq-kernel", "tma-reduce"])
@pytest.mark.parametrize("make", [case[1] for case in ATOMIC_DQ_CASES], ids=[case[0] for case in ATOMIC_DQ_CASES])
def test_tma_dkdv(make, atomic, poison_outputs):
    """The dK/dV kernel reading its query and dO tiles through TMA descriptors (zero-filled past the
    sequence and the head dim) gives the same gradients, on every code path of its query loop."""
    q, k, v, kwargs = make()
    run_and_compare(q, k, v, config=_tma_dkdv(atomic), **kwargs)


def test_tma_dkdv_packed_varlen(poison_outputs):
    q, k, v, cu_q, cu_k = _packed([1, 16, 7], [40, 21, 3], 4, 2, 32, 32, seed=4)
    run_and_compare(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=16, max_seqlen_k=40,
                    is_causal=True, enable_gqa=True, config=_tma_dkdv())


def test_tma_dkdv_one_head_with_an_odd_head_stride(poison_outputs):
    """One query head whose head stride is no 16-byte multiple: the forward keeps its TMA loads (it only
    offsets by the head), dK/dV's descriptors over every head's rows cannot take it (pointer loads)."""
    q, k, v = (t.requires_grad_() for t in _one_head_odd_head_stride(DEVICE))
    run_and_compare(q, k, v, is_causal=True, config=_tma_dkdv())


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("grad_layout, tma", [("dense", 1), ("transposed", 1), ("every-other-lane", 0)])
def test_tma_dkdv_reads_do_only_where_tma_can(grad_layout, tma, deterministic, monkeypatch, poison_outputs, request):
    """dO comes from autograd in any layout: the backward keeps TMA loads for a dO TMA can read and
    compiles the pointer loads for one it cannot; so does deterministic mode's backward with the dQ kernel
    in place of atomic dQ."""
    from fatune.kernel.triton import codegen

    loaded = []
    load = codegen.load
    monkeypatch.setattr(codegen, "load", lambda kind, spec, config: loaded.append((kind, config)) or load(kind, spec, config))
    if deterministic:
        request.getfixturevalue("deterministic_algorithms")
    q, k, v = _qkv(lq=29, lk=41, seed=31)
    config = _tma_dkdv(atomic=1) if deterministic else _tma_dkdv()
    run_and_compare(q, k, v, is_causal=True, config=config, grad_layout=grad_layout)
    assert [(config.dkdv.tma, config.dkdv.atomic_dq) for kind, config in loaded if kind == "bwd"] == [(tma, 0)]


@pytest.mark.parametrize("head_dim, dtype, expected", [(32, torch.float16, 2), (24, torch.float16, 2),
                                                         (30, torch.float16, 1), (32, torch.float32, 0),
                                                         (16, torch.float16, 0)])
def test_tma_dq_is_kept_where_tma_can_reduce_into_the_accumulator(head_dim, dtype, expected):
    """atomic_dq=2 needs accumulator rows of a 16-byte multiple (head_dim % 4 == 0); float32 (Kahan sums)
    and head dims up to 16 (atomic dQ's Delta from the 16-bit O is too coarse there) keep the dQ kernel."""
    from fatune.call import Call
    from fatune.kernel.triton.resolve import resolve

    q, k, v = _qkv(lq=20, lk=36, d=head_dim, dv=head_dim, dtype=dtype, seed=20)
    problem = Call(is_causal=True).check(q, k, v)
    assert resolve(_atomic_dq(kind=2), problem, q.device, (q, k, v)).dkdv.atomic_dq == expected


# ------------------------------------------------------------------ head-dim split of dK/dV (backward structure)

def _split_d(tma=0, atomic=0):
    from fatune.kernel.triton.heuristics import INTERPRETER_CONFIG

    return INTERPRETER_CONFIG.replace(dkdv=fatune.LaunchConfig(16, 32, tma=tma, atomic_dq=atomic, split_d=2))


# the split's cases: ATOMIC_DQ_CASES' at head dims whose halves are 64 lanes or more (fatune.kernel.triton.structure.split_d_runs)
SPLIT_D_CASES = [
    ("plain-ragged", lambda: (*_qkv(lq=37, lk=53, d=72, dv=72, seed=11), {})),
    ("causal-gqa", lambda: (*_qkv(b=2, h=4, hkv=2, lq=45, lk=45, d=72, dv=72, seed=12),
                            {"is_causal": True, "enable_gqa": True})),
    ("window-bottom-right", lambda: (*_qkv(lq=30, lk=61, d=72, dv=72, seed=13), {"window_size": (7, 3)})),
    ("mask-alibi", lambda: (*_qkv(lq=21, lk=40, d=72, dv=72, seed=14),
                            {"attn_mask": torch.rand(2, 1, 21, 40, device=DEVICE) < 0.7,
                             "alibi_slopes": torch.rand(2, device=DEVICE) * 0.3})),
    ("seqlens-k", lambda: (*_qkv(lq=33, lk=50, d=72, dv=72, seed=15),
                           {"is_causal": True, "seqlens_k": torch.tensor([50, 9], dtype=torch.int32, device=DEVICE)})),
    ("odd-head-dims", lambda: (*_qkv(lq=19, lk=35, d=100, dv=140, seed=16), {"is_causal": True})),
    ("float32", lambda: (*_qkv(lq=25, lk=33, d=72, dv=72, dtype=torch.float32, seed=17), {"is_causal": True})),
]


@pytest.mark.parametrize("tma, atomic", [(0, 0), (0, 1), (1, 2)], ids=["pointers", "atomics", "tma-tma-reduce"])
@pytest.mark.parametrize("make", [case[1] for case in SPLIT_D_CASES], ids=[case[0] for case in SPLIT_D_CASES])
def test_split_d(make, tma, atomic, poison_outputs):
    """Two programs per key tile, each owning half of dK's and dV's head dim (and of dQ's, with atomic dQ),
    give the same gradients on every code path of the query loop, padded head dims included."""
    q, k, v, kwargs = make()
    run_and_compare(q, k, v, config=_split_d(tma, atomic), **kwargs)


def test_split_d_packed_varlen_and_dropout(monkeypatch, poison_outputs):
    q, k, v, cu_q, cu_k = _packed([1, 16, 7], [40, 21, 3], 4, 2, 72, 72, seed=5)
    run_and_compare(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=16, max_seqlen_k=40,
                    is_causal=True, enable_gqa=True, config=_split_d(tma=1))
    seed, p = 77, 0.25
    monkeypatch.setattr(dropout, "draw_seed", lambda device: torch.tensor([seed], device=device))
    q, k, v = _qkv(lq=20, lk=36, d=72, dv=72, seed=19)
    keep = dropout.keep_mask(seed, p, 2, 2, 20, 36, DEVICE)
    run_and_compare(q, k, v, dropout_p=p, is_causal=True, dropout_keep=keep, config=_split_d(atomic=1))


@pytest.mark.parametrize("tma", [0, 1], ids=["pointers", "tma"])
def test_split_d_with_an_empty_key_sequence(tma, poison_outputs):
    """A batch element with no keys (seqlens_k 0): its dK/dV programs read no key (a TMA map keeps one row)
    and write zeros."""
    q, k, v = _qkv(lq=24, lk=40, d=72, dv=72, seed=22)
    run_and_compare(q, k, v, seqlens_k=torch.tensor([40, 0], dtype=torch.int32, device=DEVICE),
                    config=_split_d(tma=tma))


@pytest.mark.parametrize("head_dim, head_dim_v, kept", [(72, 72, 2), (100, 140, 2), (64, 64, 1), (32, 32, 1),
                                                       (17, 40, 1), (128, 64, 1), (256, 128, 2), (234, 54, 1),
                                                       (72, 256, 2)])
def test_split_d_needs_halves_of_64_lanes(head_dim, head_dim_v, kept):
    """A head-dim half of at least 64 lanes in both head dims, else the launch runs the unsplit kernel (halves of
    16 and 32 gave wrong dK on an H200; 128 and 32 lanes under GQA faulted)."""
    from fatune.call import Call
    from fatune.kernel.triton.resolve import resolve

    q, k, v = _qkv(lq=20, lk=36, d=head_dim, dv=head_dim_v, seed=21)
    problem = Call(is_causal=True).check(q, k, v)
    assert resolve(_split_d(), problem, q.device, (q, k, v)).dkdv.split_d == kept


def test_atomic_dq_launches_no_dq_kernel():
    from fatune.call import Call
    from fatune.kernel.triton.launch import Plan

    q, k, v = _qkv(lq=20, lk=36, seed=19)
    call = Call(is_causal=True)
    names = {}
    for atomic in (0, 1, 2):
        config = _atomic_dq(kind=atomic) if atomic else _atomic_dq().replace(dkdv=fatune.LaunchConfig(16, 32))
        plan = Plan(call.check(q, k, v), config, q.device, q, k, v)
        names[atomic] = [launch.fn.__name__ for launch in plan.bwd_launches(torch.empty_like(q))]
    fused = ["attn_bwd_prep", "attn_bwd_dkdv", "attn_bwd_dq_store"]
    assert names == {0: ["attn_bwd_dq", "attn_bwd_dkdv"], 1: fused, 2: fused}
    q32, k32, v32 = (t.float() for t in (q, k, v))
    plan = Plan(call.check(q32, k32, v32), _atomic_dq(), q.device, q32, k32, v32)
    assert not plan.atomic_dq and plan.config.dkdv.atomic_dq == 0  # Kahan-summed float32 keeps the dQ kernel


def _concurrent_dq(kind=1):
    from fatune.kernel.triton.heuristics import INTERPRETER_CONFIG

    return INTERPRETER_CONFIG.replace(dq=fatune.LaunchConfig(32, 16, concurrent=kind))


@pytest.mark.parametrize("kind", [1, 2], ids=["dq-first", "dkdv-first"])
@pytest.mark.parametrize("make", [case[1] for case in ATOMIC_DQ_CASES], ids=[case[0] for case in ATOMIC_DQ_CASES])
def test_concurrent_dq(make, kind, poison_outputs):
    """The dQ kernel that reads Delta from the pass before it (to run beside dK/dV) gives the same gradients."""
    q, k, v, kwargs = make()
    run_and_compare(q, k, v, config=_concurrent_dq(kind), **kwargs)


def test_concurrent_dq_packed_varlen_and_dropout(monkeypatch, poison_outputs):
    q, k, v, cu_q, cu_k = _packed([1, 16, 0, 7], [40, 21, 5, 3], 4, 2, 32, 32, seed=5)
    run_and_compare(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=16, max_seqlen_k=40,
                    is_causal=True, enable_gqa=True, config=_concurrent_dq())
    monkeypatch.setattr(dropout, "draw_seed", lambda device: torch.tensor([31], device=device))
    q, k, v = _qkv(lq=20, lk=36, seed=21)
    keep = dropout.keep_mask(31, 0.25, 2, 2, 20, 36, DEVICE)
    run_and_compare(q, k, v, dropout_p=0.25, window_size=(3, 0), dropout_keep=keep, config=_concurrent_dq(2))


def test_concurrent_dq_launches_delta_first():
    """Delta's pass, then dQ and dK/dV in the order asked (`beside`: the one on the second stream); atomic dQ
    leaves no dQ kernel to run beside, and deterministic mode's dQ kernel (the heuristic's) runs in order."""
    from fatune.call import Call
    from fatune.kernel.triton.launch import Plan

    q, k, v = _qkv(lq=20, lk=36, seed=19)
    problem = Call(is_causal=True).check(q, k, v)
    for kind, names, beside in ((1, ["attn_bwd_prep", "attn_bwd_dq", "attn_bwd_dkdv"], 1),
                                (2, ["attn_bwd_prep", "attn_bwd_dkdv", "attn_bwd_dq"], 2)):
        plan = Plan(problem, _concurrent_dq(kind), q.device, q, k, v)
        assert [launch.fn.__name__ for launch in plan.bwd_launches(torch.empty_like(q))] == names
        assert plan.beside() == beside
    atomic = _concurrent_dq().replace(dkdv=fatune.LaunchConfig(16, 32, atomic_dq=1))
    plan = Plan(problem, atomic, q.device, q, k, v)
    assert plan.config.dq.concurrent == 0 and plan.beside() is None
    assert [launch.fn.__name__ for launch in plan.bwd_launches(torch.empty_like(q), atomic=False)] == \
        ["attn_bwd_dq", "attn_bwd_dkdv"]


def test_a_dq_register_cap_stays_with_the_dq_kernel():
    """A capped dQ config (`/r128`) caps the dQ kernel; with atomic dQ, the small kernels around dK/dV take dQ's
    tile and warps but not its cap (measured for the dQ kernel only)."""
    from fatune.call import Call
    from fatune.kernel.triton.launch import Plan

    q, k, v = _qkv(lq=20, lk=36, seed=19)
    problem = Call(is_causal=True).check(q, k, v)
    capped = fatune.LaunchConfig(32, 16, maxnreg=128)
    for config, expected in ((_atomic_dq().replace(dkdv=fatune.LaunchConfig(16, 32), dq=capped), [128, 0]),
                             (_atomic_dq().replace(dq=capped), [0, 0, 0])):
        plan = Plan(problem, config, q.device, q, k, v)
        assert [launch.options.get("maxnreg", 0) for launch in plan.bwd_launches(torch.empty_like(q))] == expected


@pytest.mark.parametrize("kind", [1, 2], ids=["atomics", "tma-reduce"])
def test_deterministic_mode_runs_the_dq_kernel_instead_of_atomic_dq(kind, monkeypatch, poison_outputs, request):
    """Under torch.use_deterministic_algorithms(True) an atomic-dQ config's backward launches the dQ kernel
    (atomic adds land in any order) with the heuristic's dQ tile (an atomic config's dQ tile only sized
    Delta's rows: it was never timed as a dQ kernel); the accuracy rule holds. Off again, the same plan adds
    dQ atomically."""
    from fatune.kernel.triton import codegen
    from fatune.kernel.triton.heuristics import INTERPRETER_CONFIG

    loaded = []
    load = codegen.load
    monkeypatch.setattr(codegen, "load", lambda kind_, spec, config: loaded.append((kind_, config)) or load(kind_, spec, config))
    q, k, v = _qkv(lq=29, lk=43, seed=33)
    config = _atomic_dq(kind=kind).replace(dq=fatune.LaunchConfig(16, 16))
    request.getfixturevalue("deterministic_algorithms")
    run_and_compare(q, k, v, is_causal=True, config=config)
    explained = fatune.explain(q, k, v, is_causal=True, config=config).launched
    assert (explained.dkdv.atomic_dq, explained.dq) == (0, INTERPRETER_CONFIG.dq)
    torch.use_deterministic_algorithms(False)  # the fixture restores the session's mode afterwards
    backwards = [config for kind_, config in loaded if kind_ == "bwd"]
    assert [(c.dkdv.atomic_dq, c.dq) for c in backwards] == [(0, INTERPRETER_CONFIG.dq)]
    loaded.clear()
    out = fatune.attention(q, k, v, is_causal=True, config=config)
    out.backward(torch.randn_like(out))
    assert [c.dkdv.atomic_dq for kind_, c in loaded if kind_ == "bwd"] == [kind]  # the same plan, atomic again
    assert fatune.explain(q, k, v, is_causal=True, config=config).launched.dkdv.atomic_dq == kind


def test_auto_splits_follow_the_grid():
    from fatune.kernel.triton.resolve import choose_splits

    assert choose_splits(programs=8, key_tiles=512, sms=132) == 16  # decode: one full wave, no partial second
    assert choose_splits(programs=64, key_tiles=512, sms=132) == 2
    assert choose_splits(programs=100, key_tiles=512, sms=132) == 1
    assert choose_splits(programs=8, key_tiles=10, sms=132) == 5  # short cache: at least 2 key tiles each
    assert choose_splits(programs=200, key_tiles=512, sms=132) == 1  # the grid already fills the GPU


# ------------------------------------------------------------------ TMA loads (forward structure)

# (case id, forward config, factory -> (q, k, v, kwargs)): descriptors zero-fill rows past a sequence's
# end, so ragged query and key ends matter
HOPPER_CASES = [
    ("tma-causal", "16x16/w4/s1/t", lambda: (*_qkv(lq=37, lk=53, seed=21), {"is_causal": True})),
    ("tma-causal-64", "64x16/w4/s1/t", lambda: (*_qkv(lq=37, lk=53, seed=22), {"is_causal": True})),
    ("tma-window", "64x16/w4/s1/t", lambda: (*_qkv(lq=45, lk=60, seed=23),
                                             {"window_size": (9, 4), "causal_alignment": "bottom_right"})),
    ("tma-seqlens-k", "64x16/w4/s1/t", lambda: (*_qkv(lq=70, lk=53, seed=24),
                                                {"is_causal": True, "causal_alignment": "bottom_right",
                                                 "seqlens_k": torch.tensor([40, 0], dtype=torch.int32,
                                                                           device=DEVICE)})),
    ("tma-split3-alibi", "64x16/w4/s1/k3/t",
     lambda: (*_qkv(lq=5, lk=90, seed=25), {"alibi_slopes": torch.rand(2, device=DEVICE) * 0.3})),
    ("tma-padded-d40-dv24", "64x16/w4/s1/t", lambda: (*_qkv(lq=20, lk=45, d=40, dv=24, seed=26), {})),
    ("tma-pack-gqa", "16x16/w4/s1/g/t", lambda: (*_qkv(b=2, h=4, hkv=2, lq=7, lk=50, seed=27),
                                                 {"enable_gqa": True, "is_causal": True,
                                                  "causal_alignment": "bottom_right"})),
    ("tma-mask", "64x16/w4/s1/t", lambda: (*_qkv(lq=9, lk=40, seed=28),
                                           {"attn_mask": torch.rand(2, 2, 9, 40, device=DEVICE) < 0.7})),
]


@pytest.mark.parametrize("tag, make", [case[1:] for case in HOPPER_CASES], ids=[case[0] for case in HOPPER_CASES])
def test_tma_forward(tag, make, poison_outputs):
    """The TMA forward (descriptor loads, zero-filled past the sequence) gives the same attention and
    LSE (so gradients) as the plain kernel's."""
    from fatune.kernel.triton.heuristics import INTERPRETER_CONFIG

    q, k, v, kwargs = make()
    config = INTERPRETER_CONFIG.replace(fwd=fatune.LaunchConfig.parse(tag))
    launched = fatune.explain(q, k, v, config=config, **kwargs).launched.fwd
    if DEVICE == "cpu" or torch.cuda.get_device_capability() >= (9, 0):
        assert launched.tma == 1, launched
    run_and_compare(q, k, v, config=config, **kwargs)


def test_tma_packed_varlen(poison_outputs):
    """Packed sequences: descriptors span each sequence's rows, so a 64-row tile of a short sequence
    reads (and stores) none of its neighbour's."""
    from fatune.kernel.triton.heuristics import INTERPRETER_CONFIG

    q, k, v, cu_q, cu_k = _packed([1, 70, 3], [40, 75, 3], 4, 2, 32, 32, seed=29)
    config = INTERPRETER_CONFIG.replace(fwd=fatune.LaunchConfig.parse("64x16/w4/s1/t"))
    run_and_compare(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=70, max_seqlen_k=75,
                    is_causal=True, enable_gqa=True, config=config)


def _problem(q, k, v, **kwargs):
    return fatune.call.check_inputs(q, k, v, **kwargs)


def _tensors(layout="bhld", d=32, dtype=F16, offset=0, packed=False):
    """q, k, v on the CPU (never launched: resolve only reads their layout)."""
    if packed:
        return [torch.empty(40 * d + offset, dtype=dtype)[offset:].view(40, 1, d) for _ in range(3)]
    shape = (2, 2, 24, d)
    if layout == "strided":
        return [torch.empty(*shape[:-1], 2 * d, dtype=dtype)[..., ::2] for _ in range(3)]
    if layout == "blhd":
        return [torch.empty(2, 24, 2, d, dtype=dtype).transpose(1, 2) for _ in range(3)]
    return [torch.empty(2 * 2 * 24 * d + offset, dtype=dtype)[offset:].view(shape) for _ in range(3)]


def _one_head_odd_head_stride(device="cpu"):
    """(2, 1, 29, 36) views whose head stride (36 elements: 72 bytes) TMA cannot use as a stride."""
    return [torch.randn(2, 29, 40, dtype=F16, device=device)[..., :36].unsqueeze(2).transpose(1, 2)
            for _ in range(3)]


TMA_LAYOUTS = [  # (case, tensors, TMA kept in the forward, in dK/dV: its descriptors span every head)
    ("contiguous", lambda: _tensors(), 1),
    ("blhd", lambda: _tensors("blhd"), 1),
    ("float32-d4", lambda: _tensors(d=4, dtype=torch.float32), 1),
    ("non-unit-head-dim-stride", lambda: _tensors("strided"), 0),
    ("row-stride-not-16-bytes", lambda: _tensors(d=59), 0),
    ("base-not-16-bytes", lambda: _tensors(offset=1), 0),
    ("packed", lambda: _tensors(packed=True), 1),
    ("packed-base-not-16-bytes", lambda: _tensors(packed=True, offset=4), 0),
    ("one-head-odd-head-stride", _one_head_odd_head_stride, (1, 0)),
    ("expanded-heads", lambda: [t[:, :1].expand(2, 2, 24, 32) for t in _tensors()], 0),
]


@pytest.mark.parametrize("case, tensors, kept", TMA_LAYOUTS, ids=[case[0] for case in TMA_LAYOUTS])
def test_resolve_keeps_tma_only_for_tensors_tma_can_read(case, tensors, kept, monkeypatch):
    from fatune.kernel.triton import resolve
    from fatune.kernel.triton.heuristics import INTERPRETER_CONFIG

    monkeypatch.setattr(resolve, "tma_available", lambda device: True)
    q, k, v = tensors()
    if case.startswith("packed"):
        cu = torch.tensor([0, 15, 40], dtype=torch.int32)
        problem = _problem(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)
    else:
        problem = _problem(q, k, v)
    config = INTERPRETER_CONFIG.replace(fwd=fatune.LaunchConfig.parse("64x32/w4/s2/t"),
                                        dkdv=fatune.LaunchConfig.parse("32x64/w4/s2/t"))
    resolved = resolve.resolve(config, problem, torch.device("cpu"), (q, k, v))
    assert (resolved.fwd.tma, resolved.dkdv.tma) == (kept if isinstance(kept, tuple) else (kept, kept)), resolved


@pytest.mark.parametrize("arch, interpreting, available", [
    ((8, 0), False, False), ((8, 9), False, False), ((9, 0), False, True), ((10, 0), False, True),
    (None, True, True), (None, False, False)])
def test_tma_needs_hopper_or_the_interpreter(arch, interpreting, available, monkeypatch):
    from fatune import hardware

    monkeypatch.setattr(hardware, "device_arch", lambda device: arch)
    monkeypatch.setattr(hardware, "interpreting", lambda: interpreting)
    assert hardware.tma_available(torch.device("cuda" if arch else "cpu")) == available


@pytest.mark.parametrize("tag, spec_args, launched", [
    ("64x64/w4/s3/t", {}, "64x64/w4/s3/t"),
    ("128x64/w8/s3/t", {"dtype": torch.float32}, "128x64/w8/s3/t"),
    ("64x64/w4/s3/g/t", {"hkv": 1}, "64x64/w4/s3/g/t"),
    ("64x64/w4/s3/g/t", {}, "64x64/w4/s3/t"),  # no groups: no packing
])
def test_resolve_keeps_tma_with_the_other_structure(tag, spec_args, launched, monkeypatch):
    from fatune.kernel.triton import resolve
    from fatune.kernel.triton.heuristics import INTERPRETER_CONFIG

    monkeypatch.setattr(resolve, "tma_available", lambda device: True)
    dtype, hkv = spec_args.get("dtype", F16), spec_args.get("hkv", 2)
    # keys past one tile (a key loop that runs once is not pipelined: test_a_loop_that_runs_once_is_not_pipelined)
    q = torch.empty(2, 2, 200, 32, dtype=dtype)
    k = v = torch.empty(2, hkv, 200, 32, dtype=dtype)
    problem = _problem(q, k, v, enable_gqa=hkv != 2)
    config = INTERPRETER_CONFIG.replace(fwd=fatune.LaunchConfig.parse(tag))
    assert str(resolve.resolve(config, problem, torch.device("cpu"), (q, k, v)).fwd) == launched


def test_direct_launches_pass_global_scratch(monkeypatch):
    """A TMA kernel builds its descriptors in global scratch memory: the direct launch (after the first,
    through Triton) allocates grid * per-program bytes per launch and passes it where binary.run would."""
    from triton.compiler import CompiledKernel
    from triton.runtime import _allocation

    from fatune.kernel.triton import launch, signature

    calls = []

    class Launcher:  # the shape of Triton 3.6's CudaLauncher
        global_scratch_size, global_scratch_align, profile_scratch_size, num_ctas = 384, 128, 0, 1
        launch_cooperative_grid, launch_pdl = False, False

        def launch(self, *args):
            calls.append(args)

    binary = CompiledKernel.__new__(CompiledKernel)
    binary._run, binary.function, binary.packed_metadata = Launcher(), "function", "metadata"

    class Jit:
        def run(self, *args, grid, warmup, num_warps, num_stages):
            calls.append(("triton", grid, warmup))
            return binary

    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(launch, "scratch_buffer", lambda size, *rest: torch.zeros(size, dtype=torch.uint8))
    token = _allocation._allocator.set(_allocation._NULL_ALLOCATOR)
    try:
        values = dict.fromkeys(signature.values("attn_fwd"), 0)
        kernel = launch.KernelLaunch(Jit(), "attn_fwd", (2, 3, 4), fatune.LaunchConfig(64, 64, tma=1), values)
        slots = (None,) * len(launch.SLOTS)
        kernel(slots, stream=5)  # through Triton: the allocator is set for it
        assert not isinstance(_allocation._allocator.get(), _allocation.NullAllocator)
        kernel(slots, stream=5)
    finally:
        _allocation._allocator.reset(token)
    assert calls[:2] == [("triton", (2, 3, 4), True), ("triton", (2, 3, 4), False)]  # built, then launched
    grid, (stream, function, cooperative, pdl, scratch, profile) = calls[2][:3], calls[2][3:9]
    assert (grid, stream, function, cooperative, pdl, profile) == ((2, 3, 4), 5, "function", False, False, None)
    assert scratch.numel() == 384 * 2 * 3 * 4 and calls[2][9] == "metadata"


@pytest.mark.parametrize("maxnreg, options", [(0, {}), (128, {"maxnreg": 128})])
def test_launches_compile_with_the_register_cap(maxnreg, options, monkeypatch):
    """A config's register cap (`/rN`) reaches Triton's compiler with its warps and stages, on the first
    launch (its build, then its launch) and in a compile-only warm-up."""
    import types

    from fatune.kernel.triton import launch, signature

    seen = []

    class Jit:
        def run(self, *args, grid, warmup, **kwargs):
            seen.append(kwargs)
            return types.SimpleNamespace(run=None)  # a compiled kernel, its binary loaded

        def warmup(self, *args, grid, **kwargs):
            seen.append(kwargs)

    monkeypatch.setattr(launch, "interpreting", lambda: False)
    values = dict.fromkeys(signature.values("attn_fwd"), 0)
    kernel = launch.KernelLaunch(Jit(), "attn_fwd", (1, 1, 1), fatune.LaunchConfig(64, 64, 4, 3, maxnreg=maxnreg), values)
    slots = (None,) * len(launch.SLOTS)
    kernel(slots, stream=0)
    kernel.warmup(kernel.pick(slots) + kernel.tail)
    assert seen == [{"num_warps": 4, "num_stages": 3, **options}] * 3


# ------------------------------------------------------------------ dropout

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dropout_matches_reference_with_the_kernels_mask(causal, monkeypatch, poison_outputs):
    seed, p = 1234, 0.25
    monkeypatch.setattr(dropout, "draw_seed", lambda device: torch.tensor([seed], device=device))
    q, k, v = _qkv(lq=45, lk=70, seed=stable_seed("dropout", causal))
    keep = dropout.keep_mask(seed, p, 2, 2, 45, 70, DEVICE)
    run_and_compare(q, k, v, dropout_p=p, is_causal=causal, dropout_keep=keep)


def test_dropout_keep_rate_and_determinism():
    p = 0.3
    keep = dropout.keep_mask(99, p, 1, 2, 256, 256, DEVICE)
    assert abs(keep.float().mean().item() - (1 - p)) < 0.01
    assert torch.equal(keep, dropout.keep_mask(99, p, 1, 2, 256, 256, DEVICE))
    assert not torch.equal(keep, dropout.keep_mask(100, p, 1, 2, 256, 256, DEVICE))
    q, k, v = _qkv(lq=30, lk=30)
    torch.manual_seed(5)
    first = fatune.attention(q, k, v, dropout_p=p)
    torch.manual_seed(5)
    second = fatune.attention(q, k, v, dropout_p=p)
    assert torch.equal(first, second)


# ------------------------------------------------------------------ GPU (pytest -m gpu)

def _gpu_case(name: str, rng: random.Random, dtype: torch.dtype):
    """(q, k, v, kwargs) for one GPU variant case, sizes and masks drawn from rng."""
    b, h, lq, lk, d = 2, 8, rng.randint(300, 1200), rng.randint(300, 1200), rng.choice([64, 128])
    kwargs = {}
    hkv, dv = h, d
    if name == "mask-bool":
        kwargs["attn_mask"] = torch.rand(b, 1, lq, lk, device="cuda") < 0.8
    elif name == "mask-additive":
        kwargs["attn_mask"] = torch.randn(b, h, lq, lk, device="cuda", dtype=dtype)
    elif name == "key-padding":
        kwargs["seqlens_k"] = torch.tensor([rng.randint(0, lk) for _ in range(b)], dtype=torch.int32, device="cuda")
        kwargs["is_causal"] = rng.random() < 0.5
    elif name == "window":
        kwargs["window_size"] = (rng.randint(-1, 300), rng.randint(-1, 300))
    elif name == "causal-bottom-right":
        kwargs.update(is_causal=True, causal_alignment="bottom_right")
    elif name.startswith("gqa-"):
        hkv = h // int(name.split("-")[1])
        kwargs.update(enable_gqa=True, is_causal=True)
    elif name.startswith("head-dim-"):
        d = dv = int(name.split("-")[2])
        kwargs["is_causal"] = True
    elif name == "alibi":
        kwargs.update(alibi_slopes=torch.rand(b, h, device="cuda") * 0.3, is_causal=True)
    torch.manual_seed(rng.randint(0, 2**31))
    q, k, v = random_qkv(b, h, hkv, lq, lk, d, dv, dtype=dtype, device="cuda")
    return q, k, v, kwargs


GPU_CASES = ["mask-bool", "mask-additive", "key-padding", "window", "causal-bottom-right", "gqa-1", "gqa-2", "gqa-8",
             "head-dim-40", "head-dim-80", "head-dim-96", "head-dim-256", "alibi"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", GPU_CASES)
def test_gpu_variant(name, dtype, poison_outputs, record_gpu_errors):
    q, k, v, kwargs = _gpu_case(name, random.Random(stable_seed(name, dtype)), dtype)
    record_gpu_errors(run_and_compare(q, k, v, **kwargs))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim, mask, kwargs", [
    (256, "additive-float32", {}), (256, "bool", {"is_causal": True}), (240, "additive", {}),
    (192, "additive", {"is_causal": True, "alibi": True}), (160, "bool-keys", {})])
def test_gpu_mask_at_large_head_dims(head_dim, mask, kwargs, dtype, poison_outputs, record_gpu_errors):
    """Mask tiles stream beside d > 128 key tiles: the dispatched configs must still fit the GPU's shared memory
    (the heuristic's three-stage d256 forward did not) and pass the accuracy rule."""
    rng = random.Random(stable_seed("large-mask", head_dim, mask, dtype))
    torch.manual_seed(rng.randint(0, 2**31))
    b, h, lq, lk = 2, 4, rng.randint(200, 700), rng.randint(200, 700)
    q, k, v = random_qkv(b, h, h, lq, lk, head_dim, head_dim, dtype=dtype, device="cuda")
    kwargs = dict(kwargs)
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = torch.rand(b, h, device="cuda") * 0.3
    if mask == "bool":
        kwargs["attn_mask"] = torch.rand(b, 1, lq, lk, device="cuda") < 0.8
    elif mask == "bool-keys":  # key padding as a mask: one row for every query
        kwargs["attn_mask"] = torch.arange(lk, device="cuda") < rng.randint(1, lk)
    else:
        kwargs["attn_mask"] = torch.randn(b, h, lq, lk, device="cuda",
                                          dtype=torch.float32 if mask.endswith("float32") else dtype)
    record_gpu_errors(run_and_compare(q, k, v, **kwargs))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim, atomic", [(256, 0), (256, 2), (200, 0), (128, 1), (72, 2)])
def test_gpu_split_d(head_dim, atomic, dtype, poison_outputs, record_gpu_errors):
    """dK/dV's head-dim split on the GPU (wgmma tiles, TMA loads, dQ by the dQ kernel or atomics): odd lengths,
    GQA, causal, padded head dims."""
    rng = random.Random(stable_seed("split-d", head_dim, atomic, dtype))
    torch.manual_seed(rng.randint(0, 2**31))
    q, k, v = random_qkv(2, 8, 2, rng.randint(300, 700), rng.randint(300, 700), head_dim, head_dim, dtype=dtype,
                         device="cuda")
    from fatune.kernel.triton.heuristics import default_config

    config = default_config(fatune.KernelSpec(str(dtype).split(".")[1], head_dim, causal=True),
                            torch.cuda.get_device_capability())
    config = config.replace(dkdv=fatune.LaunchConfig(64, 64, num_warps=4, num_stages=1, tma=1, atomic_dq=atomic,
                                                     split_d=2))
    record_gpu_errors(run_and_compare(q, k, v, is_causal=True, enable_gqa=True, config=config))


@pytest.mark.gpu
@pytest.mark.parametrize("layout, tma", [("bhld", 1), ("strided", 0)])
@pytest.mark.parametrize("head_dim, length, causal", [(20, 1, False), (32, 100, False), (64, 100, False),
                                                      (64, 300, True), (72, 100, False), (128, 65, True)])
def test_gpu_split_d_at_small_head_dims(head_dim, length, causal, layout, tma, poison_outputs, record_gpu_errors):
    """A forced head-dim split with TMA-reduced dQ at 64x64/w4/s1 dK/dV tiles: halves of 16 and 32 lanes gave wrong
    dK (and faulted: random call seed 1067163355), so head dims up to 64 run unsplit; halves of 64 split."""
    torch.manual_seed(stable_seed("narrow-split", head_dim, length, layout))
    q, k, v = random_qkv(1, 2, 2, length, length, head_dim, head_dim, dtype=torch.float16, device="cuda",
                         layout=layout)
    config = fatune.AttentionConfig(fwd=fatune.LaunchConfig(16, 64, num_warps=4, num_stages=1),
                                    dkdv=fatune.LaunchConfig(64, 64, num_warps=4, num_stages=1, tma=tma, atomic_dq=2,
                                                             split_d=2),
                                    dq=fatune.LaunchConfig(64, 32, num_warps=4, num_stages=2))
    record_gpu_errors(run_and_compare(q, k, v, config=config, is_causal=causal))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, head_dim_v, seqlen_q, seqlen_k", [(234, 54, 2, 13), (256, 64, 77, 300),
                                                                     (192, 128, 130, 64), (80, 256, 33, 200)])
def test_gpu_unequal_head_dims_under_gqa(head_dim, head_dim_v, seqlen_q, seqlen_k, poison_outputs, record_gpu_errors):
    """The dispatched configs of query and value head dims far apart, GQA 3:1 (a d234/dv54 call's split dK/dV
    kernel faulted with an illegal address on an H200: fatune.kernel.triton.structure.split_d_runs)."""
    torch.manual_seed(stable_seed("unequal", head_dim, head_dim_v))
    q, k, v = random_qkv(1, 6, 2, seqlen_q, seqlen_k, head_dim, head_dim_v, dtype=torch.float16, device="cuda")
    record_gpu_errors(run_and_compare(q, k, v, enable_gqa=True))


@pytest.mark.gpu
def test_gpu_split_d_with_an_empty_key_sequence(poison_outputs, record_gpu_errors):
    """The split's TMA key and value maps keep one row when a sequence has no keys (seqlens_k 0)."""
    torch.manual_seed(5)
    q, k, v = random_qkv(3, 4, 4, 333, 517, 256, 256, dtype=torch.bfloat16, device="cuda")
    config = fatune.AttentionConfig(fwd=fatune.LaunchConfig(64, 64, num_warps=4, num_stages=3),
                                    dkdv=fatune.LaunchConfig(64, 128, num_warps=8, num_stages=1, tma=1, split_d=2),
                                    dq=fatune.LaunchConfig(128, 64, num_warps=8, num_stages=1))
    seqlens_k = torch.tensor([517, 0, 200], dtype=torch.int32, device="cuda")
    record_gpu_errors(run_and_compare(q, k, v, seqlens_k=seqlens_k, config=config))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_packed_varlen(dtype, poison_outputs, record_gpu_errors):
    rng = random.Random(stable_seed("gpu-varlen", dtype))
    lengths_q = [rng.randint(1, 900) for _ in range(6)]
    lengths_k = [rng.randint(1, 900) for _ in range(6)]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 8, 4, 128, 128, dtype=dtype, seed=rng.randint(0, 99))
    q, k, v = (t.detach().cuda().requires_grad_() for t in (q, k, v))
    record_gpu_errors(run_and_compare(q, k, v, cu_seqlens_q=cu_q.cuda(), cu_seqlens_k=cu_k.cuda(), is_causal=True,
                                      enable_gqa=True))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_dropout(dtype, monkeypatch, poison_outputs, record_gpu_errors):
    seed, p = 4321, 0.2
    monkeypatch.setattr(dropout, "draw_seed", lambda device: torch.tensor([seed], device=device))
    torch.manual_seed(1)
    q, k, v = random_qkv(2, 4, 4, 513, 700, 64, 64, dtype=dtype, device="cuda")
    keep = dropout.keep_mask(seed, p, 2, 4, 513, 700, "cuda")
    assert abs(keep.float().mean().item() - (1 - p)) < 0.01
    record_gpu_errors(run_and_compare(q, k, v, dropout_p=p, is_causal=True, dropout_keep=keep))
    first = fatune.attention(q, k, v, dropout_p=p)
    assert torch.equal(first, fatune.attention(q, k, v, dropout_p=p))


@pytest.mark.serial
@pytest.mark.gpu
@pytest.mark.parametrize("case", ["window-256", "padding-25%"])
def test_gpu_skipped_work_is_not_paid_for(case, monkeypatch, tmp_path):
    """At L=8192 a 256-wide window or 25%-valid keys cost well under the dense time (tiles are skipped). Both sides
    run fatune's own kernels: no DB, whose dense entry may route the call to an SDPA backend."""
    from fatune.runtime.dispatch import Dispatcher
    from fatune.tuning.timing import bench
    from tests.conftest import use_dispatcher

    use_dispatcher(monkeypatch, Dispatcher(user_db=tmp_path / "none.sqlite", shipped=[]))

    q, k, v = random_qkv(2, 16, 16, 8192, 8192, 128, 128, dtype=torch.bfloat16, device="cuda")
    grad_out = torch.randn_like(q)
    if case == "window-256":
        kwargs = {"window_size": (128, 127)}
    else:
        kwargs = {"seqlens_k": torch.full((2,), 8192 // 4, dtype=torch.int32, device="cuda")}

    def step(**extra):
        return lambda: fatune.attention(q, k, v, **extra).backward(grad_out)

    dense = bench(step(), grad_to_none=[q, k, v])
    sparse = bench(step(**kwargs), grad_to_none=[q, k, v])
    print(f"{case}: dense {dense:.3f} ms, {case} {sparse:.3f} ms")
    # 256/8192 = 3% of the keys, but each query tile also walks ~4 masked edge tiles; 25% of the keys
    limit = 0.25 if case == "window-256" else 0.4
    assert sparse < limit * dense, f"{case}: {sparse:.3f} ms is not well under dense {dense:.3f} ms"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["causal-bottom-right", "gqa-8", "key-padding", "window", "head-dim-80",
                                  "head-dim-256", "alibi", "mask-bool"])
def test_gpu_concurrent_dq(name, dtype, poison_outputs, record_gpu_errors):
    """The dQ kernel on a second stream beside the dK/dV kernel (Delta from the pass before both), either
    launched first, against the accuracy rule; then inside a CUDA graph, whose replay gives the same gradients."""
    from fatune.hardware import device_arch
    from fatune.kernel.triton.heuristics import default_config

    q, k, v, kwargs = _gpu_case(name, random.Random(stable_seed("concurrent", name, dtype)), dtype)
    base = default_config(fatune.KernelSpec(str(dtype).split(".")[1], q.shape[-1]), device_arch(q.device))
    base = base.replace(dkdv=dataclasses.replace(base.dkdv, atomic_dq=0))
    from tests.test_custom_op import warm_up_on_a_side_stream

    grad_out = torch.randn(*q.shape[:-1], v.shape[-1], dtype=dtype, device=q.device)
    for kind in (1, 2):  # dQ launched first, dK/dV launched first
        config = base.replace(dq=dataclasses.replace(base.dq, concurrent=kind))
        record_gpu_errors(run_and_compare(q, k, v, config=config, **kwargs))

        def step(config=config):
            return torch.autograd.grad(fatune.attention(q, k, v, config=config, **kwargs), (q, k, v), grad_out)

        eager = step()
        warm_up_on_a_side_stream(step)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        graph.replay()
        torch.cuda.synchronize()
        for grad, got, want in zip(("dq", "dk", "dv"), captured, eager):
            assert torch.equal(got, want), f"concurrent={kind}: {grad}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["causal-bottom-right", "gqa-8", "key-padding", "window", "head-dim-80",
                                  "head-dim-256", "alibi", "mask-bool"])
def test_gpu_atomic_dq(name, dtype, poison_outputs, record_gpu_errors):
    """The atomic-dQ backward on GPU tiles, against the accuracy rule."""
    from fatune.hardware import device_arch
    from fatune.kernel.triton.heuristics import default_config

    q, k, v, kwargs = _gpu_case(name, random.Random(stable_seed("atomic", name, dtype)), dtype)
    base = default_config(fatune.KernelSpec(str(dtype).split(".")[1], q.shape[-1]), device_arch(q.device))
    for kind in (1, 2):  # element atomics, TMA reductions
        config = base.replace(dkdv=dataclasses.replace(base.dkdv, atomic_dq=kind))
        record_gpu_errors(run_and_compare(q, k, v, config=config, **kwargs))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["causal-bottom-right", "gqa-8", "key-padding", "window", "head-dim-80",
                                  "head-dim-256", "alibi", "mask-bool"])
def test_gpu_tma_dkdv(name, dtype, poison_outputs, record_gpu_errors):
    """The dK/dV kernel with TMA query and dO loads (with the dQ kernel, and with TMA-reduced dQ) on GPU
    tiles, against the accuracy rule; dO also in a layout TMA cannot read (the pointer loads then)."""
    from fatune.hardware import device_arch
    from fatune.kernel.triton.heuristics import default_config

    q, k, v, kwargs = _gpu_case(name, random.Random(stable_seed("tma-dkdv", name, dtype)), dtype)
    base = default_config(fatune.KernelSpec(str(dtype).split(".")[1], q.shape[-1]), device_arch(q.device))
    for atomic, grad_layout in ((0, "dense"), (2, "dense"), (0, "every-other-lane")):
        config = base.replace(dkdv=dataclasses.replace(base.dkdv, tma=1, atomic_dq=atomic))
        record_gpu_errors(run_and_compare(q, k, v, config=config, grad_layout=grad_layout, **kwargs))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_deterministic_mode_repeats_the_backward_bit_for_bit(dtype, deterministic_algorithms, poison_outputs,
                                                                record_gpu_errors):
    """The Hopper heuristic adds dQ up atomically at causal d64 (any order); under torch's deterministic mode
    the backward runs the dQ kernel: within the accuracy rule, and the same gradients on every call."""
    torch.manual_seed(stable_seed("deterministic", dtype))
    q, k, v = (torch.randn(2, 8, 1031, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    record_gpu_errors(run_and_compare(q, k, v, is_causal=True))
    grad_out = torch.randn_like(q)
    first, *again = [torch.autograd.grad(fatune.attention(q, k, v, is_causal=True), (q, k, v), grad_out)
                     for _ in range(3)]
    for grads in again:
        assert all(torch.equal(a, b) for a, b in zip(first, grads))


# (case id, batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, num_splits, pack_gqa, seqlens_k or None):
# inference shapes on a long cache, odd split counts, caches filled less than their length, GQA and not
GPU_INFERENCE_CASES = [
    ("decode-7-splits", 4, 32, 8, 1, 4099, 128, 7, 1, None),
    ("decode-cache-fill-auto", 3, 16, 4, 1, 3000, 128, 0, 1, [3000, 17, 1999]),
    ("chunk-causal-5-splits", 2, 16, 4, 77, 2500, 64, 5, 1, [2500, 1200]),
    ("decode-no-gqa-auto", 2, 8, 8, 1, 5000, 64, 0, 0, None),
    ("decode-unpacked-3-splits", 2, 8, 2, 3, 1500, 128, 3, 0, [1500, 1]),
    ("decode-dispatched", 5, 32, 8, 1, 8200, 128, None, None, [8200, 1, 4097, 7000, 8199]),
    ("decode-dispatched-d64", 3, 16, 2, 4, 3001, 64, None, None, None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", GPU_INFERENCE_CASES, ids=lambda c: c[0])
def test_gpu_split_kv(case, dtype, poison_outputs, record_gpu_errors):
    from fatune.hardware import device_arch
    from fatune.kernel.triton.heuristics import default_config

    name, b, h, hkv, lq, lk, d, splits, pack, seqlens = case
    torch.manual_seed(stable_seed(name, dtype))
    q, k, v = random_qkv(b, h, hkv, lq, lk, d, d, dtype=dtype, device="cuda")
    kwargs = {"enable_gqa": h != hkv, "is_causal": lq > 1, "causal_alignment": "bottom_right"}
    if seqlens is not None:
        kwargs["seqlens_k"] = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    config = None  # dispatched: the decode heuristic
    if splits is not None:
        base = default_config(fatune.KernelSpec(str(dtype).split(".")[1], d), device_arch(q.device))
        config = base.replace(fwd=fatune.LaunchConfig(base.fwd.block_m, base.fwd.block_n, base.fwd.num_warps,
                                                      base.fwd.num_stages, num_splits=splits, pack_gqa=pack))
    record_gpu_errors(run_and_compare(q, k, v, config=config, **kwargs))


@pytest.mark.parametrize("batch, seqlen_q, forced, launched", [
    (8, 16, 8, 8),  # small: as asked
    (2**14, 16, 8, 8),  # 2^14 x 16 x 16 x 64 = 2^28 output elements: 8 splits' offsets fit int32
    (2**15, 16, 8, 4),  # 2^29: four fit, the last ending at element 2^31 - 1
    (2**16, 16, 8, 2),
    (2**17, 16, 8, 1),  # 2^31: none can: no split at all
])
def test_key_splits_are_lowered_to_what_the_partials_int32_offsets_address(batch, seqlen_q, forced, launched):
    """A tuned or forced num_splits whose partial results (split, B, H, L_q, D_v) would reach past int32
    offsets costs speed (fewer splits), never a wrong result."""
    from fatune.kernel.layout import MAX_SLICE_OFFSET
    from fatune.kernel.triton import resolve
    from fatune.kernel.triton.heuristics import INTERPRETER_CONFIG

    q = torch.empty(batch, 16, seqlen_q, 64, dtype=F16, device="meta")
    k = v = torch.empty(batch, 16, 4096, 64, dtype=F16, device="meta")
    problem = _problem(q, k, v, check_index_values=False)
    config = INTERPRETER_CONFIG.replace(fwd=dataclasses.replace(INTERPRETER_CONFIG.fwd, num_splits=forced))
    resolved = resolve.resolve(config, problem, torch.device("cpu"), (q, k, v))
    assert resolved.fwd.num_splits == launched
    assert (launched - 1) * batch * 16 * seqlen_q * 64 + batch * 16 * seqlen_q * 64 - 1 <= MAX_SLICE_OFFSET
