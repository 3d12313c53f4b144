"""Suite `search-quality`: how fast `fatune search` finds a good config, against the best of each kernel's space.

Shapes (`GPU_SHAPES`): d64 and d128, causal or not, a causal sliding window of 1024 keys and GQA 8:1 causal;
bf16, B·L = 16384. Per shape and kernel (the forward; the backward's dK/dV and dQ configs, each timed as the
whole backward with the other kernel at the heuristic's config), in parts (`--part`):

- grid: every feasible config of the kernel's search space (`fatune.tuning.space.GPU_SPACE`, all axes, the
  code-structure switches included) timed as a search trial is: compiled ahead in a process pool, poisoned
  outputs checked against torch, a quick timing, then the fastest FULL_TIMED timed in full (medians of CUDA
  events, `triton.testing.do_bench`). The full-timed best is the exhaustive best. A grid records the hash of
  the axes it covered (`fatune.tuning.space.axes_digest`); `--regrid` times again the grids of a space that
  changed since.
- search: `fatune.tuning.search.search_shape` with `--trials` per kernel for each seed (`--seeds`, fresh
  storage), then the config each kernel's study held as best after N finished trials (`--checkpoints`,
  default 10, 20, 30, 50) timed in full. `--sampler` draws the trials with another of
  `fatune.tuning.study.SAMPLERS` (kept apart; the second table compares the samplers).
- retime (after both): every config the table compares for a kernel (the grid's best, the heuristic's, each
  seed's best after each checkpoint, of every sampler) timed in full RETIME_ROUNDS times round-robin, so
  that all are measured alike (the grid's best, the minimum of several full timings, is otherwise favoured
  by the timing noise, about 2%); the table then uses the medians.
- table: the tables of what is stored, nothing timed.

Fraction = exhaustive best ms / best-after-N ms (1.0: the search found the best), the median over seeds.
What each part measures accumulates in the output folder's state.json (see fatune.bench.resumable); results.json
holds one row per shape, kernel, sampler and checkpoint. `--interpret` runs tiny shapes in Triton's interpreter
(wall-clock timings: a smoke run).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import optuna

from fatune.bench import resumable
from fatune.bench.results import PlotSpec, Report
from fatune.hardware import sm_count
from fatune.kernel.family import family
from fatune.kernel.spec import AttentionConfig, LaunchConfig
from fatune.tuning import search, space, study
from fatune.tuning import target as targets
from fatune.tuning.precompile import CompilePool, compile_error
from fatune.tuning.shape import Shape, make_inputs
from fatune.tuning.timing import KernelRunner

NAME = "search-quality"
PARTS = ("grid", "search", "retime", "table")
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
TRIALS = 50
FULL_TIMED = 5  # the fastest this many by quick timing are timed in full
RETIME_ROUNDS = 3
PLOT = PlotSpec(x="trials", y="fraction", panel=("kernel", "sampler"), line="shape", xlog=False,
                xlabel="trials per kernel", ylabel="exhaustive best / search's best (median over seeds)")


class Bench:
    """One shape's inputs, reference and heuristic, and the search's own way of checking and timing a config."""

    def __init__(self, shape: Shape, target: search.Target):
        self.shape, self.target = shape, target
        self.inputs = make_inputs(shape, target.device)
        self.checker = targets.Checker(shape, self.inputs)
        # the Triton family's own heuristic (its studies' start): the built-in config may run Gluon kernels
        self.heuristic = family("triton").heuristic(shape.problem, target.arch_or_none,
                                                    target.sms or sm_count(target.device))

    def config(self, kernel: str, launch: LaunchConfig) -> AttentionConfig:
        return self.heuristic.replace(**{kernel: launch})

    def time(self, kernel: str, launch: LaunchConfig, full: bool) -> float:
        """ms of the kernel's run (the whole backward for dq/dkdv); inf if it fails or is wrong."""
        try:
            runner = KernelRunner(self.shape, self.config(kernel, launch), self.inputs)
            runner.prepare()
            for name in targets.Checker.KERNEL_OUTPUTS[kernel]:
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
    target = bench.target
    searched = space.default_space(target)
    configs = [c for c in searched.grid(kernel, bench.shape, target.sms)
               if space.infeasible(kernel, bench.shape.spec, c, target.shared_limit, target.arch) is None]
    compiled = {c: pool.submit(bench.shape, bench.config(kernel, c), kernel) for c in configs}
    quick = {}
    for config in configs:
        quick[config] = math.inf if compile_error(compiled[config]) else bench.time(kernel, config, full=False)
    ranked = sorted((c for c in configs if math.isfinite(quick[c])), key=quick.get)[:FULL_TIMED]
    full = {str(c): bench.time(kernel, c, full=True) for c in ranked}
    best = min(full, key=full.get) if full else None
    return {"space": space.axes_digest(searched, target, bench.shape, kernel),
            "configs": len(configs), "valid": sum(math.isfinite(v) for v in quick.values()),
            "best": best, "best_ms": full.get(best, math.inf),
            "heuristic": str(getattr(bench.heuristic, kernel)),
            "heuristic_ms": bench.time(kernel, getattr(bench.heuristic, kernel), full=True)}


def best_after(kernel_study, n: int) -> LaunchConfig | None:
    """The best complete trial among the study's first n finished trials (trial number order)."""
    finished = [t for t in sorted(kernel_study.get_trials(deepcopy=False), key=lambda t: t.number)
                if study.counts(t)][:n]
    complete = [t for t in finished if t.state == optuna.trial.TrialState.COMPLETE]
    return LaunchConfig.from_dict(min(complete, key=lambda t: t.value).params) if complete else None


def searched(bench: Bench, seed: int, trials: int, checkpoints: tuple[int, ...], pool: CompilePool) -> dict:
    """One search of the shape (fresh storage); per kernel, the full time of its best after each checkpoint."""
    started = time.perf_counter()
    with resumable.fresh_search(bench.shape, bench.target, trials, seed, pool) as (_, storage):
        row: dict = {"seconds": time.perf_counter() - started}
        for kernel in KERNELS:
            name = study.study_name(bench.target, bench.shape, kernel)
            kernel_study = optuna.load_study(study_name=name, storage=storage)
            row[kernel] = {}
            for n in (c for c in checkpoints if c <= trials):
                config = best_after(kernel_study, n)
                row[kernel][str(n)] = {"config": str(config) if config else None,
                                       "ms": bench.time(kernel, config, full=True) if config else math.inf}
    return row


def search_key(sampler: str) -> str:
    """Where a sampler's searches are kept in a shape's entry ("search" for the default sampler)."""
    return "search" if sampler == study.SAMPLERS[0] else f"search-{sampler}"


def searches(entry: dict) -> dict[str, dict]:
    """sampler -> {seed: its row} of every sampler searched on this shape."""
    return {sampler: entry[search_key(sampler)] for sampler in study.SAMPLERS if entry.get(search_key(sampler))}


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
        for name, timed in times.items():
            timed.append(bench.time(kernel, LaunchConfig.parse(name), full=True))
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


def fraction_after(entry: dict, kernel: str, rows: dict, n: int) -> float | None:
    """The median over seeds of exhaustive best ms / the seed's best after n trials (None: no seed got there)."""
    ms, _ = timings(entry, kernel)
    best_ms = exhaustive_best(entry, kernel)[0]
    fractions = [best_ms / ms(row[kernel][str(n)]["config"], row[kernel][str(n)]["ms"])
                 for row in rows.values() if str(n) in row.get(kernel, {})]
    return statistics.median(fractions) if fractions else None


def _cell(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def sampler_table(state: dict, checkpoints: tuple[int, ...]) -> str:
    """Markdown: per shape and kernel, each sampler's median fraction after N trials (shapes with more than
    one sampler searched)."""
    lines = ["| shape | kernel | sampler | seeds | " + " | ".join(f"after {n}" for n in checkpoints) + " |",
             "|---|---|---|---|" + "---|" * len(checkpoints)]
    for label, entry in state.items():
        found = searches(entry)
        if len(found) < 2:
            continue
        for kernel in KERNELS:
            if kernel not in entry.get("grid", {}):
                continue
            for sampler, rows in found.items():
                cells = [label, kernel, sampler, str(len(rows)),
                         *(_cell(fraction_after(entry, kernel, rows, n)) for n in checkpoints)]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


def table(state: dict, checkpoints: tuple[int, ...] = CHECKPOINTS) -> str:
    """Markdown: per shape and kernel, exhaustive best and the median fraction after N trials (the default
    sampler), then the samplers compared where several were searched."""
    lines = ["| shape | kernel | configs (valid) | exhaustive best ms (config) | heuristic (fraction) | "
             + " | ".join(f"after {n}" for n in checkpoints) + " | timings |",
             "|---|---|---|---|---|" + "---|" * len(checkpoints) + "---|"]
    for label, entry in state.items():
        for kernel in KERNELS:
            grid = entry.get("grid", {}).get(kernel)
            if not grid:
                continue
            how = timings(entry, kernel)[1]
            best_ms, best, heuristic_ms = exhaustive_best(entry, kernel)
            cells = [label, kernel, f"{grid['configs']} ({grid['valid']})", f"{best_ms:.3f} ({best})",
                     f"{best_ms / heuristic_ms:.3f}",
                     *(_cell(fraction_after(entry, kernel, entry.get("search", {}), n)) for n in checkpoints)]
            lines.append("| " + " | ".join([*cells, how]) + " |")
    samplers = sampler_table(state, checkpoints)
    return "\n".join(lines) + (f"\n\n{samplers}" if samplers else "")


def rows(state: dict) -> list[dict]:
    """One row per shape, kernel, sampler and checkpoint stored (one per shape and kernel before any search)."""
    found = []
    for label, entry in state.items():
        for kernel in KERNELS:
            grid = entry.get("grid", {}).get(kernel)
            if not grid:
                continue
            best_ms, best, heuristic_ms = exhaustive_best(entry, kernel)
            base = {"suite": NAME, "shape": label, "kernel": kernel, "configs": grid["configs"],
                    "valid": grid["valid"], "exhaustive_best": best, "exhaustive_best_ms": best_ms,
                    "heuristic": grid["heuristic"], "heuristic_fraction": best_ms / heuristic_ms,
                    "timings": timings(entry, kernel)[1]}
            points = [(sampler, seeds, int(n)) for sampler, seeds in searches(entry).items()
                      for n in sorted({n for row in seeds.values() for n in row.get(kernel, {})}, key=int)]
            for sampler, seeds, n in points:
                found.append({**base, "sampler": sampler, "seeds": len(seeds), "trials": n,
                              "fraction": fraction_after(entry, kernel, seeds, n)})
            if not points:
                found.append({**base, "sampler": None, "seeds": 0, "trials": None, "fraction": None})
    return found


def report(state: dict, checkpoints: tuple[int, ...]) -> Report:
    return Report(NAME, rows(state), table(state, checkpoints), plot=PLOT)


def run(folder: Path, part: str, *, interpret: bool, shapes: list[int] | None = None, kernels=KERNELS,
        seeds=(0, 1, 2), trials: int = TRIALS, checkpoints: tuple[int, ...] = CHECKPOINTS,
        sampler: str = study.SAMPLERS[0], regrid: bool = False, compile_workers: int = 1,
        echo: Callable[[str], None] = print) -> Report:
    """Run one part for the chosen shapes, extending the folder's state.json; the report of all stored."""
    state = resumable.load(folder)
    if part == "table":
        return report(state, checkpoints)
    target = search.Target.detect(interpret)
    chosen = resumable.pick(INTERPRETER_SHAPES if interpret else GPU_SHAPES, shapes)
    previous = study.SAMPLER
    study.SAMPLER = sampler  # the searches of this run draw with it
    try:
        with resumable.compile_pool(target, compile_workers) as pool:
            for shape in chosen:
                entry = state.setdefault(shape.label(), {})
                bench = Bench(shape, target)
                if part == "grid":
                    for kernel in kernels:
                        stored = entry.setdefault("grid", {}).get(kernel)
                        digest = space.axes_digest(space.default_space(target), target, shape, kernel)
                        if stored is None or (regrid and stored.get("space") != digest):
                            entry["grid"][kernel] = exhaustive(bench, kernel, pool)
                            echo(f"{shape.label()} {kernel}: {entry['grid'][kernel]}")
                            resumable.save(folder, state)
                elif part == "retime":
                    for kernel in kernels:
                        if kernel in entry.get("grid", {}) and searches(entry) and \
                                set(compared_configs(entry, kernel)) - set(entry.setdefault("retime", {}).get(kernel, {})):
                            entry["retime"][kernel] = retimed(bench, entry, kernel)
                            echo(f"{shape.label()} {kernel} retimed: {entry['retime'][kernel]}")
                            resumable.save(folder, state)
                else:
                    stored = entry.setdefault(search_key(sampler), {})
                    for seed in seeds:
                        if str(seed) not in stored:
                            stored[str(seed)] = searched(bench, seed, trials, checkpoints, pool)
                            echo(f"{shape.label()} {sampler} seed {seed}: {stored[str(seed)]}")
                            resumable.save(folder, state)
    finally:
        study.SAMPLER = previous
    return report(state, checkpoints)
