"""Would a persistent forward with its own tile order pay? A standalone probe (issue 11's last untried lever).

    python benchmarks/persistent_probe.py OUT.json [--lengths 1024,4096,16384] [--head-dim 128]
    TRITON_INTERPRET=1 python benchmarks/persistent_probe.py OUT.json --interpret   # CPU check of the kernels

One plain causal forward (TMA loads, online softmax, the diagonal key tile masked, no other mask; not the
template's), launched two ways with the same inner code: one program per query tile, longest tiles first
(what fatune's forward does), and persistent, a program per multiprocessor (or two) walking the tiles
longest-first across heads or head by head (K/V of one head stay in L2). Every output is checked against
torch's SDPA; times are do_bench medians beside SDPA's cuDNN forward. fatune's template takes a persistent
scheduler only if it wins clearly here.
"""

from __future__ import annotations

import math

import standalone
import torch
import triton
import triton.language as tl

from fatune.dispatch import sm_count

LOG2E = 1.4426950408889634


@triton.jit
def query_tile(q_desc, k_desc, v_desc, o_desc, row0, start_m, qk_scale,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """O for query rows start_m .. + BLOCK_M of the (batch, head) whose rows start at row0: keys 0 .. the
    diagonal, the diagonal's tiles masked."""
    q = q_desc.load([row0 + start_m, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    rows = start_m + tl.arange(0, BLOCK_M)
    for start_n in tl.range(0, start_m + BLOCK_M, BLOCK_N):
        k = k_desc.load([row0 + start_n, 0])
        v = v_desc.load([row0 + start_n, 0])
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if start_n + BLOCK_N > start_m:  # a tile crossing the diagonal
            s = tl.where(rows[:, None] >= start_n + tl.arange(0, BLOCK_N)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    o_desc.store([row0 + start_m, 0], (acc / l_i[:, None]).to(o_desc.dtype))


@triton.jit
def forward_per_tile(Q, K, V, O, L, BH, qk_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """One program per query tile; the longest (last) tiles launch first."""
    q_desc = tl.make_tensor_descriptor(Q, shape=[BH * L, D], strides=[D, 1], block_shape=[BLOCK_M, D])
    k_desc = tl.make_tensor_descriptor(K, shape=[BH * L, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    v_desc = tl.make_tensor_descriptor(V, shape=[BH * L, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    o_desc = tl.make_tensor_descriptor(O, shape=[BH * L, D], strides=[D, 1], block_shape=[BLOCK_M, D])
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    query_tile(q_desc, k_desc, v_desc, o_desc, tl.program_id(1) * L, start_m, qk_scale, BLOCK_M, BLOCK_N, D)


@triton.jit
def forward_persistent(Q, K, V, O, L, BH, qk_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       D: tl.constexpr, HEAD_MAJOR: tl.constexpr):
    """Programs walk the tiles: longest first across heads (HEAD_MAJOR = 0), or head by head, each head's
    longest tile first (HEAD_MAJOR = 1)."""
    q_desc = tl.make_tensor_descriptor(Q, shape=[BH * L, D], strides=[D, 1], block_shape=[BLOCK_M, D])
    k_desc = tl.make_tensor_descriptor(K, shape=[BH * L, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    v_desc = tl.make_tensor_descriptor(V, shape=[BH * L, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    o_desc = tl.make_tensor_descriptor(O, shape=[BH * L, D], strides=[D, 1], block_shape=[BLOCK_M, D])
    tiles_m = tl.cdiv(L, BLOCK_M)
    for tile in tl.range(tl.program_id(0), tiles_m * BH, tl.num_programs(0)):
        if HEAD_MAJOR:
            bh, m = tile // tiles_m, tiles_m - 1 - tile % tiles_m
        else:
            bh, m = tile % BH, tiles_m - 1 - tile // BH
        query_tile(q_desc, k_desc, v_desc, o_desc, bh * L, m * BLOCK_M, qk_scale, BLOCK_M, BLOCK_N, D)


def probe(kind: str, tile: tuple[int, int, int, int], qkv: list[torch.Tensor], want: torch.Tensor, length: int,
          timed: bool, programs_per_sm: int = 1) -> dict:
    """One launch kind and tile: its max abs error against SDPA and its median time."""
    block_m, block_n, warps, stages = tile
    flat = [t.reshape(-1, t.shape[-1]).contiguous() for t in qkv]
    bh, d = want.shape[0] * want.shape[1], want.shape[-1]
    out = torch.empty_like(flat[0])
    qk_scale = LOG2E / math.sqrt(d)
    if kind == "per-tile":
        def run():
            forward_per_tile[(triton.cdiv(length, block_m), bh)](*flat, out, length, bh, qk_scale, block_m, block_n, d,
                                                                  num_warps=warps, num_stages=stages)
    else:
        programs = min(sm_count(want.device) * programs_per_sm, triton.cdiv(length, block_m) * bh)

        def run():
            forward_persistent[(programs,)](*flat, out, length, bh, qk_scale, block_m, block_n, d,
                                            int(kind == "persistent-head-major"), num_warps=warps, num_stages=stages)
    row = {"length": length, "head_dim": d, "kind": kind, "programs_per_sm": programs_per_sm,
           "tile": f"{block_m}x{block_n}/w{warps}/s{stages}"}
    try:
        out.fill_(float("nan"))
        run()
        row["max_err"] = (out.reshape(want.shape).float() - want.float()).abs().max().item()
        row["ms"] = triton.testing.do_bench(run) if timed else math.nan
    except Exception as error:  # noqa: BLE001 - a tile that does not compile or fit is a row, not an end
        row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
    return row


TILES = [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2)]


def cudnn_forward_ms(qkv: list[torch.Tensor]) -> float:
    """SDPA's cuDNN causal forward, for scale."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(*qkv, is_causal=True))


def main() -> None:
    args = standalone.arguments(__doc__, lengths="1024,4096,16384", head_dim=128)
    tiles = [(32, 32, 4, 1), (32, 16, 4, 1)] if args.interpret else TILES
    rows = []
    for batch, heads, length, d, device, dtype in standalone.shapes(args, interpreter_head_dim=32):
        qkv = [torch.randn(batch, heads, length, d, device=device, dtype=dtype) for _ in range(3)]
        want = torch.nn.functional.scaled_dot_product_attention(*qkv, is_causal=True)
        cudnn_ms = math.nan if args.interpret else cudnn_forward_ms(qkv)
        for tile in tiles:
            for kind, per_sm in (("per-tile", 1), ("persistent-longest-first", 1), ("persistent-longest-first", 2),
                                 ("persistent-head-major", 1), ("persistent-head-major", 2)):
                row = probe(kind, tile, qkv, want, length, not args.interpret, per_sm)
                standalone.save(args.out, rows, {**row, "cudnn_ms": cudnn_ms})


if __name__ == "__main__":
    main()
