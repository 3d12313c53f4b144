"""Compile the heuristic's kernels offline for a GPU, over a random sample of call kinds, and check each
against the GPU's shared memory and fatune.resources' estimate (no GPU needed: fatune.offline).

    python3 benchmarks/shared_memory_census.py OUT.json [--arch 9.0] [--specs 60] [--seed 0] [--jobs 2]

Every config a launch can make of the heuristic's (fatune.launch.resolutions: key splits, TMA kept or dropped,
atomic dQ lowered; decode and GQA variants too) is compiled once per kernel, additive masks as float32 (the
widest). A kernel over the limit is a call that fails on that GPU; one over its estimate is an estimate to fix.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from concurrent.futures import ProcessPoolExecutor

HEAD_DIMS = [(16, 16), (40, 24), (64, 64), (72, 72), (80, 80), (96, 96), (128, 128), (160, 160), (192, 128),
             (192, 192), (234, 54), (256, 256), (256, 64), (2, 1)]
VARIANTS = [{}, {"causal": True}, {"causal": True, "window_left": True, "bottom_right": True},
            {"attn_mask": "bool"}, {"attn_mask": "additive"}, {"causal": True, "alibi": True},
            {"dropout": True}, {"seqlens": "varlen", "causal": True, "bottom_right": True},
            {"seqlens": "seqlens_k", "causal": True, "bottom_right": True},
            {"attn_mask": "additive", "alibi": True, "dropout": True, "causal": True}]


def draw(rng: random.Random) -> dict:
    d, dv = rng.choice(HEAD_DIMS)
    return {"spec": {"dtype": rng.choice(["float16", "bfloat16", "float32"]), "head_dim": d, "head_dim_v": dv,
                     **rng.choice(VARIANTS)},
            "decode": rng.random() < 0.25, "shares_sms": rng.random() < 0.5, "group": rng.choice([1, 1, 4, 8])}


def census(case: dict, arch: tuple[int, int]) -> list[dict]:
    from fatune import offline
    from fatune.heuristics import default_config
    from fatune.launch import resolutions
    from fatune.resources import shared_memory_bytes, shared_memory_limit
    from fatune.spec import KERNELS, KernelSpec

    spec = KernelSpec(**case["spec"])
    config = default_config(spec, arch, case["decode"], case["shares_sms"], case["group"])
    limit, rows, seen = shared_memory_limit(arch), [], set()
    for resolved in resolutions(config, spec, case["group"] > 1):
        for kernel in KERNELS:
            launch = getattr(resolved, kernel)
            if (kernel, launch) in seen:
                continue
            seen.add((kernel, launch))
            row = {"spec": str(spec), "kernel": kernel, "config": str(launch), "limit": limit,
                   "estimate": shared_memory_bytes(kernel, spec, launch, arch)}
            try:
                row["shared"] = offline.compile_kernel(kernel, spec, resolved, arch=arch, mask_dtype="fp32").shared_bytes
            except Exception as error:  # noqa: BLE001 - reported, the census goes on
                row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--arch", default="9.0")
    parser.add_argument("--specs", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    arch = tuple(int(part) for part in args.arch.split("."))
    rng = random.Random(args.seed)
    cases = [draw(rng) for _ in range(args.specs)]
    rows = []
    with ProcessPoolExecutor(args.jobs) as pool:
        for result in pool.map(census, cases, [arch] * len(cases)):
            rows += result
    with open(args.out, "w") as handle:
        json.dump(rows, handle, indent=1)
    over = [r for r in rows if r.get("shared", 0) > r["limit"]]
    under = [r for r in rows if r.get("shared", 0) > r["estimate"]]
    failed = [r for r in rows if "error" in r]
    print(f"{len(rows)} kernels of {len(cases)} call kinds on sm_{arch[0]}{arch[1]}: {len(over)} over the "
          f"{rows[0]['limit'] if rows else 0}-byte limit, {len(under)} over their estimate, {len(failed)} failed to compile")
    for label, group in (("over the limit", over), ("over the estimate", under), ("failed", failed)):
        for row in group:
            print(f"{label}: {row['kernel']} {row['config']} {row.get('shared', row.get('error'))} "
                  f"(estimate {row['estimate']}) {row['spec']}")


if __name__ == "__main__":
    main()
