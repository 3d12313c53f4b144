"""The competitors fatune is benchmarked against describe the same attention as fatune's shape."""

from __future__ import annotations

import pytest
import torch

from fatune.tuning import competitors
from fatune.tuning.shape import Shape, make_inputs


@pytest.mark.parametrize("shape", [
    Shape(1, 4, 96, 96, 16, "float32", causal=True, kv_heads=2, documents=3),  # documents of 60, 25, 11 tokens
])
def test_flex_packed_documents_match_sdpa_per_document(shape):
    """Flex's document mask over the (tokens, H, D) inputs equals SDPA on each document (forward; Flex has
    no CPU backward)."""
    inputs = {name: tensor.detach() for name, tensor in make_inputs(shape, "cpu").items()}
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    expected = competitors.sdpa_default(shape)(q, k, v)
    actual = competitors.flex(shape, "cpu")(q, k, v)
    assert actual.shape == q.shape
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert competitors.sdpa("cudnn", shape) is None  # no SDPA call takes packed documents


@pytest.mark.parametrize("shape", [
    Shape(1, 2, 24, 40, 16, "float32", causal=True),  # top-left: SDPA's is_causal
    Shape(1, 2, 24, 40, 16, "float32", causal=True, bottom_right=True),
    Shape(1, 2, 40, 24, 16, "float32", causal=True, bottom_right=True),  # early rows see no key
    Shape(2, 2, 32, 48, 16, "float32", causal=True, window=8),
    Shape(2, 2, 32, 32, 16, "float32", valid_keys=0.5),
], ids=str)
def test_sdpa_and_flex_compute_the_shapes_attention(shape):
    """SDPA (a mask where is_causal cannot say it) and Flex describe the attention fatune computes for `shape`."""
    import fatune

    inputs = {name: tensor.detach() for name, tensor in make_inputs(shape, "cpu").items()}
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    expected = fatune.attention(q, k, v, **shape.attention_kwargs("cpu"))
    got = competitors.sdpa_default(shape)(q, k, v)
    mask = competitors.dense_mask(shape, "cpu")
    if mask is not None:  # rows that see no key: SDPA answers NaN, fatune and Flex 0
        got = torch.where(mask.any(-1, keepdim=True), got, 0.0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(competitors.flex(shape, "cpu")(q, k, v), expected, rtol=1e-5, atol=1e-5)
