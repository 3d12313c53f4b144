"""Triton 3.6's interpreter (TRITON_INTERPRET=1), made to compute as a GPU does where fatune's kernels need it.

This is how CPU tests and CPU calls run the real generated kernels: the gaps patched here would otherwise
give wrong numbers without an error (bfloat16 products, roundings) or fail (TMA reductions).
"""

from __future__ import annotations

import threading


_patching = threading.Lock()  # two threads' first calls patch once, not twice (two launch locks would not exclude)


def patch_interpreter() -> None:
    """Fill two gaps of Triton 3.6's interpreter that the kernels meet, once per process.

    - `tl.dot` on bfloat16: the interpreter stores bfloat16 as uint16 bit patterns and multiplies those
      (results near 1e9 where the true ones are near 1); the operands are widened to float32 first, the
      products a tensor core makes from bfloat16 inputs.
    - float32 to bfloat16: the interpreter truncates, a bias every rounded P carries the same way (a GPU rounds
      to nearest even, as this patch does).
    - `tl.fma` on float32: the interpreter rounds the product and then the sum; a GPU's FMA rounds once.
    - TMA reductions (`tensor_descriptor.atomic_add`, which the TMA-dQ backward uses): the same adds,
      element by element.
    - Launches from several threads: the interpreter keeps one grid and one program id per process and patches
      triton.language for each launch, so launches that overlap fail or compute with another's grid; they run
      one at a time.
    """
    with _patching:
        _patch()


def _patch() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_fatune_patched", False):
        return
    ir = interpreter._ir
    dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 in (a.dtype.scalar, b.dtype.scalar):
            a, b = (interpreter.TensorHandle(
                interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32), tl.float32)
                if x.dtype.scalar == tl.bfloat16 else x for x in (a, b))
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def create_descriptor_reduce(self, kind, desc, value, indices):
        if kind != ir.DESCRIPTOR_REDUCE_KIND.ADD:
            raise NotImplementedError(f"TMA reduction {kind} in Triton's interpreter (fatune emulates ADD only)")
        pointers, mask = desc.materialize_pointers(indices)
        op = ir.ATOMIC_OP.FADD if np.issubdtype(value.data.dtype, np.floating) else ir.ATOMIC_OP.ADD
        return self.create_atomic_rmw(op, pointers, value, mask, ir.MEM_SEMANTIC.RELAXED, None)

    cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return cast(self, src, dst_type)
        bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # to nearest, ties to even
        nan = np.isnan(src.data)
        rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)  # a quiet NaN, its sign kept
        return interpreter.TensorHandle(rounded, tl.bfloat16)

    def create_fma(self, x, y, z):
        if z.data.dtype != np.float32:
            return interpreter.TensorHandle(x.data * y.data + z.data, z.dtype.scalar)
        exact = x.data.astype(np.float64) * y.data.astype(np.float64) + z.data.astype(np.float64)
        return interpreter.TensorHandle(exact.astype(np.float32), z.dtype.scalar)

    launch = interpreter.GridExecutor.__call__
    one_at_a_time = threading.RLock()

    def call(self, *args, **kwargs):
        with one_at_a_time:
            return launch(self, *args, **kwargs)

    interpreter.GridExecutor.__call__ = call
    builder.create_dot = create_dot
    builder.create_fma = create_fma
    builder.cast_impl = cast_impl
    if not hasattr(builder, "create_descriptor_reduce"):
        builder.create_descriptor_reduce = create_descriptor_reduce
    builder._fatune_patched = True
