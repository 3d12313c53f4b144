"""Search quality (issue 14): how close `fatune search` gets to the best config of each kernel's whole space.

    python benchmarks/search_quality.py OUT.json --part grid [--shapes 0,1] [--kernels fwd]   # exhaustive, on a GPU
    python benchmarks/search_quality.py OUT.json --part search [--seeds 0,1,2] [--trials 50]
    python benchmarks/search_quality.py OUT.json --part retime                   # the compared configs, alike
    python benchmarks/search_quality.py OUT.json --part table                    # the markdown table
    TRITON_INTERPRET=1 python benchmarks/search_quality.py OUT.json --part grid --interpret   # CPU smoke run

Shapes: d64 and d128, causal or not, a causal sliding window (1024 keys) and GQA 8:1 causal; bf16,
B·L = 16384. Per shape and kernel (forward; the backward's dK/dV and dQ configs, each timed as the
whole backward with the other kernel at the heuristic's config):

- "grid" times every feasible config of the kernel's search space (`fatune.search.GPU_SPACE`, all
  axes, the code-structure switches included) as a search trial is timed: compiled ahead in a
  process pool, poisoned outputs checked against torch, quick timing, then the fastest five timed in
  full. The full-timed best is the exhaustive best.
- "search" runs `fatune.search.search_shape` with `--trials` per kernel for each seed (fresh
  storage), then re-times in full the config that kernel's study held as best after N = 10, 20, 30,
  50 finished trials.

- "retime" (after both) times in full, RETIME_ROUNDS times round-robin, every config the table
  compares for a kernel (the grid's best, the heuristic's, each seed's best after each checkpoint):
  the grid's best is the minimum of several full timings, which favours it by the timing noise
  (~2%); retimed, all are measured alike and the table uses the medians.

Fraction = exhaustive best ms / re-timed best-after-N ms (1.0: the search found the best). The table
gives the median over seeds. Results accumulate in OUT.json (a shape's part already there is skipped),
so the runs can be split over several GPU commands.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import optuna
import resumable
import torch

from fatune import search
from fatune.heuristics import default_config
from fatune.measure import KernelRunner, Shape, make_inputs
from fatune.precompile import CompilePool, compile_error
from fatune.spec import AttentionConfig, LaunchConfig

GPU_SHAPES = [
    Shape(4, 32, 4096, 4096, 64, "bfloat16"),
    Shape(4, 32, 4096, 4096, 64, "bfloat16", causal=True),
    Shape(4, 16, 4096, 4096, 128, "bfloat16"),
    Shape(4, 16, 4096, 4096, 128, "bfloat16", causal=True),
    Shape(2, 16, 8192, 8192, 128, "bfloat16", causal=True, window=1024),
    Shape(2, 16, 8192, 8192, 128, "bfloat16", causal=True, kv_heads=2),
]
INTERPRETER_SHAPES = [Shape(1, 2, 40, 40, 16, "float16"), Shape(1, 4, 33, 33, 16, "float16", causal=True, kv_heads=2)]
KERNELS = ("fwd", "dkdv", "dq")
CHECKPOINTS = (10, 20, 30, 50)
FULL_TIMED = 5  # the fastest this many by quick timing are timed in full
RETIME_ROUNDS = 3


class Bench:
    """One shape's inputs, reference and heuristic, and the search's own way of checking and timing a config."""

    def __init__(self, shape: Shape, target: search.Target):
        self.shape, self.target = shape, target
        self.inputs = make_inputs(shape, target.device)
        self.checker = search.Checker(shape, self.inputs)
        arch = None if target.interpret else torch.cuda.get_device_capability()
        self.heuristic = default_config(shape.spec, arch)

    def config(self, kernel: str, launch: LaunchConfig) -> AttentionConfig:
        return self.heuristic.replace(**{kernel: launch})

    def time(self, kernel: str, launch: LaunchConfig, full: bool) -> float:
        """ms of the kernel's run (the whole backward for dq/dkdv); inf if it fails or is wrong."""
        try:
            runner = KernelRunner(self.shape, self.config(kernel, launch), self.inputs)
            runner.prepare()
            for name in search.Checker.KERNEL_OUTPUTS[kernel]:
                getattr(runner.args, name).fill_(float("nan"))
            run = runner.run(kernel)
            run()
            self.target.synchronize()
        except Exception:  # noqa: BLE001 - compile errors, out of resources: not a candidate
            return math.inf
        if not self.checker.error(kernel, runner) <= self.checker.tolerance:
            return math.inf
        return self.target.time_ms(run, quick=not full)


def exhaustive(bench: Bench, kernel: str, pool: CompilePool) -> dict:
    """Every feasible config of the kernel's space, quick-timed; the fastest FULL_TIMED timed in full."""
    space = search.INTERPRETER_SPACE if bench.target.interpret else search.GPU_SPACE
    configs = [c for c in space.grid(kernel, bench.shape, bench.target.sms)
               if search.infeasible(kernel, bench.shape.spec, c, bench.target.shared_limit) is None]
    compiled = {c: pool.submit(bench.shape, bench.config(kernel, c), kernel) for c in configs}
    quick = {}
    for config in configs:
        quick[config] = math.inf if compile_error(compiled[config]) else bench.time(kernel, config, full=False)
    ranked = sorted((c for c in configs if math.isfinite(quick[c])), key=quick.get)[:FULL_TIMED]
    full = {str(c): bench.time(kernel, c, full=True) for c in ranked}
    best = min(full, key=full.get) if full else None
    return {"configs": len(configs), "valid": sum(math.isfinite(v) for v in quick.values()),
            "best": best, "best_ms": full.get(best, math.inf),
            "heuristic": str(getattr(bench.heuristic, kernel)),
            "heuristic_ms": bench.time(kernel, getattr(bench.heuristic, kernel), full=True)}


def best_after(study, n: int) -> LaunchConfig | None:
    """The best complete trial among the study's first n finished trials (trial number order)."""
    finished = [t for t in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
                if t.state in search.FINISHED][:n]
    complete = [t for t in finished if t.state == optuna.trial.TrialState.COMPLETE]
    return LaunchConfig.from_dict(min(complete, key=lambda t: t.value).params) if complete else None


def searched(bench: Bench, seed: int, trials: int, pool: CompilePool) -> dict:
    """One search of the shape (fresh storage); per kernel, the full time of its best after each checkpoint."""
    started = time.perf_counter()
    with resumable.fresh_search(bench.shape, bench.target, trials, seed, pool) as (_, storage):
        row: dict = {"seconds": time.perf_counter() - started}
        for kernel in KERNELS:
            study = optuna.load_study(study_name=search.study_name(bench.target, bench.shape, kernel), storage=storage)
            row[kernel] = {}
            for n in (c for c in CHECKPOINTS if c <= trials):
                config = best_after(study, n)
                row[kernel][str(n)] = {"config": str(config) if config else None,
                                       "ms": bench.time(kernel, config, full=True) if config else math.inf}
    return row


def compared_configs(entry: dict, kernel: str) -> list[str]:
    """The configs the table compares for `kernel`: the grid's best and the heuristic's, and each seed's
    best after each checkpoint."""
    grid = entry["grid"][kernel]
    names = {grid["best"], grid["heuristic"]} | {
        cell["config"] for row in entry.get("search", {}).values() for cell in row.get(kernel, {}).values()
        if cell["config"]}
    return sorted(name for name in names if name)


def retimed(bench: Bench, entry: dict, kernel: str) -> dict[str, list[float]]:
    """Full timings of each compared config, RETIME_ROUNDS rounds, round-robin (the same conditions for all)."""
    times: dict[str, list[float]] = {name: [] for name in compared_configs(entry, kernel)}
    for _ in range(RETIME_ROUNDS):
        for name in times:
            times[name].append(bench.time(kernel, LaunchConfig.parse(name), full=True))
    return times


def timings(entry: dict, kernel: str) -> tuple[Callable[[str, float], float], str]:
    """ms of a compared config (its retimed median when retimed, else the given first timing) and which."""
    retime = entry.get("retime", {}).get(kernel)
    if retime:
        return lambda name, first: statistics.median(retime[name]) if name in retime else first, "retimed"
    return lambda name, first: first, "first timing"


def table(results: dict) -> str:
    """Markdown: per shape and kernel, exhaustive best and the median fraction after N trials."""
    lines = ["| shape | kernel | configs (valid) | exhaustive best ms (config) | heuristic (fraction) | "
             + " | ".join(f"after {n}" for n in CHECKPOINTS) + " | timings |",
             "|---|---|---|---|---|" + "---|" * len(CHECKPOINTS) + "---|"]
    for label, entry in results.items():
        for kernel in KERNELS:
            grid = entry.get("grid", {}).get(kernel)
            if not grid:
                continue
            ms, how = timings(entry, kernel)
            heuristic_ms = ms(grid["heuristic"], grid["heuristic_ms"])
            # the heuristic's config is in the grid: when its own timing beats the grid's (timing noise
            # between two full timings of one config), it is the exhaustive best
            best_ms, best = min((ms(grid["best"], grid["best_ms"]), grid["best"]), (heuristic_ms, grid["heuristic"]))
            cells = [label, kernel, f"{grid['configs']} ({grid['valid']})", f"{best_ms:.3f} ({best})",
                     f"{best_ms / heuristic_ms:.3f}"]
            for n in CHECKPOINTS:
                fractions = [best_ms / ms(seed_row[kernel][str(n)]["config"], seed_row[kernel][str(n)]["ms"])
                             for seed_row in entry.get("search", {}).values() if str(n) in seed_row.get(kernel, {})]
                cells.append(f"{statistics.median(fractions):.3f}" if fractions else "–")
            lines.append("| " + " | ".join([*cells, how]) + " |")
    return "\n".join(lines)


def add_options(parser) -> None:
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--kernels", default=",".join(KERNELS), help="for --part grid: the kernels to time "
                        "(the forward's grid is the largest: 330-660 configs on the H200 shapes)")


def main() -> None:
    args = resumable.arguments(__doc__, ("grid", "search", "retime"), trials=50, extra=add_options)
    results = resumable.load(args.out)
    if args.part == "table":
        print(table(results))
        return
    kernels = args.kernels.split(",")
    if not set(kernels) <= set(KERNELS):
        raise SystemExit(f"--kernels: expected a comma-separated subset of {','.join(KERNELS)}, got {args.kernels!r}")
    shapes = resumable.pick(INTERPRETER_SHAPES if args.interpret else GPU_SHAPES, args.shapes)
    target = search.Target.detect(args.interpret)
    with resumable.compile_pool(args, target) as pool:
        for shape in shapes:
            entry = results.setdefault(shape.label(), {})
            bench = Bench(shape, target)
            if args.part == "grid":
                for kernel in kernels:
                    if kernel not in entry.setdefault("grid", {}):
                        entry["grid"][kernel] = exhaustive(bench, kernel, pool)
                        print(f"{shape.label()} {kernel}: {entry['grid'][kernel]}", flush=True)
                        resumable.save(args.out, results)
            elif args.part == "retime":
                for kernel in kernels:
                    if kernel in entry.get("grid", {}) and entry.get("search") \
                            and kernel not in entry.setdefault("retime", {}):
                        entry["retime"][kernel] = retimed(bench, entry, kernel)
                        print(f"{shape.label()} {kernel} retimed: {entry['retime'][kernel]}", flush=True)
                        resumable.save(args.out, results)
            else:
                for seed in (int(s) for s in args.seeds.split(",")):
                    if str(seed) not in entry.setdefault("search", {}):
                        entry["search"][str(seed)] = searched(bench, seed, args.trials, pool)
                        print(f"{shape.label()} seed {seed}: {entry['search'][str(seed)]}", flush=True)
                        resumable.save(args.out, results)
    print(table(results))


if __name__ == "__main__":
    main()
