"""Choose the launch config for a call: explicit argument, then heuristic default."""

from __future__ import annotations

import functools
import os

import torch

from fatune.heuristics import Arch, default_config
from fatune.inputs import AttentionProblem
from fatune.spec import AttentionConfig


@functools.lru_cache(maxsize=None)
def device_arch(device: torch.device) -> Arch | None:
    """Compute capability of a CUDA device; None for the Triton interpreter on CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def choose_config(problem: AttentionProblem, device: torch.device, config: AttentionConfig | None) -> AttentionConfig:
    """The config to launch `problem` with on `device`."""
    if config is not None:
        if not isinstance(config, AttentionConfig):
            raise TypeError(f"config: expected a fatune.AttentionConfig or None, got {type(config).__name__}")
        return config
    return default_config(problem.spec, device_arch(device))
