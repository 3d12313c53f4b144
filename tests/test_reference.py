"""The accuracy rule itself (tests/reference.py): what it lets through and what it stops."""

from __future__ import annotations

import pytest
import torch

from tests.reference import check_close, rounding_error


@pytest.mark.parametrize("dtype, magnitude, unit", [
    (torch.float16, 2.8554643505574, 2.0 ** -9),
    (torch.float16, 0.75, 2.0 ** -11),
    (torch.bfloat16, 1.0, 2.0 ** -7),
    (torch.bfloat16, -300.0, 2.0 ** 1),
    (torch.float32, 3.0, 2.0 ** -22),
    (torch.float16, 0.0, 0.0),
])
def test_the_floor_is_one_unit_in_the_last_place_at_the_largest_magnitude(dtype, magnitude, unit):
    golden = torch.tensor([magnitude / 3, magnitude], dtype=torch.float64)
    assert rounding_error(golden, dtype) == unit


@pytest.mark.parametrize("units, passes", [(0, True), (1, True), (3, False), (8, False)])
def test_an_answer_a_unit_off_passes_where_pytorch_is_exact_and_more_does_not(units, passes):
    golden = torch.tensor([2.8554643505574, -0.4, 1.7], dtype=torch.float64)
    exact = golden.half()  # PyTorch's own answer at its best: exactly rounded
    step = torch.finfo(torch.float16).eps * 2.0  # fp16's step in [2, 4)
    actual = exact.clone()
    actual[0] = (exact[0].double() + units * step).half()
    if passes:
        check_close("out", actual, golden, exact)
    else:
        with pytest.raises(AssertionError, match="max abs error"):
            check_close("out", actual, golden, exact)
