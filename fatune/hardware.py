"""The GPU facts fatune reads, in one place: compute capability, multiprocessors, name, shared memory, TMA.

Each is read once per device. The Triton interpreter (CPU tensors) answers as a GPU-less target: no
capability, 4 multiprocessors (so that CPU tests exercise key splits), TMA emulated.
"""

from __future__ import annotations

import functools

import torch

from fatune.settings import interpreting

Arch = tuple[int, int]
INTERPRETER_SMS = 4
HOPPER_SHARED_MEMORY_PER_BLOCK = 227 * 1024  # sm_90's opt-in limit, where torch does not report it


@functools.lru_cache(maxsize=None)
def device_arch(device: torch.device) -> Arch | None:
    """Compute capability of a CUDA device; None for the Triton interpreter on CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


@functools.cache
def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (INTERPRETER_SMS for the interpreter)."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def device_identity(device: torch.device) -> tuple[str, str]:
    """(GPU name, 'major.minor') as the tuned DB records them."""
    if device.type != "cuda":
        return "triton-interpreter", "cpu"
    props = torch.cuda.get_device_properties(device)
    return props.name, f"{props.major}.{props.minor}"


@functools.lru_cache(maxsize=None)
def shared_memory_per_block(device: torch.device) -> int | None:
    """Bytes of shared memory one block may use on a CUDA device (opt-in limit); None for the interpreter."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", None) or HOPPER_SHARED_MEMORY_PER_BLOCK)


def tma_available(device: torch.device) -> bool:
    """Whether kernels on `device` can use TMA: Hopper (sm_90) and newer, or Triton's interpreter."""
    arch = device_arch(device)
    return arch >= (9, 0) if arch is not None else interpreting()
