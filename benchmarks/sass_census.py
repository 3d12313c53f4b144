"""Does ptxas keep a kernel's tensor-core products in flight, or wait for each one? Read from sm_90 SASS, no GPU.

    python benchmarks/sass_census.py [--kernels dkdv,dq,fwd] [--mask causal] [--head-dim 128] [--dtype bfloat16]
        [--configs "fwd F, dkdv K, dq Q; ..."] [--ptxas PATH,PATH] > census.md
    python benchmarks/sass_census.py --cache TRITON_CACHE_DIR [--names attn_bwd_dkdv,flex] [--keep DIR]

Triton writes each tile product as a run of `wgmma.mma_async` instructions and one `wgmma.wait_group`; ptxas
may still wait after every instruction of the run ("wgmma serialized", SASS: an HGMMA, then
`WARPGROUP.DEPBAR.LE gsb0, 0x0`, then the next), for example when the accumulators do not fit the registers
left. Nsight Compute on an H200 (session 28) showed the dK/dV kernel's loop doing exactly that, and
Flex's backward not. This compiles each kernel to PTX once (`fatune.offline`, GROUP = 1), then runs every
ptxas given on that PTX (default: the one Triton uses here, and the CUDA toolkit's if there is one) and
reports, per kernel and ptxas: registers, stack (spills), the HGMMA runs between waits, and ptxas's own
performance warnings. --cache reads the PTX a real run left in a Triton cache instead (the kernels as the launch
specialised them), and --keep copies those PTX and TTIR files out for reading elsewhere.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402

from fatune import offline  # noqa: E402
from fatune.heuristics import default_config  # noqa: E402
from fatune.spec import KernelSpec  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from masked_cases import mask_configs  # noqa: E402


def ptx_of(kernel: str, spec: KernelSpec, config) -> tuple[str, dict]:
    """`kernel`'s PTX for sm_90a as a launch without GQA specialises it (fatune.offline, GROUP a constant 1), and
    the launch's register cap."""
    compiled = offline._compile(kernel, spec, config, (9, 0), None, None, (), 1)
    return compiled.asm["ptx"], {"maxnreg": compiled.metadata.maxnreg}


def sass_ops(sass: str) -> list[str]:
    return [match.group(1) for match in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", sass)]


def hgmma_runs(ops: list[str]) -> collections.Counter:
    """How many HGMMA instructions each `WARPGROUP.DEPBAR` waits for (a run of 1: a serialized product)."""
    runs: collections.Counter = collections.Counter()
    pending = 0
    for op in ops:
        if "HGMMA" in op:
            pending += 1
        elif "WARPGROUP.DEPBAR" in op and pending:
            runs[pending] += 1
            pending = 0
    return runs


def assemble(ptxas: str, ptx: str, maxnreg: int) -> dict:
    """Registers, stack, HGMMA runs and performance warnings of `ptx` assembled by `ptxas` for sm_90a."""
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as file:
            file.write(ptx)
        command = [ptxas, "-v", "--gpu-name=sm_90a", src, "-o", cubin] + ([f"--maxrregcount={maxnreg}"] if maxnreg else [])
        log = subprocess.run(command, capture_output=True, text=True)
        if log.returncode:
            return {"error": log.stderr.strip()[-300:]}
        sass = subprocess.run([offline._cuobjdump(), "-sass", cubin], capture_output=True, text=True).stdout
        usage = subprocess.run([offline._cuobjdump(), "--dump-resource-usage", cubin], capture_output=True,
                               text=True).stdout
    ops = sass_ops(sass)
    runs = hgmma_runs(ops)
    return {"registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "stack": int(re.search(r"STACK:(\d+)", usage).group(1)),
            "hgmma": sum("HGMMA" in op for op in ops), "waits": sum(runs.values()), "serialized": runs.get(1, 0),
            "runs": dict(sorted(runs.items())),
            "warnings": sorted({line.split("warning :")[-1].strip() for line in log.stderr.splitlines()
                                if "warning" in line.lower() or "Performance Loss" in line})}


def print_rows(kernel: str, launch: str, ptx: str, maxnreg: int, ptxases: list[str]) -> None:
    """One table row per ptxas: `ptx` assembled by it."""
    for ptxas in ptxases:
        row = assemble(ptxas, ptx, maxnreg)
        if "error" in row:
            print(f"| {kernel} | {launch} | {version(ptxas)} | error: {row['error']} |")
            continue
        print(f"| {kernel} | {launch} | {version(ptxas)} ({ptxas}) | {row['registers']} | {row['stack']} | "
              f"{row['hgmma']} | {row['waits']} | {row['serialized']} | {row['runs']} | "
              f"{'; '.join(row['warnings'])[:300]} |", flush=True)


def ptxas_candidates(given: str) -> list[str]:
    if given:
        return given.split(",")
    found = [offline._cuobjdump().replace("cuobjdump", "ptxas")]
    for path in [shutil.which("ptxas"), os.environ.get("TRITON_PTXAS_PATH")] + \
            sorted(glob.glob("/usr/local/cuda*/bin/ptxas")):
        if path and os.path.exists(path) and os.path.realpath(path) not in map(os.path.realpath, found):
            found.append(path)
    return found


def version(ptxas: str) -> str:
    out = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
    match = re.search(r"release (\S+),", out)
    return match.group(1) if match else "?"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kernels", default="dkdv,dq,fwd")
    parser.add_argument("--mask", default="causal", help="none, causal, window (causal with a left edge), bool")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--configs", default="", help="masked_cases.mask_configs' form; default: the heuristic's")
    parser.add_argument("--ptxas", default="", help="comma-separated ptxas binaries (default: Triton's and CUDA's)")
    parser.add_argument("--cache", default="", help="a Triton cache dir: its kernels' PTX instead of compiling")
    parser.add_argument("--names", default="attn_bwd_dkdv,attn_bwd_dq,attn_fwd,flex_attention")
    parser.add_argument("--keep", default="", help="with --cache: copy each kernel's PTX and TTIR here")
    args = parser.parse_args()
    if args.cache:
        return census_of_cache(args)
    spec = KernelSpec(args.dtype, args.head_dim, causal=args.mask in ("causal", "window"),
                      window_left=args.mask == "window", attn_mask="bool" if args.mask == "bool" else "none")
    configs = mask_configs(args.configs) or [default_config(spec, (9, 0))]
    ptxases = ptxas_candidates(args.ptxas)
    print("Triton uses:", triton.backends.nvidia.compiler.get_ptxas(90).path, "| TRITON_PTXAS_PATH:",
          os.environ.get("TRITON_PTXAS_PATH"))
    print("\n| kernel | config | ptxas | registers | stack B | HGMMA | waits | serialized | runs | warnings |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for config in configs:
        for kernel in args.kernels.split(","):
            ptx, options = ptx_of(kernel, spec, config)
            print_rows(kernel, str(getattr(config, kernel)), ptx, options["maxnreg"], ptxases)


def census_of_cache(args: argparse.Namespace) -> None:
    """The census over every PTX in a Triton cache whose kernel name contains one of --names."""
    import json
    ptxases = ptxas_candidates(args.ptxas)
    print("\n| kernel | warps, stages | ptxas | registers | stack B | HGMMA | waits | serialized | runs | warnings |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for meta_path in sorted(glob.glob(os.path.join(args.cache, "*", "*.json"))):
        if os.path.basename(meta_path).startswith("__grp__"):
            continue
        meta = json.load(open(meta_path))
        name = meta.get("name", "")
        ptx_path = meta_path[:-5] + ".ptx"
        if not any(part in name for part in args.names.split(",")) or not os.path.exists(ptx_path):
            continue
        ptx = open(ptx_path).read()
        if args.keep:
            os.makedirs(args.keep, exist_ok=True)
            for suffix in (".ptx", ".ttir", ".ttgir", ".json"):
                if os.path.exists(meta_path[:-5] + suffix):
                    shutil.copy(meta_path[:-5] + suffix, os.path.join(args.keep, f"{name}-{meta['hash'][:8]}{suffix}"))
        print_rows(name, f"w{meta.get('num_warps')} s{meta.get('num_stages')}", ptx, meta.get("maxnreg") or 0, ptxases)


if __name__ == "__main__":
    main()
