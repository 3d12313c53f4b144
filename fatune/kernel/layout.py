"""Memory layouts of the tensors a call's kernels write, and the int32 limit on offsets inside one slice.

Outputs and gradients take their input's dim order, so no call copies a tensor into a layout of its own;
offsets inside one (batch, head) slice are int32 in the kernels, so a layout whose rows lie too far apart
is refused by name (fatune.call) or, for outputs, laid out with its rows together.
"""

from __future__ import annotations

from typing import Sequence


def layout_like(shape: Sequence[int], strides: Sequence[int], last_dim: int | None = None
                ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, strides) of a dense buffer shaped like a tensor (last dim replaced by `last_dim`)
    whose dims lie in memory in the tensor's order, the last dim innermost.

    Outputs and gradients take their input's layout, so a (B, L, H, D) tensor viewed as
    (B, H, L, D) gets a gradient that is a free view of (B, L, H, D) memory too. Where that
    layout would put rows too far apart for the kernels' int32 slice offsets (a stride-0 or
    (B, L, H, D) input of very many rows), the rows go next to each other instead.
    """
    shape = list(shape)
    if last_dim is not None:
        shape[-1] = last_dim
    row_dim = 0 if len(shape) == 3 else len(shape) - 2  # packed (total, H, D) or (..., L, D)
    outer = sorted(range(len(shape) - 1), key=lambda i: -strides[i])
    out_strides = _dense_strides(shape, outer + [len(shape) - 1])
    if slice_offset(shape, out_strides, row_dim) > MAX_SLICE_OFFSET:
        rows_inner = [i for i in outer if i != row_dim] + [row_dim, len(shape) - 1]
        out_strides = _dense_strides(shape, rows_inner)
    return tuple(shape), out_strides


def _dense_strides(shape: Sequence[int], order: Sequence[int]) -> tuple[int, ...]:
    """Strides of a dense buffer whose dims lie in memory in `order`, outermost first."""
    out_strides = [0] * len(shape)
    step = 1
    for dim in reversed(order):
        out_strides[dim] = step
        step *= max(shape[dim], 1)
    return tuple(out_strides)


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def bhld_strides(strides: Sequence[int], packed: bool) -> tuple[int, ...]:
    """The kernels' (b, h, l, d) strides: a packed (total, H, D) tensor is one (1, H, total, D) sequence."""
    return (0, strides[1], strides[0], strides[2]) if packed else tuple(strides)


# Element offsets inside one (batch, head) slice of a tensor (row x row stride + column x column stride, a packed
# sequence's first row included) are int32 in the kernels; batch, head and page offsets are int64.
MAX_SLICE_OFFSET = 2**31 - 1


def slice_offset(shape: Sequence[int], strides: Sequence[int], row_dim: int) -> int:
    """The largest element offset the kernels compute inside one (batch, head) slice of a tensor of this shape
    and strides: its last row's last column (0 for an empty tensor)."""
    if 0 in shape:
        return 0
    return (shape[row_dim] - 1) * strides[row_dim] + (shape[-1] - 1) * strides[-1]
