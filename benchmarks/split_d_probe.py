"""Which forced head-dim-split dK/dV calls give wrong gradients on the GPU: each case in a process of its own,
checked against the float64 golden under the accuracy rule (tests/reference.run_and_compare). Session 29 found
halves of 32 lanes (d64) wrong at 64x64/w4/s1 (right at w8, s2, 32x64, 64x32 and at d128); the launch now runs
head dims under 65 unsplit (fatune.spec.split_d_runs), so their cases here time the unsplit kernel.

    python3 benchmarks/split_d_probe.py [CASE ...]   # default: every case in CASES, 16 processes at once

A case: "d=64,L=100,dkdv=64x64/w4/s1/d2" plus optional b=, h=, hkv=, causal=1, dtype=bf16 (the rest as
tests/test_variants.py::test_gpu_split_d_at_small_head_dims draws them).
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys

BASE = "d=64,L=100,dkdv=64x64/w4/s1/d2"
CASES = [BASE, "d=64,L=100,dkdv=64x64/w4/s1/a/d2", "d=64,L=100,dkdv=64x64/w4/s1/t/a2/d2", BASE + ",causal=1",
         "d=64,L=128,dkdv=64x64/w4/s1/d2", "d=64,L=300,dkdv=64x64/w4/s1/d2", "d=64,L=100,dkdv=64x64/w8/s1/d2",
         "d=64,L=100,dkdv=32x64/w4/s1/d2", "d=64,L=100,dkdv=64x32/w4/s1/d2", "d=64,L=100,dkdv=64x64/w4/s2/d2",
         BASE + ",b=2,h=4,hkv=4", "d=128,L=100,dkdv=64x64/w4/s1/d2", BASE + ",dtype=bf16", "d=64,L=100,dkdv=64x64/w4/s1",
         BASE + ",h=4,hkv=2,causal=1", "d=64,L=65,dkdv=64x64/w4/s1/d2",
         # halves of 64 lanes (d 65-128), the smallest the launch still splits
         "d=72,L=100,dkdv=64x64/w4/s1/d2", "d=72,L=300,dkdv=64x64/w4/s1/t/a2/d2,causal=1",
         "d=100,L=65,dkdv=64x64/w4/s1/a/d2,h=4,hkv=2,causal=1", "d=128,L=300,dkdv=64x64/w4/s1/t/a2/d2,b=2,h=4,hkv=4",
         "d=80,L=200,dkdv=64x64/w4/s2/d2,dtype=bf16", "d=128,L=129,dkdv=64x128/w8/s1/d2"]


def run_case(text: str) -> None:
    import torch

    import fatune
    from tests.reference import random_qkv, run_and_compare

    fields = dict(item.split("=") for item in text.split(","))
    h, hkv = int(fields.get("h", 2)), int(fields.get("hkv", fields.get("h", 2)))
    d, length = int(fields["d"]), int(fields["L"])
    dtype = torch.bfloat16 if fields.get("dtype") == "bf16" else torch.float16
    torch.manual_seed(0)
    q, k, v = random_qkv(int(fields.get("b", 1)), h, hkv, length, length, d, d, dtype=dtype, device="cuda")
    config = fatune.AttentionConfig(fwd=fatune.LaunchConfig(16, 64, num_warps=4, num_stages=1),
                                    dkdv=fatune.LaunchConfig.parse(fields["dkdv"]),
                                    dq=fatune.LaunchConfig(64, 32, num_warps=4, num_stages=2))
    run_and_compare(q, k, v, config=config, is_causal=fields.get("causal") == "1", enable_gqa=h != hkv)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        try:
            run_case(sys.argv[2])
            print("ok")
        except AssertionError as error:
            print("WRONG", str(error).splitlines()[0][:160])
        return
    cases = sys.argv[1:] or CASES

    def probe(case: str) -> str:
        done = subprocess.run([sys.executable, __file__, "--one", case], capture_output=True, text=True,
                              env=dict(os.environ, CUDA_LAUNCH_BLOCKING="1"))
        lines = (done.stdout.strip() or done.stderr.strip() or "no output").splitlines()
        return f"{case}: {lines[-1][:200]}"

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        for line in pool.map(probe, cases):
            print(line, flush=True)


if __name__ == "__main__":
    main()
