"""Does a compiled kernel overlap its tensor-core products with its other work? Read from sm_90 cubins, no GPU.

    python benchmarks/wgmma_census.py [--head-dims 64,128,256] [--dtype bfloat16] [--masks none,causal,bool] > census.md

Each kernel of the Hopper heuristic (forward, dK/dV, dQ; no mask, causal, and with --masks a boolean mask
tensor) is compiled for sm_90 through
`fatune.offline`, and its PTX read for two things: the most groups of asynchronous tensor-core products
(wgmma) any `wgmma.wait_group N` leaves running, and how many exp2 instructions (the softmax) are issued
while a product may still be pending (`fatune.offline.exp2_under_wgmma`, an upper bound over the paths).
FlashAttention-3 and cuDNN run a tile's softmax under the next tile's product; a kernel with no exp2 under a
product runs them one after the other (its products overlap only loads and other products' issue). A
plain TMA matmul compiled the same way is the control: its accumulator chain keeps one product in flight
past a wait (N = 1). Registers, spills and shared memory come with each row.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fatune import offline
from fatune.heuristics import default_config
from fatune.spec import KernelSpec


@triton.jit
def control_matmul(A, B, C, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """C = A B^T tile by tile: the accumulator chain Triton's Hopper pipeliner is built for."""
    a_desc = tl.make_tensor_descriptor(A, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(B, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    acc = tl.zeros([BM, BN], tl.float32)
    for k in tl.range(0, K, BK):
        acc = tl.dot(a_desc.load([tl.program_id(0) * BM, k]), tl.trans(b_desc.load([tl.program_id(1) * BN, k])), acc)
    c_desc = tl.make_tensor_descriptor(C, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    c_desc.store([tl.program_id(0) * BM, tl.program_id(1) * BN], acc.to(tl.bfloat16))


def control_in_flight() -> int:
    signature = {"A": "*bf16", "B": "*bf16", "C": "*bf16", "M": "i32", "N": "i32", "K": "i32",
                 "BM": "constexpr", "BN": "constexpr", "BK": "constexpr"}
    source = ASTSource(fn=control_matmul, signature=signature, constexprs={"BM": 128, "BN": 128, "BK": 64},
                       attrs={(index,): [["tt.divisibility", 16]] for index in range(6)})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 3})
    return offline.wgmma_in_flight(compiled.asm["ptx"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--masks", default="none,causal", help="none, causal, bool (an attn_mask tensor), additive")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("wgmma_census.py compiles for sm_90: unset TRITON_INTERPRET")
    print("| kernel | head dim | mask | config | wgmma | most groups past a wait | exp2 under a product | registers "
          "| spill bytes | shared KiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for head_dim in (int(d) for d in args.head_dims.split(",")):
        for mask in args.masks.split(","):
            tensor = mask in ("bool", "additive")
            spec = KernelSpec(args.dtype, head_dim, causal=mask == "causal", attn_mask=mask if tensor else "none")
            config = default_config(spec, (9, 0))
            config = config.replace(fwd=dataclasses.replace(config.fwd, num_splits=1, pack_gqa=0))  # one plain launch
            for kernel in ("fwd", "dkdv", "dq"):
                info = offline.compile_kernel(kernel, spec, config)
                print(f"| {kernel} | {head_dim} | {mask} | {getattr(config, kernel)} | "
                      f"{'yes' if info.uses_wgmma else 'no'} | {info.wgmma_in_flight} | {info.exp2_under_wgmma} | {info.registers} | "
                      f"{info.spill_bytes} | {info.shared_bytes / 1024:.0f} |", flush=True)
    print(f"| control: TMA matmul 128x128x64/w8/s3 | – | – | – | yes | {control_in_flight()} | – | | | |")


if __name__ == "__main__":
    main()
