"""Sweep the forward's launch configs on decode shapes (the evidence behind heuristics._decode_forward).

Run on the GPU from the repository root: `python3 benchmarks/decode_sweep.py OUT.json`. For each
decode shape of fatune.bench.INFERENCE_SHAPES, every config of a small grid (16-row tiles, key tile,
warps, stages, split count relative to the automatic choice, TMA loads) is timed forward-only through
fatune.attention with the config forced (median of triton.testing.do_bench), outputs checked against
the automatic config's. Prints the best configs per shape, and how the built-in heuristic ranks.
"""

from __future__ import annotations

import functools
import itertools
import json
import sys

import torch

import fatune
from fatune.bench import INFERENCE_SHAPES
from fatune.dispatch import device_arch
from fatune.heuristics import default_config
from fatune.dispatch import sm_count
from fatune.launch import choose_splits
from fatune.measure import bench, kernel_times
from fatune.spec import DTYPES, MAX_SPLITS, KernelSpec, LaunchConfig


def main(path: str) -> None:
    results = []
    device = torch.device("cuda")
    for shape in (s for s in INFERENCE_SHAPES if s.seqlen_q == 1):
        dtype = DTYPES[shape.dtype]
        q, k, v = (torch.randn(shape.batch, h, n, shape.head_dim, device=device, dtype=dtype)
                   for h, n in ((shape.heads, 1), (shape.kv_heads, shape.seqlen_k), (shape.kv_heads, shape.seqlen_k)))
        heuristic = default_config(KernelSpec(shape.dtype, shape.head_dim), device_arch(device), decode=True)
        with torch.no_grad():
            reference = fatune.attention(q, k, v, enable_gqa=True, config=heuristic).float()
        rows = []
        for block_n, warps, stages, factor, tma in itertools.product((64, 128), (4,), (2, 3, 4), (1, 2, 4), (0, 1)):
            programs = shape.kv_heads * shape.batch
            splits = min(MAX_SPLITS, max(1, round(factor * choose_splits(programs, shape.seqlen_k // block_n,
                                                                         sm_count(device)))))
            config = heuristic.replace(fwd=LaunchConfig(16, block_n, warps, stages, num_splits=splits, pack_gqa=1,
                                                        tma=tma))
            row = {"shape": shape.label, "config": str(config.fwd)}
            try:
                with torch.no_grad():
                    out = fatune.attention(q, k, v, enable_gqa=True, config=config)
                    row["max_abs_diff"] = (out.float() - reference).abs().max().item()
                    row["us"] = bench(lambda: fatune.attention(q, k, v, enable_gqa=True, config=config)) * 1e3
            except Exception as error:  # out of resources: reported, not fatal
                row["error"] = f"{type(error).__name__}: {str(error)[:100]}"
            rows.append(row)
        with torch.no_grad():
            heuristic_us = bench(lambda: fatune.attention(q, k, v, enable_gqa=True, config=heuristic)) * 1e3
        kernels = kernel_times(functools.partial(fatune.attention, q, k, v, enable_gqa=True, config=heuristic))
        timed = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        print(f"{shape.label}: heuristic {heuristic.fwd} {heuristic_us:.1f} us; best:")
        print("   heuristic's kernels (profiler, us per call): " +
              ", ".join(f"{name} {us:.1f}" for name, us in kernels.items()))
        for row in timed[:5]:
            print(f"   {row['config']:24} {row['us']:7.1f} us  ({shape.cache_bytes() / row['us'] / 1e6:.2f} TB/s)")
        results.append({"shape": shape.label, "heuristic": str(heuristic.fwd), "heuristic_us": heuristic_us,
                         "heuristic_kernels_us": kernels, "rows": rows})
    with open(path, "w") as handle:
        json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
