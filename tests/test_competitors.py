"""The competitors fatune is benchmarked against describe the same attention as fatune's shape."""

from __future__ import annotations

import pytest
import torch

from fatune import competitors
from fatune.measure import Shape, make_inputs


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
