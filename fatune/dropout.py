"""Dropout seeds, and the keep-mask the kernels regenerate (materialised for tests/debugging)."""

from __future__ import annotations

import torch

from fatune import codegen
from fatune.spec import AttentionConfig, KernelSpec, LaunchConfig

_UNUSED = AttentionConfig(LaunchConfig(16, 16), LaunchConfig(16, 16), LaunchConfig(16, 16))


def draw_seed() -> int:
    """A Philox seed from torch's default CPU generator: torch.manual_seed(s) makes dropout repeatable."""
    return int(torch.randint(0, 2**62, (1,)).item())


def keep_mask(seed: int, dropout_p: float, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
              device: torch.device | str) -> torch.Tensor:
    """Bool (B, H, L_q, L_k): True where the attention kernels keep P[b, h, i, j] for this seed.

    Row and column are positions within each sequence (also for packed inputs).
    """
    out = torch.empty(batch, heads, seqlen_q, seqlen_k, dtype=torch.int8, device=device)
    spec = KernelSpec("float16", 16, dropout=True)
    codegen.load("dropout_mask", spec, _UNUSED).launch(out, seed, dropout_p)
    return out.bool()
