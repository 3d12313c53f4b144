"""Search quality (issue 14): how close `fatune search` gets to the best config of each kernel's whole space.

    python benchmarks/search_quality.py OUT.json --part grid [--shapes 0,1] [--kernels fwd] [--regrid]   # exhaustive
    python benchmarks/search_quality.py OUT.json --part search [--seeds 0,1,2] [--trials 50] [--sampler random]
        [--checkpoints 10,20,30,50]
    python benchmarks/search_quality.py OUT.json --part retime                   # the compared configs, alike
    python benchmarks/search_quality.py OUT.json --part table                    # the markdown table
    TRITON_INTERPRET=1 python benchmarks/search_quality.py OUT.json --part grid --interpret   # CPU smoke run

Shapes: d64 and d128, causal or not, a causal sliding window (1024 keys) and GQA 8:1 causal; bf16,
B·L = 16384. Per shape and kernel (forward; the backward's dK/dV and dQ configs, each timed as the
whole backward with the other kernel at the heuristic's config):

- "grid" times every feasible config of the kernel's search space (`fatune.search.GPU_SPACE`, all
  axes, the code-structure switches included) as a search trial is timed: compiled ahead in a
  process pool, poisoned outputs checked against torch, quick timing, then the fastest five timed in
  full. The full-timed best is the exhaustive best. Each grid records the hash of the axes it covered
  (`fatune.search.axes_digest`); `--regrid` times again the grids of a space that has changed since.
- "search" runs `fatune.search.search_shape` with `--trials` per kernel for each seed (fresh
  storage), then re-times in full the config that kernel's study held as best after N = 10, 20, 30,
  50 finished trials.

  `--sampler` draws the trials with another of `fatune.search.SAMPLERS` (kept apart in OUT.json;
  the table's second part compares the samplers after each checkpoint).
- "retime" (after both) times in full, RETIME_ROUNDS times round-robin, every config the table
  compares for a kernel (the grid's best, the heuristic's, each seed's best after each checkpoint, of
  every sampler; all again when a sampler's search added configs):
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
INTERPRETER_SHAPES = [Shape(1, 1, 24, 24, 16, "float16"), Shape(1, 4, 33, 33, 16, "float16", causal=True, kv_heads=2)]
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
        self.heuristic = default_config(shape.spec, arch, group=shape.heads // shape.kv_heads)

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
               if search.infeasible(kernel, bench.shape.spec, c, bench.target.shared_limit, bench.target.arch) is None]
    compiled = {c: pool.submit(bench.shape, bench.config(kernel, c), kernel) for c in configs}
    quick = {}
    for config in configs:
        quick[config] = math.inf if compile_error(compiled[config]) else bench.time(kernel, config, full=False)
    ranked = sorted((c for c in configs if math.isfinite(quick[c])), key=quick.get)[:FULL_TIMED]
    full = {str(c): bench.time(kernel, c, full=True) for c in ranked}
    best = min(full, key=full.get) if full else None
    return {"space": search.axes_digest(space, bench.target, bench.shape, kernel),
            "configs": len(configs), "valid": sum(math.isfinite(v) for v in quick.values()),
            "best": best, "best_ms": full.get(best, math.inf),
            "heuristic": str(getattr(bench.heuristic, kernel)),
            "heuristic_ms": bench.time(kernel, getattr(bench.heuristic, kernel), full=True)}


def best_after(study, n: int) -> LaunchConfig | None:
    """The best complete trial among the study's first n finished trials (trial number order)."""
    finished = [t for t in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
                if search.counts(t)][:n]
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


def search_key(sampler: str) -> str:
    """Where a sampler's searches are kept in a shape's entry ("search" for the default sampler)."""
    return "search" if sampler == search.SAMPLERS[0] else f"search-{sampler}"


def searches(entry: dict) -> dict[str, dict]:
    """sampler -> {seed: its row} of every sampler searched on this shape."""
    return {sampler: entry[search_key(sampler)] for sampler in search.SAMPLERS if entry.get(search_key(sampler))}


def compared_configs(entry: dict, kernel: str) -> list[str]:
    """The configs the table compares for `kernel`: the grid's best and the heuristic's, and each seed's
    best after each checkpoint, of every sampler."""
    grid = entry["grid"][kernel]
    names = {grid["best"], grid["heuristic"]} | {
        cell["config"] for rows in searches(entry).values() for row in rows.values()
        for cell in row.get(kernel, {}).values() if cell["config"]}
    return sorted(name for name in names if name)


def retimed(bench: Bench, entry: dict, kernel: str) -> dict[str, list[float]]:
    """Full timings of each compared config, RETIME_ROUNDS rounds, round-robin (the same conditions for all)."""
    times: dict[str, list[float]] = {name: [] for name in compared_configs(entry, kernel)}
    for _ in range(RETIME_ROUNDS):
        for name in times:
            times[name].append(bench.time(kernel, LaunchConfig.parse(name), full=True))
    return times


def timings(entry: dict, kernel: str) -> tuple[Callable[[str, float], float], str]:
    """ms of a compared config and which timings they are: retimed medians when every compared config was
    retimed (alike), else every config's first timing (a grid timed again since, or a new search's picks, would
    otherwise be set against medians of other rounds)."""
    retime = entry.get("retime", {}).get(kernel)
    if retime and set(compared_configs(entry, kernel)) <= set(retime):
        return lambda name, first: statistics.median(retime[name]) if name in retime else first, "retimed"
    return lambda name, first: first, "first timing"


def exhaustive_best(entry: dict, kernel: str) -> tuple[float, str, float]:
    """(best ms, its config, the heuristic's ms): the heuristic's config is in the grid, so when its own
    timing beats the grid's best (timing noise between two full timings of one config) it is the best."""
    grid = entry["grid"][kernel]
    ms, _ = timings(entry, kernel)
    heuristic_ms = ms(grid["heuristic"], grid["heuristic_ms"])
    best_ms, best = min((ms(grid["best"], grid["best_ms"]), grid["best"]), (heuristic_ms, grid["heuristic"]))
    return best_ms, best, heuristic_ms


def fraction_after(entry: dict, kernel: str, rows: dict, n: int) -> str:
    """The median over seeds of exhaustive best ms / the seed's best after n trials, or '–'."""
    ms, _ = timings(entry, kernel)
    best_ms = exhaustive_best(entry, kernel)[0]
    fractions = [best_ms / ms(row[kernel][str(n)]["config"], row[kernel][str(n)]["ms"])
                 for row in rows.values() if str(n) in row.get(kernel, {})]
    return f"{statistics.median(fractions):.3f}" if fractions else "–"


def sampler_table(results: dict) -> str:
    """Markdown: per shape and kernel, each sampler's median fraction after N trials (shapes with more than
    one sampler searched)."""
    lines = ["| shape | kernel | sampler | seeds | " + " | ".join(f"after {n}" for n in CHECKPOINTS) + " |",
             "|---|---|---|---|" + "---|" * len(CHECKPOINTS)]
    for label, entry in results.items():
        found = searches(entry)
        if len(found) < 2:
            continue
        for kernel in KERNELS:
            if kernel not in entry.get("grid", {}):
                continue
            for sampler, rows in found.items():
                cells = [label, kernel, sampler, str(len(rows)), *(fraction_after(entry, kernel, rows, n)
                                                                   for n in CHECKPOINTS)]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


def table(results: dict) -> str:
    """Markdown: per shape and kernel, exhaustive best and the median fraction after N trials (the default
    sampler), then the samplers compared where several were searched."""
    lines = ["| shape | kernel | configs (valid) | exhaustive best ms (config) | heuristic (fraction) | "
             + " | ".join(f"after {n}" for n in CHECKPOINTS) + " | timings |",
             "|---|---|---|---|---|" + "---|" * len(CHECKPOINTS) + "---|"]
    for label, entry in results.items():
        for kernel in KERNELS:
            grid = entry.get("grid", {}).get(kernel)
            if not grid:
                continue
            how = timings(entry, kernel)[1]
            best_ms, best, heuristic_ms = exhaustive_best(entry, kernel)
            cells = [label, kernel, f"{grid['configs']} ({grid['valid']})", f"{best_ms:.3f} ({best})",
                     f"{best_ms / heuristic_ms:.3f}",
                     *(fraction_after(entry, kernel, entry.get("search", {}), n) for n in CHECKPOINTS)]
            lines.append("| " + " | ".join([*cells, how]) + " |")
    samplers = sampler_table(results)
    return "\n".join(lines) + (f"\n\n{samplers}" if samplers else "")


def add_options(parser) -> None:
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--sampler", default=search.SAMPLERS[0], choices=search.SAMPLERS,
                        help="for --part search: how the trials are drawn (fatune.search.SAMPLERS)")
    parser.add_argument("--checkpoints", default=",".join(map(str, CHECKPOINTS)),
                        help="the trial counts after which each study's best is re-timed (a smoke run: fewer)")
    parser.add_argument("--kernels", default=",".join(KERNELS), help="for --part grid: the kernels to time "
                        "(the forward's grid is the largest: 330-660 configs on the H200 shapes)")
    parser.add_argument("--regrid", action="store_true", help="for --part grid: time the kernels' grids again "
                        "where the stored one covered another space (an axis or a value added since; grids from "
                        "before session 9 record none: every one is timed again)")


def main() -> None:
    args = resumable.arguments(__doc__, ("grid", "search", "retime"), trials=50, extra=add_options)
    global CHECKPOINTS
    CHECKPOINTS = tuple(int(n) for n in args.checkpoints.split(","))
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
                    stored = entry.setdefault("grid", {}).get(kernel)
                    space = search.INTERPRETER_SPACE if target.interpret else search.GPU_SPACE
                    if stored is None or (args.regrid and stored.get("space")
                                          != search.axes_digest(space, target, shape, kernel)):
                        entry["grid"][kernel] = exhaustive(bench, kernel, pool)
                        print(f"{shape.label()} {kernel}: {entry['grid'][kernel]}", flush=True)
                        resumable.save(args.out, results)
            elif args.part == "retime":
                for kernel in kernels:
                    if kernel in entry.get("grid", {}) and searches(entry) \
                            and set(compared_configs(entry, kernel)) - set(entry.setdefault("retime", {}).get(kernel, {})):
                        entry["retime"][kernel] = retimed(bench, entry, kernel)
                        print(f"{shape.label()} {kernel} retimed: {entry['retime'][kernel]}", flush=True)
                        resumable.save(args.out, results)
            else:
                search.SAMPLER = args.sampler
                rows = entry.setdefault(search_key(args.sampler), {})
                for seed in (int(s) for s in args.seeds.split(",")):
                    if str(seed) not in rows:
                        rows[str(seed)] = searched(bench, seed, args.trials, pool)
                        print(f"{shape.label()} {args.sampler} seed {seed}: {rows[str(seed)]}", flush=True)
                        resumable.save(args.out, results)
    print(table(results))


if __name__ == "__main__":
    main()
