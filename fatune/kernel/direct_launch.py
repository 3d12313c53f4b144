"""Launching a compiled Triton kernel through Triton's C launcher, without the JIT's per-call Python.

`JITFunction.run` binds the arguments, works out their specialisation (each integer's value 1 or
divisibility by 16, each pointer's 16-byte alignment), looks the binary up, and then calls the C
launcher, which asks the driver about every pointer. Where the caller already knows every value
the specialisation depends on, the binary can be kept and its launcher called directly: fatune's
attention plans do (fatune.kernel.triton.launch.KernelLaunch), and `CachedJit` does it for small helper kernels
(the mask spans' scans), keyed on exactly what Triton specialises on.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from triton import knobs
from triton.compiler import CompiledKernel

RUNTIME = knobs.runtime
ALIGNMENT = 16  # bytes: Triton specialises a pointer argument on data_ptr() % 16 == 0


def hooks_active() -> bool:
    """Whether Triton's launch hooks (a profiler's) are set: launches then go through Triton, which calls them."""
    return bool(RUNTIME.launch_enter_hook.calls or RUNTIME.launch_exit_hook.calls)


def direct_launcher(binary: CompiledKernel) -> tuple[Callable, tuple, int] | None:
    """Triton's C launch function, the arguments it takes between the stream and the kernel's own,
    and the global scratch bytes each program needs (0 for most kernels).

    That is what `binary.run(...)` ends in, minus a Python frame that repacks the arguments;
    only on launchers of that shape (Triton 3.4+ on CUDA) and for kernels without profiler
    scratch; None otherwise, and the launch goes through `binary.run`. The global scratch
    (where TMA kernels build their tensor descriptors) sits at index 3 of the middle
    arguments: its caller allocates it per launch, as `binary.run` does through Triton's
    allocator.
    """
    launcher = binary.run
    names = ("launch", "launch_cooperative_grid", "launch_pdl", "global_scratch_size", "profile_scratch_size",
             "num_ctas")
    if not all(hasattr(launcher, name) for name in names) or launcher.profile_scratch_size:
        return None
    return launcher.launch, (binary.function, launcher.launch_cooperative_grid, launcher.launch_pdl, None, None,
                             binary.packed_metadata, None, None, None), \
        launcher.global_scratch_size * launcher.num_ctas


def current_stream(device_index: int) -> int:
    """The raw handle of a CUDA device's current stream, as Triton's own launch reads it."""
    return torch._C._cuda_getCurrentRawStream(device_index)


class CachedJit:
    """A jitted kernel launched through Triton once per specialisation (compiling it), then directly.

    The kernel's parameters are its pointers first (tensors), then the rest in order, constexprs included
    (the tail). The key is the pointers' dtypes and 16-byte alignment, the tail's exact values (more than
    Triton's ==1 / %16 test, so one key never covers two binaries), the device and the warps: a kept
    binary is exactly what Triton would have picked. Kernels that need global scratch, launches with
    Triton's launch hooks set and interpreted runs go through Triton every time."""

    MAX_BINARIES = 512  # kept specialisations: a process calling with ever new shapes starts afresh past it

    def __init__(self, fn: Any):
        self.fn = fn
        self.binaries: dict[tuple, tuple[Callable, tuple] | None] = {}

    def __call__(self, grid: tuple[int, int, int], pointers: Sequence[torch.Tensor], tail: tuple,
                 device: torch.device, num_warps: int) -> None:
        """Launch on `device` (a CUDA device: the current one) in its current stream."""
        addresses = [tensor.data_ptr() for tensor in pointers]
        key = (device.index, num_warps, tail, *[tensor.dtype for tensor in pointers],
               *[address % ALIGNMENT == 0 for address in addresses])
        direct = self.binaries.get(key)
        if direct is None or hooks_active():
            binary = self.fn[grid](*pointers, *tail, num_warps=num_warps)
            if key not in self.binaries:
                if len(self.binaries) >= self.MAX_BINARIES:
                    self.binaries.clear()
                found = direct_launcher(binary) if isinstance(binary, CompiledKernel) else None
                self.binaries[key] = found[:2] if found is not None and not found[2] else None
            return
        launch, middle = direct
        launch(*grid, current_stream(device.index), *middle, *addresses, *tail)
