"""Probe (issue 11): would the backward gain from running its dQ kernel beside the dK/dV kernel?

    python benchmarks/stream_probe.py OUT.json [--lengths 1024,4096,16384] [--head-dims 64,128,256] [--masked]
    TRITON_INTERPRET=1 python benchmarks/stream_probe.py OUT.json --interpret     # CPU smoke run

fatune's backward launches the dQ kernel (which also writes Delta = rowsum(dO * O)) and then the dK/dV
kernel (which reads Delta), one after the other: each kernel's last wave leaves multiprocessors idle.
FlexAttention's backward is one launch whose programs do either job, and on the d128 shapes it takes
1.07-1.20x less time than fatune's two kernels (BENCHMARKS.md, sessions 5 and 10). Run concurrently, the two
kernels would fill each other's tails, but dK/dV would then need Delta from a pass of its own.

Per shape (B·L = 16384, H·D = 2048, bf16, causal and not; the heuristic's tiles with a separate dQ kernel),
do_bench medians, L2 flushed, of:
- "sequential": dQ then dK/dV on one stream (what a training step runs today);
- "dq" and "dkdv": each kernel alone;
- "delta": a Delta-only pass (a small Triton kernel here: rowsum(dO * O) into float32);
- "concurrent": dQ on a second stream beside dK/dV on the first (forked and joined with events), launched
  dQ first or dK/dV first ("concurrent-dkdv-first"). Timing only: the dK/dV kernel here reads the Delta
  that the dQ kernel is writing;
- "heuristic": the heuristic's own backward where it differs from the probed one (atomic dQ at d64 causal).
gain = sequential / (delta + the faster concurrent order): above 1, the structure is worth building. The
Delta pass prices rowsum(dO * O) only: the dQ kernel computes the rows that see at most 128 keys (a causal
head's first tiles, narrow windows, short documents) exactly, as the sum of P * dP, which a real Delta pass
would have to do too (a small extra cost on those rows, not timed here).
--masked adds issue 12's cases (d128, L = 8192, H = 16, B = 2: causal window of 1024 keys, GQA 8:1 causal,
key padding to half the keys, two packed causal documents), where the two kernels also trail Flex's one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch
import triton
import triton.language as tl
from bwd_variants import shapes  # B·L = 16384, H·D = 2048, causal and not

from fatune.heuristics import default_config
from fatune.launch import current_stream
from fatune.measure import KernelRunner, Shape, bench, make_inputs


@triton.jit
def delta_rows(O, DO, DELTA, rows, HEAD_DIM_V: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_DV: tl.constexpr):
    """DELTA[r] = sum over the head dim of O[r] * dO[r], for BLOCK_ROWS rows of two (rows, HEAD_DIM_V) views."""
    offs_r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    offs_d = tl.arange(0, BLOCK_DV)
    mask = (offs_r[:, None] < rows) & (offs_d[None, :] < HEAD_DIM_V)
    o = tl.load(O + offs_r[:, None] * HEAD_DIM_V + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + offs_r[:, None] * HEAD_DIM_V + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + offs_r, tl.sum(o * do, axis=1), mask=offs_r < rows)


def masked_shapes(dtype: str) -> list[Shape]:
    base = Shape(2, 16, 8192, 8192, 128, dtype, causal=True)
    return [dataclasses.replace(base, window=1024), dataclasses.replace(base, kv_heads=2),
            dataclasses.replace(base, causal=False, valid_keys=0.5), dataclasses.replace(base, documents=2)]


class Probe:
    """The backward's launches of one shape with the heuristic's tiles and a separate dQ kernel."""

    def __init__(self, shape: Shape, device: str):
        base = default_config(shape.spec, None if device == "cpu" else torch.cuda.get_device_capability())
        self.config = base.replace(dkdv=dataclasses.replace(base.dkdv, atomic_dq=0))
        self.inputs = make_inputs(shape, device)
        self.runner = KernelRunner(shape, self.config, self.inputs)
        self.runner.prepare()
        self.dq, self.dkdv = self.runner.plan.bwd_launches(self.runner.args.grad_out, atomic=False)
        out, grad_out = self.runner.args.out, self.runner.args.grad_out
        if shape.documents:  # (tokens, H, Dv): rows in Delta's (head, token) order
            out, grad_out = out.transpose(0, 1), grad_out.transpose(0, 1)
        width = shape.head_dim_v
        self.out, self.grad_out = out.reshape(-1, width), grad_out.reshape(-1, width)
        self.heuristic = base if base != self.config else None
        self.delta = torch.empty(self.out.shape[0], dtype=torch.float32, device=device)
        self.cuda = device != "cpu"
        if self.cuda:
            self.side = torch.cuda.Stream()
            self.forked, self.joined = torch.cuda.Event(), torch.cuda.Event()

    def launch(self, kernel, stream) -> None:
        kernel(self.runner.slots, stream)

    def sequential(self) -> None:
        stream = current_stream(self.runner.plan.device)
        self.launch(self.dq, stream)
        self.launch(self.dkdv, stream)

    def alone(self, kernel) -> None:
        self.launch(kernel, current_stream(self.runner.plan.device))

    def delta_pass(self) -> None:
        rows, width = self.out.shape
        lanes = triton.next_power_of_2(width)
        block = max(16, 4096 // lanes)  # two float32 tiles of 4096 elements on 4 warps: no spills at d256
        delta_rows[(triton.cdiv(rows, block),)](self.out, self.grad_out, self.delta, rows, HEAD_DIM_V=width,
                                                 BLOCK_ROWS=block, BLOCK_DV=lanes)

    def concurrent(self, dkdv_first: bool) -> None:
        """dQ on the side stream beside dK/dV on the current one (sequential in the interpreter)."""
        if not self.cuda:
            return self.sequential()
        main = torch.cuda.current_stream()
        self.forked.record(main)
        self.side.wait_event(self.forked)
        main_handle, side_handle = main.cuda_stream, self.side.cuda_stream
        if dkdv_first:
            self.launch(self.dkdv, main_handle)
        with torch.cuda.stream(self.side):
            self.launch(self.dq, side_handle)
        if not dkdv_first:
            self.launch(self.dkdv, main_handle)
        self.joined.record(self.side)
        main.wait_event(self.joined)
        return None


def timed(fn, interpret: bool) -> float:
    """do_bench median ms (one wall-clock run in the interpreter)."""
    if interpret:
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)
    fn()
    torch.cuda.synchronize()
    return bench(fn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out")
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--masked", action="store_true", help="also issue 12's masked, GQA and packed cases")
    parser.add_argument("--interpret", action="store_true", help="a tiny float16 shape in Triton's interpreter")
    args = parser.parse_args()
    interpret = args.interpret or os.environ.get("TRITON_INTERPRET") == "1"
    device = "cpu" if interpret else "cuda"
    cases = ([Shape(1, 2, 48, 48, 16, "float16", causal=causal) for causal in (False, True)] if interpret else
             shapes([int(x) for x in args.lengths.split(",")], [int(x) for x in args.head_dims.split(",")], args.dtype)
             + (masked_shapes(args.dtype) if args.masked else []))
    if interpret and args.masked:
        cases += [Shape(1, 4, 48, 48, 16, "float16", causal=True, kv_heads=2, window=20),
                  Shape(2, 2, 40, 40, 16, "float16", valid_keys=0.5), Shape(2, 2, 40, 40, 16, "float16", documents=2)]
    results = {}
    for shape in cases:
        probe = Probe(shape, device)
        row = {"config": str(probe.config),
               "sequential": timed(probe.sequential, interpret),
               "dq": timed(lambda p=probe: p.alone(p.dq), interpret),
               "dkdv": timed(lambda p=probe: p.alone(p.dkdv), interpret),
               "delta": timed(probe.delta_pass, interpret),
               "concurrent": timed(lambda p=probe: p.concurrent(False), interpret),
               "concurrent-dkdv-first": timed(lambda p=probe: p.concurrent(True), interpret)}
        if probe.heuristic is not None:
            heuristic = KernelRunner(shape, probe.heuristic, probe.inputs)
            heuristic.prepare()
            row["heuristic"] = timed(heuristic.run("bwd"), interpret)
        if interpret:  # the Delta pass against the dQ kernel's (the GPU run trusts the same kernel)
            probe.sequential()
            row["delta_error"] = float((probe.delta - probe.runner.args.delta.reshape(-1)).abs().max())
        row["gain"] = row["sequential"] / (row["delta"] + min(row["concurrent"], row["concurrent-dkdv-first"]))
        results[shape.label()] = row
        print(f"{shape.label()}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                              for k, v in row.items()), flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print("| shape | sequential ms | dQ + dK/dV alone | Delta pass | concurrent (dQ first / dK/dV first) | gain "
          "| heuristic's backward |")
    print("|---|---|---|---|---|---|---|")
    for label, row in results.items():
        heuristic = f"{row['heuristic']:.3f}" if "heuristic" in row else "the same"
        print(f"| {label} | {row['sequential']:.3f} | {row['dq']:.3f} + {row['dkdv']:.3f} | {row['delta']:.3f} | "
              f"{row['concurrent']:.3f} / {row['concurrent-dkdv-first']:.3f} | {row['gain']:.3f} | {heuristic} |")


if __name__ == "__main__":
    main()
