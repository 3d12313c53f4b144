"""One template change timed on issue 12's cases: fatune's training step with templates from other folders.

    python benchmarks/template_variants.py OUT.json --variant NAME=DIR [--variant NAME=DIR ...]
        [--only "window,padding"] [--lengths 8192] [--configs "fwd F, dkdv K, dq Q; ..."]

Each variant (a folder holding a full set of templates, e.g. the last commit's beside the working tree's)
runs in a process of its own: first all variants compile every case's kernels in parallel, then each is timed
in turn (do_bench median of the step, GPU time per kernel), so no two timings overlap. Cases are
masked_cases.py's (bf16, D = 128, H = 16); each step's output is checked against the first variant's.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
from pathlib import Path


def run_variant(name: str, folder: str, args: argparse.Namespace, compile_only: bool) -> dict:
    import torch

    import fatune
    from fatune import codegen
    from fatune.measure import bench, kernel_times

    codegen.template_dir = lambda: Path(folder).resolve()  # before anything renders (both are read lazily)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from masked_cases import cases, mask_configs, step_once

    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        for case in cases(length, False, 16):
            if not any(part in case["name"] for part in args.only.split(",")) or "attn_mask" in case["fatune"]:
                continue
            torch.manual_seed(0)
            b, hkv = case["batch"], case["kv_heads"]
            q = torch.randn(b, 16, length, 128, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(b, hkv, length, 128, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(b, hkv, length, 128, device="cuda", dtype=torch.bfloat16)
            grad_out = torch.randn_like(q)
            if case.get("packed"):
                q, k, v, grad_out = (t[0].transpose(0, 1).contiguous() for t in (q, k, v, grad_out))
            leaves = [t.requires_grad_() for t in (q, k, v)]
            for config in [None, *mask_configs(args.configs)]:
                run = functools.partial(fatune.attention, config=config, **case["fatune"])
                step = functools.partial(step_once, run, leaves, grad_out)
                step()
                torch.cuda.synchronize()
                row = {"variant": name, "case": case["name"], "L": length, "config": str(config) if config else
                       str(fatune.explain(*leaves, **case["fatune"]).decision.config)}
                if not compile_only:
                    row["fwd_bwd_ms"] = bench(step, grad_to_none=leaves)
                    row["kernels_us"] = kernel_times(step)
                    step()
                    row["grads"] = [t.grad.flatten()[::97].float().cpu() for t in leaves]  # a sample, to compare
                rows.append(row)
    return {"rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--variant", action="append", required=True, help="NAME=DIR (a templates folder)")
    parser.add_argument("--only", default="window,padding,packed documents,formula")
    parser.add_argument("--lengths", default="8192")
    parser.add_argument("--configs", default="")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    variants = dict(item.split("=", 1) for item in args.variant)
    if args.child:  # one variant, in its own process
        import torch

        result = run_variant(args.child, variants[args.child], args, args.compile_only)
        if not args.compile_only:
            torch.save(result, args.out)
        return
    base = [sys.executable, __file__, "--only", args.only, "--lengths", args.lengths, "--configs", args.configs,
            *(f"--variant={item}" for item in args.variant)]
    compiling = [subprocess.Popen([*base, "--child", name, "--compile-only", os.devnull]) for name in variants]
    for process in compiling:
        process.wait()
    import torch

    results = {}
    for name in variants:
        part = f"{args.out}.{name}.pt"
        subprocess.run([*base, "--child", name, part], check=False)
        results[name] = torch.load(part)["rows"] if os.path.exists(part) else []
    first = next(iter(results))
    reference = [row["grads"] for row in results[first]]
    table = []
    for name, rows in results.items():
        for row, ref in zip(rows, reference):
            diff = max(float((g - r).abs().max()) for g, r in zip(row.pop("grads"), ref))
            table.append({**row, "max_grad_diff_vs_" + first: diff})
    for row in table:
        kernels = ", ".join(f"{kernel[:14]} {us:.0f}" for kernel, us in row["kernels_us"].items())
        print(f"{row['variant']:>8} {row['case']:>26} L={row['L']:<6} {row['fwd_bwd_ms']:.3f} ms "
              f"(grad diff {row['max_grad_diff_vs_' + first]:.2e}) {row['config']}: {kernels}", flush=True)
    with open(args.out, "w") as file:
        json.dump(table, file, indent=1)


if __name__ == "__main__":
    main()
