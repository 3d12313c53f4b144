"""A compiled training step: torch.compile (inductor, fullgraph) of fatune.attention with what the dispatcher picks
(the shipped DB: a route where it measured an SDPA backend faster), of SDPA, and of fatune's own kernels (the
dispatcher's config passed as `config=`, which is never routed). Forward + backward through autograd, bf16,
B·L = 16384, H·D = 2048, random inputs, one process; compile time excluded.

    python benchmarks/compiled_step.py [--head-dims 64,128] [--lengths 1024,4096,16384] [--out results.csv]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

import fatune
from fatune.bench.results import write_csv


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    rows = []
    for dim in map(int, args.head_dims.split(",")):
        for causal in (False, True):
            for length in map(int, args.lengths.split(",")):
                batch, heads = 16384 // length, 2048 // dim
                torch.manual_seed(0)
                q, k, v = (torch.randn(batch, heads, length, dim, device="cuda", dtype=torch.bfloat16,
                                       requires_grad=True) for _ in range(3))
                grad = torch.randn_like(q)
                config = fatune.explain(q, k, v, is_causal=causal).decision.config
                calls = {"fatune": lambda q, k, v: fatune.attention(q, k, v, is_causal=causal),
                         "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                         "fatune-kernels": lambda q, k, v: fatune.attention(q, k, v, is_causal=causal, config=config)}
                flops = 4 * batch * heads * length * length * dim * 3.5 / (2 if causal else 1)
                for name, call in calls.items():
                    torch._dynamo.reset()
                    compiled = torch.compile(call, fullgraph=True)

                    def step():
                        return torch.autograd.grad(compiled(q, k, v), (q, k, v), grad)

                    step()  # compiles
                    ms = triton.testing.do_bench(step, warmup=50, rep=300, return_mode="median")
                    rows.append({"head_dim": dim, "causal": causal, "L": length, "B": batch, "H": heads,
                                 "impl": name, "step_ms": round(ms, 3), "step_tflops": round(flops / ms / 1e9, 1)})
                    print(rows[-1], flush=True)
    if args.out:
        write_csv(Path(args.out), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
