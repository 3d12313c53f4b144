"""Backward structure on the GPU: separate dK/dV and dQ kernels vs atomic dQ (element atomics or TMA
reductions), over a set of tiles.

    python benchmarks/bwd_variants.py OUT.json [--lengths 4096] [--head-dims 64,128,256] [--dtype bfloat16]
        [--kernels dkdv,dq] [--atomic] [--tma] [--split]

For each shape (B·L = 16384 tokens, H·D = 2048, causal and not) candidate configs of the dK/dV
kernel (with --atomic also with atomic dQ, both kinds; with --tma also with TMA query and dO loads; with
--split the SPLIT_TILES, TMA loads, each with and without the head-dim split, with atomic dQ by TMA
reductions or not; the dQ kernel from the heuristic) and of the dQ kernel
(with the heuristic's dK/dV tile) are run besides the heuristic, compiled ahead
in a process pool, checked against torch SDPA's gradients, and timed as the whole backward
(`KernelRunner.run("bwd")`, do_bench median, L2 flushed). The backward of SDPA's cuDNN and
flash backends is timed beside it (training step minus forward). Prints a table per shape and
writes every measurement to OUT.json.
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
from fatune.spec import AttentionConfig, LaunchConfig

TILES = {  # (block_m, block_n, num_warps, num_stages) of the dK/dV kernel, per head-dim class
    64: [(32, 128, 4, 3), (64, 128, 8, 2), (64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 4, 2), (16, 128, 4, 3),
         (128, 128, 8, 2), (64, 64, 4, 2)],
    128: [(64, 64, 4, 2), (32, 64, 4, 3), (64, 128, 8, 2), (32, 128, 8, 2), (64, 128, 4, 2), (16, 64, 4, 3),
          (32, 128, 4, 2), (64, 64, 8, 2), (128, 128, 8, 1)],
    256: [(16, 64, 4, 1), (32, 64, 4, 1), (32, 64, 8, 1), (16, 32, 4, 1), (64, 64, 8, 1), (16, 128, 8, 1),
          (32, 128, 8, 1), (64, 32, 4, 1),
          # no spills compiled for sm_90 (fatune.offline, session 7), not yet timed
          (64, 32, 8, 1), (64, 32, 8, 2), (128, 32, 8, 1), (128, 16, 8, 1), (64, 16, 4, 1), (32, 32, 4, 1)],
}


SPLIT_TILES = {  # dK/dV tiles for --split: the head-dim split halves the accumulators, so wider tiles fit
    128: [(64, 64, 4, 2), (64, 128, 8, 2), (64, 128, 4, 2), (128, 64, 8, 2), (128, 128, 8, 1), (32, 128, 4, 2)],
    256: [(64, 64, 4, 1), (64, 64, 8, 1), (64, 32, 4, 1), (32, 64, 4, 1), (64, 128, 8, 1), (128, 64, 8, 1),
          (64, 64, 4, 2), (32, 128, 4, 1)],
}


DQ_TILES = {  # (block_m, block_n, num_warps, num_stages) of the dQ kernel
    64: [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 8, 3), (64, 128, 8, 2), (128, 128, 8, 2)],
    128: [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 8, 3), (64, 32, 4, 3), (128, 64, 8, 2)],
    256: [(64, 32, 4, 1), (64, 32, 8, 1), (32, 32, 4, 1), (64, 64, 8, 1), (32, 64, 4, 1), (128, 32, 8, 1),
          (64, 16, 4, 1), (32, 64, 8, 1), (64, 32, 4, 2), (128, 64, 8, 1),
          (128, 32, 8, 2), (32, 32, 4, 2)],  # no spills for sm_90 (session 7), not yet timed
}


def shapes(lengths: list[int], head_dims: list[int], dtype: str) -> list[Shape]:
    out = []
    for d in head_dims:
        for length in lengths:
            for causal in (False, True):
                out.append(Shape(batch=max(1, 16384 // length), heads=2048 // d, seqlen_q=length, seqlen_k=length,
                                 head_dim=d, dtype=dtype, causal=causal))
    return out


def candidates(shape: Shape, kernels: str, atomic: bool, tma: bool = False, split: bool = False) -> list[AttentionConfig]:
    base = default_config(shape.spec, torch.cuda.get_device_capability())
    lanes = min(t for t in TILES if t >= shape.head_dim)
    configs = [base]
    if split:
        for m, n, w, s in SPLIT_TILES.get(lanes, []):
            for atomic_dq in ((0, 2) if atomic else (0,)):
                for split_d in (1, 2):
                    configs.append(base.replace(dkdv=LaunchConfig(m, n, num_warps=w, num_stages=s, tma=1,
                                                                  atomic_dq=atomic_dq, split_d=split_d)))
    elif "dkdv" in kernels:
        for m, n, w, s in TILES[lanes]:
            for atomic_dq in ((0, 1, 2) if atomic else (0,)):
                for loads in ((0, 1) if tma else (0,)):
                    configs.append(base.replace(dkdv=LaunchConfig(m, n, num_warps=w, num_stages=s, tma=loads,
                                                                  atomic_dq=atomic_dq)))
    if "dq" in kernels:
        dkdv = dataclasses.replace(base.dkdv, atomic_dq=0)  # the heuristic's tile, with a dQ kernel to vary
        for m, n, w, s in DQ_TILES[lanes]:
            configs.append(base.replace(dkdv=dkdv, dq=LaunchConfig(m, n, num_warps=w, num_stages=s)))
    return list(dict.fromkeys(configs))


def sdpa_backward_ms(shape: Shape, inputs: dict, backend) -> float:
    from torch.nn.attention import sdpa_kernel

    q, k, v, grad_out = inputs["q"], inputs["k"], inputs["v"], inputs["do"]
    try:
        with sdpa_kernel(backend):
            def forward():
                with torch.no_grad():
                    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)

            def step():
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=shape.causal).backward(grad_out)

            step()
            return bench(step, grad_to_none=[q, k, v]) - bench(forward)
    except RuntimeError:
        return math.nan


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--lengths", default="4096")
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kernels", default="dkdv", help="which configs to vary: dkdv, dq or dkdv,dq")
    parser.add_argument("--atomic", action="store_true", help="also try each dK/dV tile with atomic dQ")
    parser.add_argument("--tma", action="store_true", help="also try each dK/dV tile with TMA query and dO loads")
    parser.add_argument("--split", action="store_true", help="SPLIT_TILES with and without the head-dim split")
    args = parser.parse_args()
    from torch.nn.attention import SDPBackend

    todo = shapes([int(x) for x in args.lengths.split(",")], [int(x) for x in args.head_dims.split(",")], args.dtype)
    plan = [(shape, config) for shape in todo for config in candidates(shape, args.kernels, args.atomic, args.tma, args.split)]
    started = time.time()
    with CompilePool(min(16, os.cpu_count() or 1)) as pool:
        futures = [pool.submit(shape, config, "dkdv") for shape, config in plan]
        errors = [compile_error(future) for future in futures]
    print(f"compiled {len(plan)} backward configs in {time.time() - started:.1f} s", flush=True)
    results = []
    for shape in todo:
        inputs = make_inputs(shape, "cuda")
        q, k, v = (inputs[name].detach().clone().requires_grad_() for name in ("q", "k", "v"))
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=shape.causal).backward(inputs["do"])
        reference = {"grad_q": q.grad, "grad_k": k.grad, "grad_v": v.grad}
        flops = shape.flops("bwd")
        row = {"shape": shape.label(), "head_dim": shape.head_dim, "causal": shape.causal,
               "seqlen": shape.seqlen_q, "configs": []}
        for backend, name in ((SDPBackend.CUDNN_ATTENTION, "sdpa-cudnn"), (SDPBackend.FLASH_ATTENTION, "sdpa-flash")):
            row[name + "_ms"] = sdpa_backward_ms(shape, inputs, backend)
        for (config_shape, config), error in zip(plan, errors):
            if config_shape is not shape:
                continue
            entry = {"dkdv": str(config.dkdv), "dq": str(config.dq), "atomic_dq": config.dkdv.atomic_dq}
            if error:
                entry["error"] = error
            else:
                try:
                    runner = KernelRunner(shape, config, inputs)
                    runner.prepare()
                    for name in reference:
                        getattr(runner.args, name).fill_(float("nan"))
                    run = runner.run("bwd")
                    run()
                    torch.cuda.synchronize()
                    entry["max_rel_error"] = max(
                        float(((getattr(runner.args, name).float() - ref.float()).abs().max()
                               / ref.float().abs().max()).item()) for name, ref in reference.items())
                    entry["ms"] = bench(run)
                    entry["tflops"] = flops / entry["ms"] / 1e9
                except Exception as error:  # noqa: BLE001
                    entry["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
            row["configs"].append(entry)
        results.append(row)
        timed = [c for c in row["configs"] if "ms" in c and c["max_rel_error"] < 0.05]
        print(f"\n{row['shape']}: backward ms  cuDNN {row['sdpa-cudnn_ms']:.3f}  flash {row['sdpa-flash_ms']:.3f}")
        for c in sorted(timed, key=lambda c: c["ms"])[:10] + [row["configs"][0]]:
            print(f"  {c['dkdv']:>22} dq {c['dq']:>14}  {c.get('ms', math.nan):7.3f} ms "
                  f"{c.get('tflops', 0):6.1f} TFLOP/s  err {c.get('max_rel_error', math.nan):.2e} {c.get('error', '')}")
        for c in row["configs"]:
            if "error" in c:
                print(f"  {c['dkdv']:>22} FAILED {c['error']}")
        sys.stdout.flush()
        with open(args.out, "w") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
