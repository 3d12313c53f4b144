"""Gluon operations Triton 3.6 builds but does not expose in Python, for the generated kernels."""

from __future__ import annotations

from triton._C.libtriton import ir
from triton.experimental.gluon.language._core import builtin


@builtin
def tma_reduce_add(desc, coord, src, _semantic=None):
    """Add the shared-memory tile `src` into the global tile of `desc` at `coord` (a TMA bulk reduction,
    cp.reduce.async.bulk.tensor .add): rows and lanes past the tensor's ends are dropped. Completes like a TMA
    store (tma.store_wait)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, coord, src.handle)
