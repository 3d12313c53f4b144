"""Time the forward's Hopper code variant, TMA loads (/t), against the plain kernel, tile by tile.

Run on an H200 (or another sm_90 GPU) from the repository root:

    python3 benchmarks/fwd_variants.py --out fwd_variants.json [--jobs 8] [--shapes d128,gqa] [--quick]

For each shape (bf16, random inputs): D in {64, 128, 256} at L = 4096 with B*L = 16384 and H*D = 2048,
causal and not, and B=2, H=16, H_kv=2 (GQA 8:1), L=8192, d128. Every tile of TILES is run plain and
/t with the config forced (fatune.attention(..., config=..., strict=True)); the row records the
config the launch really ran (fatune.launch.resolve drops /t where TMA cannot read the tensors),
the compiled kernel's shared memory, registers, spills and warps, the median time of
triton.testing.do_bench, TFLOP/s (4*B*H*L^2*D, halved when causal) and the max abs error against
torch SDPA. torch SDPA's own time is a row too. Variants that fail to compile or run are reported
with their error, not fatal.

--jobs N first compiles every config in N processes (compile-only launches into Triton's cache),
so the timing loop does not wait on the compiler one kernel at a time. --shapes keeps the shapes
whose label contains one of the comma-separated words, --quick three tiles only.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from dataclasses import dataclass

import torch

TILES = ["64x64/w4/s3", "128x64/w8/s3", "128x128/w8/s2", "128x64/w4/s3", "64x128/w4/s3", "128x128/w4/s2",
         "64x64/w4/s2", "128x32/w4/s3"]
QUICK_TILES = ["64x64/w4/s3", "128x64/w8/s3", "128x64/w4/s3"]
VARIANTS = ["", "/t"]


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    kv_heads: int
    seqlen: int
    head_dim: int
    causal: bool

    @property
    def label(self) -> str:
        gqa = f"-gqa{self.heads // self.kv_heads}" if self.kv_heads != self.heads else ""
        return (f"d{self.head_dim}{gqa}-{'causal' if self.causal else 'full'}-b{self.batch}h{self.heads}"
                f"l{self.seqlen}")

    @property
    def flops(self) -> float:
        return 4 * self.batch * self.heads * self.seqlen ** 2 * self.head_dim / (2 if self.causal else 1)

    def inputs(self, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        generator = torch.Generator(device="cuda").manual_seed(seed)
        shapes = [(self.batch, h, self.seqlen, self.head_dim) for h in (self.heads, self.kv_heads, self.kv_heads)]
        return tuple(torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator) for shape in shapes)

    def kwargs(self) -> dict:
        return {"is_causal": self.causal, "enable_gqa": self.kv_heads != self.heads}


CASES = [Case(16384 // 4096, 2048 // d, 2048 // d, 4096, d, causal) for d in (64, 128, 256) for causal in (False, True)]
CASES += [Case(2, 16, 2, 8192, 128, causal) for causal in (False, True)]


def attention_config(case: Case, tag: str):
    from fatune.dispatch import device_arch
    from fatune.heuristics import default_config
    from fatune.spec import KernelSpec, LaunchConfig

    spec = KernelSpec("bfloat16", case.head_dim, causal=case.causal)
    base = default_config(spec, device_arch(torch.device("cuda")))
    return base if tag == "heuristic" else base.replace(fwd=LaunchConfig.parse(tag))


def _compile_one(job: tuple[Case, str]) -> tuple[str, str, str | None]:
    """In a worker process: compile (not launch) the forward of one config into Triton's cache."""
    import fatune
    from fatune import launch

    case, tag = job
    launch.compile_only()
    try:
        q, k, v = case.inputs()
        fatune.attention(q, k, v, config=attention_config(case, tag), strict=True, **case.kwargs())
        return case.label, tag, None
    except Exception as error:  # noqa: BLE001 -- reported with the timing rows
        return case.label, tag, f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:200]}"


def precompile(jobs: list[tuple[Case, str]], processes: int) -> dict[tuple[str, str], str]:
    start = time.time()
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        errors = {(label, tag): error for label, tag, error in pool.imap_unordered(_compile_one, jobs) if error}
    print(f"compiled {len(jobs)} configs in {time.time() - start:.0f} s with {processes} processes; "
          f"{len(errors)} failed", flush=True)
    return errors


def kernel_info(q, k, v, case: Case, config) -> dict:
    """The forward's compiled binary: what the launch ran (config after resolve) and its resources."""
    from fatune.plans import Call, prepare

    prepared = prepare(q, k, v, Call(**case.kwargs()), config, True)
    launch = prepared.plan.fwd_launches()[0]
    info = {"launched": str(prepared.plan.config.fwd)}
    binary = launch.binary
    if binary is not None:
        binary._init_handles()
        info.update(shared_bytes=binary.metadata.shared, num_warps=binary.metadata.num_warps,
                    registers=binary.n_regs, spills=binary.n_spills)
    return info


def run_case(case: Case, tags: list[str], compile_errors: dict, warmup_ms: int, rep_ms: int) -> list[dict]:
    import triton

    import fatune

    q, k, v = case.inputs()
    kwargs = case.kwargs()
    with torch.no_grad():
        reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
        sdpa_ms = triton.testing.do_bench(
            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs), warmup=warmup_ms,
            rep=rep_ms, return_mode="median")
    rows = [{"shape": case.label, "config": "torch-sdpa", "ms": sdpa_ms, "tflops": case.flops / sdpa_ms / 1e9}]
    for tag in tags:
        row = {"shape": case.label, "config": tag}
        if (case.label, tag) in compile_errors:
            row["error"] = compile_errors[case.label, tag]
            rows.append(row)
            continue
        try:
            config = attention_config(case, tag)
            with torch.no_grad():
                out = fatune.attention(q, k, v, config=config, strict=True, **kwargs)
                torch.cuda.synchronize()
                row["max_abs_err"] = (out.float() - reference.float()).abs().max().item()
                row.update(kernel_info(q, k, v, case, config))
                row["ms"] = triton.testing.do_bench(
                    lambda config=config: fatune.attention(q, k, v, config=config, strict=True, **kwargs),
                    warmup=warmup_ms, rep=rep_ms, return_mode="median")
            row["tflops"] = case.flops / row["ms"] / 1e9
        except Exception as error:  # noqa: BLE001 -- a variant that cannot compile or run is reported
            row["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:200] if str(error) else ''}"
        rows.append(row)
    return rows


def print_table(case: Case, rows: list[dict]) -> None:
    print(f"\n{case.label}  (B={case.batch} H={case.heads} Hkv={case.kv_heads} L={case.seqlen} D={case.head_dim})")
    print(f"  {'config':22} {'launched':22} {'ms':>8} {'TFLOP/s':>8} {'err':>8} {'smem KiB':>8} {'regs':>5} "
          f"{'warps':>5}")
    best = min((r["ms"] for r in rows if "ms" in r and r["config"] != "torch-sdpa"), default=None)
    for row in rows:
        if "error" in row:
            print(f"  {row['config']:22} FAILED {row['error']}")
            continue
        mark = " *" if row.get("ms") == best else ""
        smem = f"{row['shared_bytes'] / 1024:.0f}" if "shared_bytes" in row else ""
        print(f"  {row['config']:22} {row.get('launched', ''):22} {row['ms']:8.3f} {row['tflops']:8.1f} "
              f"{row.get('max_abs_err', float('nan')):8.4f} {smem:>8} {row.get('registers', ''):>5} "
              f"{row.get('num_warps', ''):>5}{mark}")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON file for every row")
    parser.add_argument("--shapes", default="", help="comma-separated words; keep shapes whose label has one")
    parser.add_argument("--quick", action="store_true", help=f"tiles {QUICK_TILES} only")
    parser.add_argument("--jobs", type=int, default=8, help="processes compiling ahead of timing (0: none)")
    parser.add_argument("--warmup-ms", type=int, default=25)
    parser.add_argument("--rep-ms", type=int, default=100)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fwd_variants.py needs a CUDA GPU")
    import triton

    words = [w for w in args.shapes.split(",") if w]
    cases = [c for c in CASES if not words or any(w in c.label for w in words)]
    tags = ["heuristic"] + [tile + variant for tile in (QUICK_TILES if args.quick else TILES) for variant in VARIANTS]
    props = torch.cuda.get_device_properties(0)
    meta = {"gpu": props.name, "capability": f"{props.major}.{props.minor}", "torch": torch.__version__,
            "triton": triton.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "dtype": "bfloat16",
            "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms}
    print(json.dumps(meta), flush=True)
    errors = precompile([(c, t) for c in cases for t in tags], args.jobs) if args.jobs > 0 else {}
    rows = []
    for case in cases:
        case_rows = run_case(case, tags, errors, args.warmup_ms, args.rep_ms)
        print_table(case, case_rows)
        rows += case_rows
        with open(args.out, "w") as handle:  # after every shape: a cut-off run keeps what it measured
            json.dump({"meta": meta, "rows": rows}, handle, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
