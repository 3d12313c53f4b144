"""What FlexAttention's kernels are, beside fatune's, on one masked case (issue 12): per-kernel GPU time of a
training step, and every compiled kernel's tiles, warps, stages, shared memory, registers and spills.

    python benchmarks/flex_anatomy.py OUT_DIR [--case window1024|docs2|padding|causal] [--length 8192]
        [--batch 2] [--configs "fwd F, dkdv K, dq Q; ..."] [--profile]

bf16, D = 128, H = 16, causal (`causal`: no other mask, as a window wider than L leaves it). Flex compiles with Inductor's defaults (its block mask made outside the step);
fatune runs its dispatcher's pick and each config of --configs (e.g. Flex's own tiles). Both compile into fresh
Triton and Inductor caches under OUT_DIR, so the table covers exactly this run's kernels; Flex's generated
sources (Inductor's output code) are copied to OUT_DIR/flex-sources for reading and offline compiling.
--profile: no timing; each implementation's warm training step runs once between cudaProfilerStart and Stop, for
`ncu --profile-from-start off` (gpu_run.sh's `ncu` stage) to read every kernel of those steps.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import subprocess
import sys


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--case", default="window1024")
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2, help="B (docs2: always one pack)")
    parser.add_argument("--configs", default="")
    parser.add_argument("--profile", action="store_true", help="one warm step each, between profiler start/stop")
    args = parser.parse_args()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    # fresh caches before torch and triton read their locations
    os.environ["TRITON_CACHE_DIR"] = os.path.join(out, "triton-cache")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(out, "inductor-cache")

    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import fatune
    from fatune.measure import bench, kernel_times
    from fatune.offline import _cuobjdump

    sys.path.insert(0, os.path.dirname(__file__))
    from masked_cases import mask_configs, step_once

    L, B, H, D = args.length, args.batch, 16, 128
    torch.manual_seed(0)
    if args.case == "window1024":
        kwargs = {"window_size": (1024, 0)}

        def keep(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (kv_idx >= q_idx - 1024)
    elif args.case == "causal":
        kwargs = {"is_causal": True}

        def keep(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx
    elif args.case == "padding":
        lengths = torch.tensor([L // 2, L // 4], dtype=torch.int32, device="cuda")
        kwargs = {"is_causal": True, "seqlens_k": lengths}

        def keep(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (kv_idx < lengths[b])
    elif args.case == "docs2":
        B = 1
        cut = L * 3 // 7
        doc_id = (torch.arange(L, device="cuda") >= cut).to(torch.int32)
        cu = torch.tensor([0, cut, L], dtype=torch.int32, device="cuda")
        kwargs = {"is_causal": True, "cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": L - cut,
                  "max_seqlen_k": L - cut}

        def keep(b, h, q_idx, kv_idx):
            return (doc_id[q_idx] == doc_id[kv_idx]) & (kv_idx <= q_idx)
    else:
        raise SystemExit(f"--case: expected window1024, padding, docs2 or causal, got {args.case!r}")

    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
    block_mask = create_block_mask(keep, B, None, L, L, device="cuda")
    compiled = torch.compile(flex_attention, dynamic=False)
    runners = {"flex": lambda q_, k_, v_: compiled(q_, k_, v_, block_mask=block_mask)}
    packed = args.case == "docs2"

    def fatune_run(q_, k_, v_, config=None):
        return fatune.attention(q_, k_, v_, config=config, **kwargs)

    runners["fatune"] = fatune_run
    for config in mask_configs(args.configs):
        runners[f"fatune@{config.fwd}|{config.dkdv}|{config.dq}"] = functools.partial(fatune_run, config=config)
    # packed documents: fatune takes (total, H, D) tensors of its own, as a varlen user has them
    own = ([t[0].transpose(0, 1).detach().contiguous().requires_grad_() for t in (q, k, v)],
           grad_out[0].transpose(0, 1).contiguous()) if packed else ([q, k, v], grad_out)
    results = {"case": args.case, "L": L, "B": B, "H": H, "D": D,
               "fatune_pick": str(fatune.explain(*own[0], **kwargs).decision.config), "impls": {}}
    reference = None
    for name, run in runners.items():
        leaves, grad = own if name.startswith("fatune") else ([q, k, v], grad_out)
        step = functools.partial(step_once, run, leaves, grad)
        step()
        torch.cuda.synchronize()
        with torch.no_grad():
            o = run(*leaves).float()
            if o.dim() == 3:
                o = o.transpose(0, 1)[None]
        reference = o if reference is None else reference
        if args.profile:
            step()
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            step()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            print(f"{name}: profiled one step, diff {float((o - reference).abs().max()):.2e}", flush=True)
            continue
        row = {"fwd_bwd_ms": bench(step, grad_to_none=leaves),
               "max_abs_diff_vs_flex": float((o - reference).abs().max()),
               "step_kernels_us": kernel_times(step)}
        results["impls"][name] = row
        print(f"{name}: {row['fwd_bwd_ms']:.3f} ms, diff {row['max_abs_diff_vs_flex']:.2e}; "
              + ", ".join(f"{kernel[:48]} {us:.1f}" for kernel, us in row["step_kernels_us"].items()), flush=True)

    # every kernel this run compiled: Triton's metadata, and registers and spills from its cubin
    kernels = []
    for root, _, files in os.walk(os.environ["TRITON_CACHE_DIR"]):
        for meta_file in (f for f in files if f.endswith(".json") and not f.startswith("__grp__")):
            meta = json.load(open(os.path.join(root, meta_file)))
            cubin = os.path.join(root, meta_file[:-5] + ".cubin")
            if "name" not in meta or not os.path.exists(cubin):
                continue
            usage = subprocess.run([_cuobjdump(), "--dump-resource-usage", cubin], capture_output=True, text=True).stdout
            regs, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
            kernels.append({"name": meta["name"], "num_warps": meta.get("num_warps"),
                            "num_stages": meta.get("num_stages"), "shared": meta.get("shared"),
                            "registers": int(regs.group(1)) if regs else None,
                            "spill_bytes": int(stack.group(1)) if stack else None,
                            "maxnreg": meta.get("maxnreg")})
    results["compiled"] = sorted(kernels, key=lambda row: row["name"])
    for row in results["compiled"]:
        print("  {name:<48} w{num_warps} s{num_stages} shared {shared} regs {registers} spill {spill_bytes}".format(**row))
    sources = os.path.join(out, "flex-sources")
    os.makedirs(sources, exist_ok=True)
    for root, _, files in os.walk(os.environ["TORCHINDUCTOR_CACHE_DIR"]):
        for file in files:
            path = os.path.join(root, file)
            if file.endswith(".py") and "flex_attention" in open(path, errors="replace").read():
                shutil.copy(path, sources)
    with open(os.path.join(out, "anatomy.json"), "w") as file:
        json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
