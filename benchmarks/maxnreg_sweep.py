"""Would capping registers per thread (`LaunchConfig.maxnreg`, `/rN`) pay? A sweep on the heuristic's kernels.

    python benchmarks/maxnreg_sweep.py OUT.json [--lengths 4096] [--head-dims 64,128,256] [--caps 96,128,168,192]
    TRITON_INTERPRET=1 python benchmarks/maxnreg_sweep.py OUT.json --interpret   # CPU check of the harness

Register use sets how many programs share a multiprocessor where shared memory allows more: compiled for
sm_90 (`fatune.offline`), the d64 forward holds 182 registers x 256 threads (one program per SM by
registers, three by shared memory) and fits two at a cap of 128 with 24 bytes spilled; its dQ kernel fits
two at 128 with 0-16 bytes spilled. For each shape (bf16, B·L = 16384, H·D = 2048, causal and not) the heuristic
config is timed as is and with each cap on one kernel at a time (forward: the forward's time; dK/dV or dQ:
the whole backward's), every output checked against torch SDPA. Prints a table per shape, writes every
measurement to OUT.json. A cap becomes a searched value only if it wins clearly here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import torch

from fatune.heuristics import default_config
from fatune.measure import KernelRunner, Shape, bench, make_inputs
from fatune.precompile import CompilePool, compile_error
from fatune.spec import AttentionConfig

KERNELS = ("fwd", "dkdv", "dq")


def shapes(lengths: list[int], head_dims: list[int], interpret: bool = False) -> list[Shape]:
    if interpret:  # the interpreter ignores the cap: one small float16 shape checks the harness
        return [Shape(batch=1, heads=2, seqlen_q=40, seqlen_k=40, head_dim=32, dtype="float16", causal=True)]
    return [Shape(batch=max(1, 16384 // length), heads=2048 // d, seqlen_q=length, seqlen_k=length, head_dim=d,
                  dtype="bfloat16", causal=causal)
            for d in head_dims for length in lengths for causal in (False, True)]


def candidates(base: AttentionConfig, caps: list[int]) -> list[tuple[str, int, AttentionConfig]]:
    """(kernel, cap, config): the base config without caps (the heuristic caps d64's dQ: session 9), then each
    kernel with each cap, the others uncapped."""
    base = base.replace(**{kernel: dataclasses.replace(getattr(base, kernel), maxnreg=0) for kernel in KERNELS})
    out = [("none", 0, base)]
    for kernel in KERNELS:
        for cap in caps:
            out.append((kernel, cap, base.replace(**{kernel: dataclasses.replace(getattr(base, kernel), maxnreg=cap)})))
    return out


def max_error(runner: KernelRunner, reference: dict[str, torch.Tensor], names: tuple[str, ...]) -> float:
    return max(float(((getattr(runner.args, name).float() - reference[name].float()).abs().max()
                      / reference[name].float().abs().max()).item()) for name in names)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--lengths", default="4096")
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--caps", default="96,128,168,192")
    parser.add_argument("--interpret", action="store_true", help="Triton's interpreter on the CPU: one float16 "
                        "shape, errors only, no timing")
    args = parser.parse_args()
    caps = [int(x) for x in args.caps.split(",")]
    todo = shapes([int(x) for x in args.lengths.split(",")], [int(x) for x in args.head_dims.split(",")],
                  args.interpret)
    device = "cpu" if args.interpret else "cuda"
    capability = None if args.interpret else torch.cuda.get_device_capability()
    timed = bench if not args.interpret else (lambda run: math.nan)
    plan = [(shape, kernel, cap, config) for shape in todo
            for kernel, cap, config in candidates(default_config(shape.spec, capability), caps)]
    started = time.time()
    with CompilePool(0 if args.interpret else min(16, os.cpu_count() or 1), device) as pool:
        futures = [pool.submit(shape, config, "fwd" if kernel == "fwd" else "dkdv") for shape, kernel, cap, config in plan]
        errors = [compile_error(future) for future in futures]
    print(f"compiled {len(plan)} configs in {time.time() - started:.1f} s", flush=True)
    results = []
    for shape in todo:
        inputs = make_inputs(shape, device)
        q, k, v = (inputs[name].detach().clone().requires_grad_() for name in ("q", "k", "v"))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)
        out.backward(inputs["do"])
        reference = {"out": out.detach(), "grad_q": q.grad, "grad_k": k.grad, "grad_v": v.grad}
        row = {"shape": shape.label(), "head_dim": shape.head_dim, "causal": shape.causal, "seqlen": shape.seqlen_q,
               "configs": []}
        for (config_shape, kernel, cap, config), error in zip(plan, errors):
            if config_shape is not shape:
                continue
            entry = {"kernel": kernel, "maxnreg": cap, "config": str(config)}
            if error:
                entry["error"] = error
            else:
                try:
                    runner = KernelRunner(shape, config, inputs)
                    runner.prepare()
                    for phase, names in (("fwd", ("out",)), ("bwd", ("grad_q", "grad_k", "grad_v"))):
                        for name in names:
                            getattr(runner.args, name).fill_(float("nan"))
                        run = runner.run(phase)
                        run()
                        if device == "cuda":
                            torch.cuda.synchronize()
                        entry[f"{phase}_error"] = max_error(runner, reference, names)
                        entry[f"{phase}_ms"] = timed(run)
                except Exception as failure:  # noqa: BLE001 - a failing variant is a row, not the end
                    entry["error"] = f"{type(failure).__name__}: {str(failure).splitlines()[0][:160]}"
            row["configs"].append(entry)
        results.append(row)
        base = row["configs"][0]
        print(f"\n{row['shape']}: {base['config']}  fwd {base.get('fwd_ms', math.nan):.3f} ms  "
              f"bwd {base.get('bwd_ms', math.nan):.3f} ms")
        for c in row["configs"][1:]:
            phase = "fwd" if c["kernel"] == "fwd" else "bwd"
            ms, ok = c.get(f"{phase}_ms", math.nan), c.get(f"{phase}_error", math.nan) < 0.05
            print(f"  {c['kernel']:>4} /r{c['maxnreg']:<4} {phase} {ms:7.3f} ms  "
                  f"{ms / base.get(f'{phase}_ms', math.nan):6.3f}x  {'' if ok else 'WRONG '}{c.get('error', '')[:80]}")
        sys.stdout.flush()
        with open(args.out, "w") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
