"""Probe (issues 11, 12): does the backward gain from running its dQ kernel beside the dK/dV kernel?

    python benchmarks/stream_probe.py OUT.json [--lengths 1024,4096,16384] [--head-dims 64,128,256] [--masked]
        [--groups 2,4,8]
    TRITON_INTERPRET=1 python benchmarks/stream_probe.py OUT.json --interpret     # CPU smoke run

fatune's backward launches the dQ kernel (which also writes Delta = rowsum(dO * O)) and then the dK/dV
kernel (which reads Delta), one after the other: each kernel's last wave leaves multiprocessors idle.
FlexAttention's backward is one launch whose programs do either job, and on the d128 shapes it takes
1.07-1.20x less time than fatune's two kernels (BENCHMARKS.md, sessions 5 and 10). With the dQ config's
`concurrent` (fatune.LaunchConfig), a pass computes Delta first and the dQ kernel then runs on a second
stream beside the dK/dV kernel (launched first: `/c`, or second: `/c2`), so each fills the other's tail.

Per shape (B·L = 16384, H·D = 2048, bf16, causal and not; the heuristic's tiles with a separate dQ kernel),
the whole backward as a training step launches it (`KernelRunner.run("bwd")`, do_bench median, L2 flushed):
"sequential" (dQ then dK/dV), "concurrent" (`/c`) and "concurrent-dkdv-first" (`/c2`), and "heuristic", the
heuristic's own backward where it differs (atomic dQ at d64 causal). gain = sequential / the faster
concurrent order: above 1, `concurrent` earns its place in the search space and the heuristics.
--masked adds issue 12's cases (d128, L = 8192, H = 16, B = 2: causal window of 1024 keys, GQA 8:1 causal,
key padding to half the keys, two packed causal documents), where the two kernels also trail Flex's one.
--groups G,...: only GQA shapes, the grid's shapes with heads / G K/V heads each (dK/dV sums a group of query
heads per program: G times fewer, longer programs). Each row gives the dK/dV kernel's program count.
In the interpreter every schedule runs in order (no streams) and each one's gradients are checked against
the sequential ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch
from bwd_variants import shapes  # B·L = 16384, H·D = 2048, causal and not

from fatune.heuristics import default_config
from fatune.measure import KernelRunner, Shape, bench, make_inputs

SCHEDULES = {"sequential": 0, "concurrent": 1, "concurrent-dkdv-first": 2}  # the dQ config's `concurrent`


def masked_shapes(dtype: str) -> list[Shape]:
    base = Shape(2, 16, 8192, 8192, 128, dtype, causal=True)
    return [dataclasses.replace(base, window=1024), dataclasses.replace(base, kv_heads=2),
            dataclasses.replace(base, causal=False, valid_keys=0.5), dataclasses.replace(base, documents=2)]


def timed(fn, interpret: bool) -> float:
    """do_bench median ms (one wall-clock run in the interpreter)."""
    if interpret:
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)
    fn()
    torch.cuda.synchronize()
    return bench(fn)


def probe(shape: Shape, device: str, interpret: bool) -> dict:
    """The backward of `shape` under each schedule (and the heuristic's, where it differs)."""
    heuristic = default_config(shape.spec, None if device == "cpu" else torch.cuda.get_device_capability(),
                               group=shape.heads // shape.kv_heads)
    base = heuristic.replace(dkdv=dataclasses.replace(heuristic.dkdv, atomic_dq=0))
    inputs = make_inputs(shape, device)
    row: dict = {"config": str(base), "dkdv_programs": -(-shape.seqlen_k // base.dkdv.block_n) * base.dkdv.split_d
                 * shape.kv_heads * shape.batch}
    grads = {}
    for name, concurrent in SCHEDULES.items():
        runner = KernelRunner(shape, base.replace(dq=dataclasses.replace(base.dq, concurrent=concurrent)), inputs)
        runner.prepare()
        row[name] = timed(runner.run("bwd"), interpret)
        grads[name] = tuple(t.clone() for t in (runner.args.grad_q, runner.args.grad_k, runner.args.grad_v))
    if heuristic != base:
        runner = KernelRunner(shape, heuristic, inputs)
        runner.prepare()
        row["heuristic"] = timed(runner.run("bwd"), interpret)
    # the same kernels' arithmetic in every schedule: only dQ's Delta comes from another pass
    row["max_grad_difference"] = max(float((a.float() - b.float()).abs().max()) for name in SCHEDULES
                                     for a, b in zip(grads[name], grads["sequential"]))
    row["gain"] = row["sequential"] / min(row["concurrent"], row["concurrent-dkdv-first"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out")
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--masked", action="store_true", help="also issue 12's masked, GQA and packed cases")
    parser.add_argument("--groups", default="", help="GQA shapes only: query heads per K/V head, e.g. 2,4,8")
    parser.add_argument("--interpret", action="store_true", help="tiny float16 shapes in Triton's interpreter")
    args = parser.parse_args()
    interpret = args.interpret or os.environ.get("TRITON_INTERPRET") == "1"
    device = "cpu" if interpret else "cuda"
    cases = ([Shape(1, 2, 48, 48, 16, "float16", causal=causal) for causal in (False, True)] if interpret else
             shapes([int(x) for x in args.lengths.split(",")], [int(x) for x in args.head_dims.split(",")], args.dtype)
             + (masked_shapes(args.dtype) if args.masked else []))
    if args.groups:
        cases = [dataclasses.replace(shape, kv_heads=shape.heads // int(g)) for shape in cases
                 for g in args.groups.split(",") if shape.window < 0 and not shape.documents and shape.valid_keys == 1
                 and shape.heads % int(g) == 0]
    if interpret and args.masked:
        cases += [Shape(1, 4, 48, 48, 16, "float16", causal=True, kv_heads=2, window=20),
                  Shape(2, 2, 40, 40, 16, "float16", valid_keys=0.5), Shape(2, 2, 40, 40, 16, "float16", documents=2)]
    results = {}
    for shape in cases:
        row = probe(shape, device, interpret)
        results[shape.label()] = row
        print(f"{shape.label()}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                              for k, v in row.items()), flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print("| shape | dQ config | dK/dV programs | sequential ms | concurrent (dQ first / dK/dV first) | gain | "
          "heuristic's backward |")
    print("|---|---|---|---|---|---|---|")
    for label, row in results.items():
        heuristic = f"{row['heuristic']:.3f}" if "heuristic" in row else "the same"
        print(f"| {label} | {row['config'].split('| dq ')[1]} | {row['dkdv_programs']} | {row['sequential']:.3f} | "
              f"{row['concurrent']:.3f} / "
              f"{row['concurrent-dkdv-first']:.3f} | {row['gain']:.3f} | {heuristic} |")


if __name__ == "__main__":
    main()
