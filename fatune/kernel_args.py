"""Everything one launch of the generated kernels needs, gathered once per call.

The generated `launch` functions unpack these groups in the kernels' argument order:
tensors, then `pointers` (optional inputs: mask, ALiBi slopes, cu_seqlens_q/k, seqlens_k),
then `scalars`, then each tensor's strides. Optional inputs that a variant does not use
are passed as a dummy pointer the kernel never reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _strides(tensor: torch.Tensor | None, count: int) -> tuple[int, ...]:
    return tuple(tensor.stride()) if tensor is not None else (0,) * count


@dataclass
class KernelArgs:
    """Tensors as (B, H, L, D) views (packed varlen: (1, H, total, D)), plus launch scalars."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor  # (B, H, L_q) float32; (1, H, total_q) for varlen
    batch: int  # sequences (grid z): B, or len(cu_seqlens) - 1
    max_seqlen_q: int
    max_seqlen_k: int
    sm_scale: float
    window_left: int = 0
    window_right: int = 0
    dropout_p: float = 0.0
    seed: int = 0
    mask: torch.Tensor | None = None  # 4-d, broadcast by strides; bool masks viewed as uint8
    alibi: torch.Tensor | None = None  # (B, H) view, stride 0 over a broadcast batch
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    seqlens_k: torch.Tensor | None = None
    grad_out: torch.Tensor | None = None
    delta: torch.Tensor | None = None
    grad_q: torch.Tensor | None = None
    grad_k: torch.Tensor | None = None
    grad_v: torch.Tensor | None = None

    @property
    def heads(self) -> int:
        return self.q.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def seqlen_q(self) -> int:
        """Rows of the query tensor (L_Q)."""
        return self.q.shape[2]

    @property
    def pointers(self) -> tuple:
        dummy = self.lse
        return tuple(t if t is not None else dummy
                     for t in (self.mask, self.alibi, self.cu_seqlens_q, self.cu_seqlens_k, self.seqlens_k))

    @property
    def scalars(self) -> tuple:
        return (self.sm_scale, self.window_left, self.window_right, self.dropout_p, self.seed,
                self.heads, self.heads // self.kv_heads, self.q.shape[2], self.k.shape[2])

    def _sequence_strides(self, tensor: torch.Tensor | None) -> tuple[int, ...]:
        """(b, h, l, d) strides; packed sequences share the one (1, H, total, D) view: batch stride 0."""
        strides = _strides(tensor, 4)
        return (0,) + strides[1:] if self.cu_seqlens_q is not None else strides

    q_strides = property(lambda self: self._sequence_strides(self.q))
    k_strides = property(lambda self: self._sequence_strides(self.k))
    v_strides = property(lambda self: self._sequence_strides(self.v))
    out_strides = property(lambda self: self._sequence_strides(self.out))
    grad_out_strides = property(lambda self: self._sequence_strides(self.grad_out))
    grad_q_strides = property(lambda self: self._sequence_strides(self.grad_q))
    grad_k_strides = property(lambda self: self._sequence_strides(self.grad_k))
    grad_v_strides = property(lambda self: self._sequence_strides(self.grad_v))
    mask_strides = property(lambda self: _strides(self.mask, 4))
    alibi_strides = property(lambda self: _strides(self.alibi, 2))

    @property
    def lse_strides(self) -> tuple[int, int]:
        """Batch and head strides of lse/delta (whose rows are contiguous); batch stride 0 when packed."""
        return (0 if self.cu_seqlens_q is not None else self.lse.stride(0)), self.lse.stride(1)
