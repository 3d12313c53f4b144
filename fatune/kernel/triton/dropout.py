"""Dropout seeds, and the keep-mask the kernels regenerate (materialised for tests/debugging)."""

from __future__ import annotations

import torch
import triton

from fatune.kernel.spec import AttentionConfig, KernelSpec, LaunchConfig
from fatune.kernel.triton import codegen, signature

_UNUSED = AttentionConfig(LaunchConfig(16, 16), LaunchConfig(16, 16), LaunchConfig(16, 16))


def draw_seed(device: torch.device | str) -> torch.Tensor:
    """A Philox seed: a one-element int64 tensor on `device`, drawn from torch's generator there.

    It stays on the device, so a CUDA-graph capture records the draw (every replay gets a
    fresh seed) and no host sync is needed; torch.manual_seed(s) makes dropout repeatable.
    """
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)


def keep_mask(seed: int | torch.Tensor, dropout_p: float, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
              device: torch.device | str) -> torch.Tensor:
    """Bool (B, H, L_q, L_k): True where the attention kernels keep P[b, h, i, j] for this seed.

    Row and column are positions within each sequence (also for packed inputs).
    """
    out = torch.empty(batch, heads, seqlen_q, seqlen_k, dtype=torch.int8, device=device)
    seed_tensor = torch.as_tensor(seed, dtype=torch.int64).reshape(1).to(device)
    values = {"OUT": out, "SEED": seed_tensor, "dropout_p": float(dropout_p), "H": heads, "L_Q": seqlen_q,
              "L_K": seqlen_k, **dict(zip(signature.strides("out", dims="bhqk"), out.stride()))}
    kernel = codegen.load("dropout_mask", KernelSpec("float16", 16, dropout=True), _UNUSED).dropout_mask_kernel
    grid = (triton.cdiv(seqlen_q, 64), triton.cdiv(seqlen_k, 64), batch * heads)
    kernel[grid](*(values[name] for name in signature.PARAMS["dropout_mask_kernel"]))
    return out.bool()
