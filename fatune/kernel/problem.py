"""AttentionProblem: one call as the kernels see it, validated (fatune.call builds it from the arguments).

The kernel spec (what to compute), the sizes and run-time scalars, and the optional mask and length
tensors. It is the one problem type: the dispatcher keys the tuned DB by it, the plans launch it, the
search and the benchmarks make it from their shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fatune.kernel.spec import KernelSpec

# the optional tensors of a call, in the one order the kernels take them (fatune.kernel.triton.signature's
# pointers MASK, ALIBI, CU_Q, CU_K, SEQLENS_K, BLOCK_TABLE) and a call hands them on (its "extras")
OPTIONAL_TENSORS = ("attn_mask", "alibi_slopes", "cu_seqlens_q", "cu_seqlens_k", "seqlens_k", "block_table")
NO_EXTRAS = (None,) * len(OPTIONAL_TENSORS)


@dataclass(eq=False)
class AttentionProblem:
    """One validated call: kernel spec, run-time sizes and scalars, optional tensors."""

    spec: KernelSpec
    batch: int  # sequences: B, or len(cu_seqlens_q) - 1 when packed
    heads: int
    kv_heads: int
    seqlen_q: int  # rows of the query tensor (total tokens when packed)
    seqlen_k: int
    max_seqlen_q: int
    max_seqlen_k: int
    scale: float
    window_left: int = 0
    window_right: int = 0
    dropout_p: float = 0.0
    attn_mask: torch.Tensor | None = field(default=None, repr=False)  # 4-d broadcast view
    alibi_slopes: torch.Tensor | None = field(default=None, repr=False)  # (B, H) view
    seqlens_k: torch.Tensor | None = field(default=None, repr=False)
    cu_seqlens_q: torch.Tensor | None = field(default=None, repr=False)
    cu_seqlens_k: torch.Tensor | None = field(default=None, repr=False)
    block_table: torch.Tensor | None = field(default=None, repr=False)  # (B, pages per sequence) int32

    @property
    def group_size(self) -> int:
        return self.heads // self.kv_heads if self.kv_heads else 1

    @property
    def packed(self) -> bool:
        return self.cu_seqlens_q is not None
