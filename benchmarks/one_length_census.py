"""Do the kernels a call launches compile when one of its lengths is 1? (sm_90 cubins, no GPU needed.)

Triton turns an integer argument equal to 1 into a constant, so a call with one query or one key compiles
kernels of their own; ptxas (CUDA 13) once crashed on one of them (session 21: the heuristic's dQ kernel at fp16
d16 with its single-tile key loop pipelined). For each spec of a grid (dtype, head dim, mask variant) and each
of (L_q, L_k) = (1, 1), (1, 4096), (4096, 1), this resolves the heuristic's config as a launch would
(fatune.launch.resolve) and compiles the forward, dK/dV and dQ kernels with those lengths, reporting failures.

    PYTHONPATH=. python benchmarks/one_length_census.py --dtypes float16,bfloat16 --workers 2
"""

from __future__ import annotations

import argparse
import itertools
from concurrent.futures import ProcessPoolExecutor

import torch

MASKS = {  # a mask variant: the call's arguments beside q, k, v (B = 2, H = 4)
    "none": lambda lq, lk: {},
    "causal": lambda lq, lk: {"is_causal": True},
    "bool": lambda lq, lk: {"attn_mask": torch.ones(lq, lk, dtype=torch.bool)},
    "additive+alibi": lambda lq, lk: {"attn_mask": torch.zeros(lq, lk), "alibi_slopes": torch.ones(4)},
    "seqlens_k": lambda lq, lk: {"seqlens_k": torch.full((2,), lk, dtype=torch.int32)},
    "dropout": lambda lq, lk: {"dropout_p": 0.1},
}
LENGTHS = [(1, 1), (1, 4096), (4096, 1)]


def compile_case(case: tuple[str, int, str, int, int]) -> tuple[tuple, str]:
    """Compile the three kernels of one case as a launch would resolve them; 'ok' or the first failure."""
    from fatune import launch, offline
    from fatune.heuristics import default_config
    from fatune.plans import Call

    dtype, head_dim, mask, seqlen_q, seqlen_k = case
    q = torch.empty(2, 4, seqlen_q, head_dim, dtype=getattr(torch, dtype))
    k = torch.empty(2, 4, seqlen_k, head_dim, dtype=getattr(torch, dtype))
    problem = Call(**MASKS[mask](seqlen_q, seqlen_k)).check(q, k, k)
    config = launch.resolve(default_config(problem.spec, (9, 0)), problem, q.device, (q, k, k))
    ones = tuple(name for name, length in (("L_Q", seqlen_q), ("L_K", seqlen_k)) if length == 1)
    for kernel in ("fwd", "dkdv", "dq"):
        try:
            offline.compile_kernel(kernel, problem.spec, config, lengths_of_one=ones)
        except Exception as error:  # noqa: BLE001 - reported per case
            return case, f"{kernel} at {getattr(config, kernel)}: " + (str(error).strip().splitlines() or [""])[0]
    return case, "ok"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", default="float16", help="comma-separated torch dtype names")
    parser.add_argument("--head-dims", default="16,32,64,128,256")
    parser.add_argument("--workers", type=int, default=2, help="compiling processes")
    args = parser.parse_args()
    cases = [(dtype, int(d), mask, lq, lk) for dtype, d, mask, (lq, lk) in itertools.product(
        args.dtypes.split(","), args.head_dims.split(","), MASKS, LENGTHS)]
    failures = 0
    with ProcessPoolExecutor(args.workers) as pool:
        for case, result in pool.map(compile_case, cases):
            if result != "ok":
                failures += 1
                print(*case, result, flush=True)
    print(f"{len(cases)} cases, 3 kernels each: {failures} failed")


if __name__ == "__main__":
    main()
