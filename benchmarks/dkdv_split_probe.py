"""Would splitting the head dim of the d256 dK/dV kernel across two programs pay? A standalone probe (issue 11).

    python benchmarks/dkdv_split_probe.py OUT.json [--lengths 4096] [--head-dim 256]
    TRITON_INTERPRET=1 python benchmarks/dkdv_split_probe.py OUT.json --interpret   # CPU check of the kernel

At d256 the dK/dV kernel's accumulators (dK and dV: 64 keys x 256 floats each) leave no registers for
wgmma-sized tiles: the heuristic's fastest tile runs 32-key `mma.sync` products, and the 64-key tiles that
use wgmma spill (BENCHMARKS.md, session 8). Splitting the head dim in two programs halves the accumulators
(each program owns dK[:, half] and dV[:, half]) at the price of computing S = K Q^T and dP = V dO^T over the
full head dim in both: 1.5x the dK/dV kernel's products. Compiled for sm_90 without a GPU, the split 64-key
tiles use wgmma without spilling (64x64/w8: 196 registers). This probe times one plain dK/dV kernel (no mask,
bf16, TMA loads, not the template's) unsplit and split over a few tiles, against torch's gradients, beside
SDPA's cuDNN backward (its step minus its forward) for scale; the template changes only if the split wins
clearly here.
"""

from __future__ import annotations

import math

import standalone
import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def dkdv_probe(Q, K, V, DO, LSE2, DELTA, DK, DV, L, qk_scale, stride_l,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr):
    """dV = P^T dO, dK = dS^T Q (unscaled) for keys start_n .. + BLOCK_N and head-dim part program_id(1) of
    SPLIT; S and dP always over the full head dim."""
    start_n = tl.program_id(0) * BLOCK_N
    part = tl.program_id(1)
    off = tl.program_id(2).to(tl.int64) * L * stride_l
    DH: tl.constexpr = D // SPLIT
    k = tl.make_tensor_descriptor(K + off, shape=[L, D], strides=[stride_l, 1], block_shape=[BLOCK_N, D]).load([start_n, 0])
    v = tl.make_tensor_descriptor(V + off, shape=[L, D], strides=[stride_l, 1], block_shape=[BLOCK_N, D]).load([start_n, 0])
    q_all = tl.make_tensor_descriptor(Q + off, shape=[L, D], strides=[stride_l, 1], block_shape=[BLOCK_M, D])
    do_all = tl.make_tensor_descriptor(DO + off, shape=[L, D], strides=[stride_l, 1], block_shape=[BLOCK_M, D])
    q_part = tl.make_tensor_descriptor(Q + off, shape=[L, D], strides=[stride_l, 1], block_shape=[BLOCK_M, DH])
    do_part = tl.make_tensor_descriptor(DO + off, shape=[L, D], strides=[stride_l, 1], block_shape=[BLOCK_M, DH])
    dk = tl.zeros([BLOCK_N, DH], tl.float32)
    dv = tl.zeros([BLOCK_N, DH], tl.float32)
    rows_base = tl.program_id(2).to(tl.int64) * L
    for start_m in tl.range(0, L, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        lse2 = tl.load(LSE2 + rows_base + rows)
        delta = tl.load(DELTA + rows_base + rows)
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q_all.load([start_m, 0]))) * qk_scale - lse2[None, :])
        dp_t = tl.dot(v, tl.trans(do_all.load([start_m, 0])))
        do_h = do_part.load([start_m, part * DH])
        dv = tl.dot(p_t.to(do_h.dtype), do_h, dv)
        q_h = q_part.load([start_m, part * DH])
        dk = tl.dot((p_t * (dp_t - delta[None, :])).to(q_h.dtype), q_h, dk)
    dk_out = tl.make_tensor_descriptor(DK + off, shape=[L, D], strides=[stride_l, 1], block_shape=[BLOCK_N, DH])
    dv_out = tl.make_tensor_descriptor(DV + off, shape=[L, D], strides=[stride_l, 1], block_shape=[BLOCK_N, DH])
    dk_out.store([start_n, part * DH], dk.to(DK.dtype.element_ty))
    dv_out.store([start_n, part * DH], dv.to(DV.dtype.element_ty))


TILES = [(64, 32, 4, 1), (32, 64, 4, 2), (64, 64, 4, 1), (64, 64, 8, 1), (64, 64, 8, 2), (64, 128, 8, 1)]


def probe_tile(tile: tuple[int, int, int, int], split: int, flat: list[torch.Tensor], lse2: torch.Tensor,
               delta: torch.Tensor, want: tuple[torch.Tensor, torch.Tensor], scale: float, timed: bool) -> dict:
    """One tile, split or not: its max abs error against torch's dK and dV, and its median time."""
    block_m, block_n, warps, stages = tile
    (batch, heads, length, d), (want_dk, want_dv) = want[0].shape, want
    dk, dv = torch.empty_like(flat[1]), torch.empty_like(flat[2])
    grid = (triton.cdiv(length, block_n), split, batch * heads)

    def run():
        dkdv_probe[grid](*flat, lse2, delta, dk, dv, length, scale * LOG2E, d, block_m, block_n, d, split,
                         num_warps=warps, num_stages=stages)

    row = {"length": length, "head_dim": d, "split": split, "tile": f"{block_m}x{block_n}/w{warps}/s{stages}"}
    try:
        dk.fill_(float("nan"))
        dv.fill_(float("nan"))
        run()
        row["max_err"] = max((dk.reshape(want_dk.shape).float() * scale - want_dk.float()).abs().max().item(),
                             (dv.reshape(want_dv.shape).float() - want_dv.float()).abs().max().item())
        row["ms"] = triton.testing.do_bench(run) if timed else math.nan
    except Exception as error:  # noqa: BLE001 - a tile that does not compile or fit is a row, not an end
        row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
    return row


def cudnn_backward_ms(leaves: list[torch.Tensor], grad_out: torch.Tensor) -> float:
    """SDPA's cuDNN backward alone (forward and backward minus the forward), for scale."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def step(backward: bool):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(*leaves)
            return torch.autograd.grad(out, leaves, grad_out) if backward else out

    return triton.testing.do_bench(lambda: step(True)) - triton.testing.do_bench(lambda: step(False))


def main() -> None:
    args = standalone.arguments(__doc__, lengths="4096", head_dim=256)
    tiles = [(32, 32, 4, 1), (32, 64, 4, 1)] if args.interpret else TILES
    rows = []
    for batch, heads, length, d, device, dtype in standalone.shapes(args, interpreter_head_dim=64):
        q, k, v, do = (torch.randn(batch, heads, length, d, device=device, dtype=dtype) for _ in range(4))
        scale = 1 / math.sqrt(d)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = torch.nn.functional.scaled_dot_product_attention(*leaves)
        out.backward(do)
        lse = torch.logsumexp((q.float() @ k.float().transpose(-1, -2)) * scale, dim=-1)
        delta = (do.float() * out.detach().float()).sum(-1)
        flat = [t.reshape(batch * heads, length, d).contiguous() for t in (q, k, v, do)]
        lse2, delta = (lse * LOG2E).reshape(-1).contiguous(), delta.reshape(-1).contiguous()
        cudnn_ms = math.nan if args.interpret else cudnn_backward_ms(leaves, do)
        for split in (1, 2):
            for tile in tiles:
                row = probe_tile(tile, split, flat, lse2, delta, (leaves[1].grad, leaves[2].grad), scale,
                                 timed=not args.interpret)
                standalone.save(args.out, rows, {**row, "cudnn_backward_ms": cudnn_ms})


if __name__ == "__main__":
    main()
