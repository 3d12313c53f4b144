"""The Gluon backward's group split against one program per key tile, the Triton backward and cuDNN: a training
step (forward + backward through autograd) of GQA shapes, bf16, H·D = 2048, random inputs, one process.

    python benchmarks/group_split.py [--parts 1,2,4,8] [--out results.csv]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import fatune
from fatune.bench.results import write_csv
from fatune.kernel.gluon.family import default_backward
from fatune.kernel.triton.heuristics import default_config

SHAPES = [  # batch, query heads, K/V heads, length, head dim, causal
    (2, 16, 2, 8192, 128, True), (2, 16, 2, 8192, 128, False), (8, 16, 2, 2048, 128, True),
    (2, 32, 4, 8192, 64, True), (2, 8, 1, 8192, 256, True)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="1,2,4,8")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    rows = []
    for batch, heads, kv_heads, length, dim, causal in SHAPES:
        torch.manual_seed(0)
        q = torch.randn(batch, heads, length, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(batch, kv_heads, length, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
        grad = torch.randn_like(q)
        spec = fatune.explain(q, k, v, is_causal=causal, enable_gqa=True).spec
        triton_config = default_config(spec, (9, 0), group=heads // kv_heads)
        # float32 without the L x L matrix (float64 needs it), each K/V head repeated for its query heads
        group = heads // kv_heads
        q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))  # float32 gradients
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            reference = [t.double() for t in torch.autograd.grad(F.scaled_dot_product_attention(
                q32, k32.repeat_interleave(group, 1), v32.repeat_interleave(group, 1), is_causal=causal),
                (q32, k32, v32), grad.float())]
        del q32, k32, v32

        def step(call):
            return lambda: torch.autograd.grad(call(), (q, k, v), grad)

        candidates = {"triton": step(lambda: fatune.attention(q, k, v, is_causal=causal, enable_gqa=True,
                                                                config=triton_config))}
        for parts in map(int, args.parts.split(",")):
            config = triton_config.replace(dkdv=dataclasses.replace(default_backward(spec), group_split=parts))
            candidates[f"gluon-g{parts}"] = step(lambda config=config: fatune.attention(  # never the Triton one
                q, k, v, is_causal=causal, enable_gqa=True, config=config, strict=True))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        candidates["cudnn"] = step(cudnn)
        for name, run in candidates.items():
            errors = [(g.double() - r).abs().max().item() for g, r in zip(run(), reference)]
            ms = triton.testing.do_bench(run, warmup=30, rep=200)
            rows.append({"shape": f"b{batch} h{heads}/{kv_heads} L{length} d{dim}{' causal' if causal else ''}",
                         "impl": name, "step_ms": round(ms, 3), "max_grad_error": f"{max(errors):.2e}"})
            print(rows[-1], flush=True)
    if args.out:
        write_csv(Path(args.out), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
