"""Shape's work count (fatune.tuning.timing): the FLOPs every TFLOP/s figure and tuned-DB throughput divide by."""

from __future__ import annotations

import itertools

import pytest

from fatune.tuning.shape import Shape, window_pairs


def pairs_by_rows(seqlen_q: int, seqlen_k: int, window: int) -> int:
    """Row by row: query i sees keys i + (Lk - Lq) - window .. i + (Lk - Lq) that exist."""
    offset, total = seqlen_k - seqlen_q, 0
    for row in range(seqlen_q):
        last = min(row + offset, seqlen_k - 1)
        first = max(row + offset - window, 0)
        total += max(0, last - first + 1)
    return total


@pytest.mark.parametrize("seqlen_q, seqlen_k, window", list(itertools.product(
    (1, 5, 16, 33), (1, 7, 16, 40), (0, 1, 3, 15, 39, 100))))
def test_window_pairs_counts_every_kept_query_key_pair(seqlen_q, seqlen_k, window):
    assert window_pairs(seqlen_q, seqlen_k, window) == pairs_by_rows(seqlen_q, seqlen_k, window)


@pytest.mark.parametrize("shape, pairs_per_head", [
    (Shape(2, 4, 64, 64, 16, "float16"), 2 * 64 * 64),
    (Shape(2, 4, 64, 64, 16, "float16", causal=True), 2 * 64 * 64 / 2),  # the convention: half the square
    (Shape(2, 4, 64, 64, 16, "float16", causal=True, window=8), 2 * pairs_by_rows(64, 64, 8)),
    (Shape(2, 4, 64, 64, 16, "float16", window=8), 2 * pairs_by_rows(64, 64, 8)),  # window (8, 0): same band
    (Shape(1, 4, 32, 96, 16, "float16", causal=True, window=40), pairs_by_rows(32, 96, 40)),
    (Shape(1, 4, 64, 64, 16, "float16", causal=True, window=1000), pairs_by_rows(64, 64, 1000)),  # ~ causal
    (Shape(1, 4, 64, 64, 16, "float16", causal=True, window=8, documents=3),
     sum(pairs_by_rows(n, n, 8) for n in Shape(1, 4, 64, 64, 16, "float16", documents=3).document_lengths())),
    (Shape(2, 4, 64, 64, 16, "float16", valid_keys=0.5), 2 * 64 * 32),
    (Shape(2, 4, 64, 64, 16, "float16", causal=True, valid_keys=0.25), 2 * sum(min(i + 1, 16) for i in range(64))),
    (Shape(2, 4, 10, 64, 16, "float16", causal=True, valid_keys=0.5), 2 * sum(min(i + 1, 32) for i in range(10))),
    (Shape(2, 4, 64, 64, 16, "float16", causal=True, window=8, valid_keys=0.5), 2 * pairs_by_rows(64, 32, 8)),
])
def test_flops_count_the_pairs_the_kernels_compute(shape, pairs_per_head):
    forward = 2.0 * pairs_per_head * shape.heads * (shape.head_dim + shape.head_dim_v)
    assert shape.flops("fwd") == pytest.approx(forward)
    assert shape.flops() == pytest.approx(3.5 * forward)
    assert shape.flops("bwd") == pytest.approx(2.5 * forward)


@pytest.mark.parametrize("shape", [
    Shape(2, 2, 64, 64, 16, "float16", causal=True, window=8),
    Shape(2, 2, 40, 96, 16, "float16", causal=True, window=20),
    Shape(2, 2, 96, 40, 16, "float16", window=7),
    Shape(2, 2, 64, 64, 16, "float16", causal=True, valid_keys=0.25),
    Shape(2, 2, 64, 64, 16, "float16", causal=True, window=12, valid_keys=0.5),
    Shape(2, 2, 64, 64, 16, "float16", valid_keys=0.5),
    Shape(2, 2, 64, 64, 16, "float16", causal=True, window=500),  # dropped: the causal mask, bottom-right
])
def test_flops_match_the_pairs_the_reference_keeps(shape):
    """The count agrees with the mask fatune's float64 reference applies (fatune.kernel.reference.visible)."""
    import torch

    from fatune.call import check_inputs
    from fatune.kernel.reference import visible

    sizes = shape.input_sizes()
    q, k, v = (torch.empty(sizes[name], dtype=torch.float16) for name in "qkv")
    problem = check_inputs(q, k, v, **shape.attention_kwargs("cpu"))
    limit = problem.seqlens_k if problem.seqlens_k is not None else shape.seqlen_k
    kept = int(visible(problem, shape.seqlen_q, shape.seqlen_k, limit, torch.device("cpu")).expand(
        shape.batch, 1, shape.seqlen_q, shape.seqlen_k).sum())
    per_pair = 2.0 * shape.heads * (shape.head_dim + shape.head_dim_v)
    if shape.causal and shape.window < 0 and shape.valid_keys == 1:
        kept = shape.batch * shape.seqlen_q * shape.seqlen_k / 2  # the convention: half the square
    assert shape.flops("fwd") == pytest.approx(kept * per_pair)
