"""Suite `tuning-gain`: whether tuning pays, tuned entries against the built-in heuristic.

Parts (`--part`):

- gain: each shape (`GAIN_SHAPES`: head dims 80/96/192 the heuristic was not written for, batch 1 at a long L,
  GQA 4:1 and 8:1, L_q != L_k, fp16) is searched (`fatune.tuning.search.search_shape`, `--trials` per kernel,
  fresh storage); the winners' training step and the heuristic's are timed side by side: gain = heuristic ms /
  tuned ms.
- nearest: a shape is searched at the length of the entry that would serve it (its bucket's representative
  length for L = 3000 and 6000; the nearer entry of the shipped H200 DB's grid for L = 4096 and 16384) and at its
  own length; both winners are timed at the shape's own length: loss = 1 - exact ms / representative ms.
- tie: a length exactly between two grid lengths of a tuned DB (`--db`; L = 1024 between 512 and 2048, 4096
  between 2048 and 8192, 16384 between 8192 and 32768) is as near the entry below as the one above; both
  entries' configs and the heuristic's are timed at the shape's own length: which side a tie should go to.
- table: the table of what is stored, nothing timed.

Training steps are timed through autograd (`fatune.tuning.timing.time_training_step`: forward, then forward +
backward from a random dO, warm-up and the first call kept out, medians of CUDA-event timings); configs compared
on one shape are timed alternately, ROUNDS times each (medians: same-config timings drift by a few per cent), and
once when they launch the same kernels. Results accumulate in the output folder's state.json (see
fatune.bench.resumable); results.json holds one row per part, shape and config. `--interpret` runs tiny shapes in
Triton's interpreter (wall-clock timings: a smoke run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
from collections.abc import Callable
from pathlib import Path

import fatune
from fatune.bench import resumable
from fatune.bench.results import Report
from fatune.db import TunedDB, bucket_distance, is_decode, is_stale, nearest
from fatune.hardware import device_identity
from fatune.kernel.spec import AttentionConfig, LaunchConfig
from fatune.tuning import search
from fatune.tuning.precompile import CompilePool
from fatune.tuning.shape import Shape, make_inputs, shape_key
from fatune.tuning.timing import time_training_step
from fatune.tuning.trials import shape_heuristic

NAME = "tuning-gain"
PARTS = ("gain", "nearest", "tie", "table")
TRIALS = 30
DEFAULT_DB = "tuned_db/nvidia-h200.sqlite"
GAIN_SHAPES = [
    Shape(4, 24, 4096, 4096, 80, "bfloat16", causal=True),
    Shape(4, 20, 4096, 4096, 96, "bfloat16"),
    Shape(4, 10, 4096, 4096, 192, "bfloat16", causal=True),
    Shape(1, 16, 16384, 16384, 128, "bfloat16", causal=True),
    Shape(4, 16, 4096, 4096, 128, "bfloat16", causal=True, kv_heads=4),
    Shape(4, 16, 4096, 4096, 128, "bfloat16", causal=True, kv_heads=2),
    Shape(4, 16, 1024, 4096, 128, "bfloat16"),
    Shape(4, 16, 4096, 4096, 128, "float16", causal=True),
]
NEAREST_SHAPES = [  # (the shape, the length of the entry that serves it)
    (Shape(5, 16, 3000, 3000, 128, "bfloat16", causal=True), 4096),  # its own bucket's representative length
    (Shape(3, 32, 6000, 6000, 64, "bfloat16"), 8192),
    # the shipped H200 DB's grid (L = 512, 2048, 8192, 32768): a length between two entries, served by the nearer
    (Shape(4, 16, 4096, 4096, 128, "bfloat16", causal=True), 2048),
    (Shape(1, 16, 16384, 16384, 128, "bfloat16"), 8192),
]
TIE_SHAPES = [Shape(max(1, 16384 // length), 2048 // d, length, length, d, "bfloat16", causal=causal)
              for length in (1024, 4096, 16384) for d in (64, 128) for causal in (False, True)]
INTERPRETER_GAIN = [Shape(1, 2, 40, 40, 24, "float16", causal=True), Shape(1, 4, 24, 56, 16, "float16", kv_heads=2)]
INTERPRETER_NEAREST = [(Shape(1, 2, 40, 40, 16, "float16", causal=True), 64)]
INTERPRETER_TIE = [Shape(1, 2, 64, 64, 16, "float16")]
ROUNDS = 3  # configs timed alternately this many times each (medians): same-config timings drift by a few %


def searched_config(shape: Shape, target: search.Target, trials: int, pool: CompilePool) -> AttentionConfig:
    """The winners of a search of `shape` with a fresh storage."""
    with resumable.fresh_search(shape, target, trials, 0, pool) as (result, _):
        return result.config


def step_ms(shape: Shape, config: AttentionConfig, target: search.Target) -> float:
    """Training-step ms of `config` on `shape` (one wall-clock run in the interpreter)."""
    inputs = make_inputs(shape, target.device)
    kwargs = shape.attention_kwargs(target.device)

    def attention(q, k, v):
        return fatune.attention(q, k, v, config=config, **kwargs)

    if target.interpret:
        return search._interpreted_step(shape, config, inputs)["fwd_bwd_ms"]
    return time_training_step(attention, inputs)["fwd_bwd_ms"]


def same_kernels(shape: Shape, first: AttentionConfig, second: AttentionConfig) -> bool:
    """Whether two configs launch the same kernels on `shape` (GQA packing means nothing without GQA)."""
    if shape.kv_heads == shape.heads:
        first, second = (c.replace(fwd=dataclasses.replace(c.fwd, pack_gqa=0)) if isinstance(c.fwd, LaunchConfig)
                         else c for c in (first, second))
    return first == second


def side_by_side(shape: Shape, first: AttentionConfig, second: AttentionConfig,
                 target: search.Target) -> tuple[float, float]:
    """Training-step ms of two configs on `shape`, timed alternately (medians of ROUNDS); one timing
    for both when they launch the same kernels (a gain of exactly 1, a loss of exactly 0)."""
    if same_kernels(shape, first, second):
        ms = step_ms(shape, first, target)
        return ms, ms
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(1 if target.interpret else ROUNDS):
        for config, timed in zip((first, second), times):
            timed.append(step_ms(shape, config, target))
    return statistics.median(times[0]), statistics.median(times[1])


def short(config: AttentionConfig) -> str:
    """'fwd 128x64/w8/s3, dkdv 32x64/w4/s3, dq 128x64/w8/s3' (LaunchConfig's short form)."""
    return ", ".join(f"{kernel} {getattr(config, kernel)}" for kernel in ("fwd", "dkdv", "dq"))


def heuristic_of(shape: Shape, target: search.Target) -> AttentionConfig:
    """The config a call of `shape` runs with no tuned entry (the dispatcher's heuristic)."""
    return shape_heuristic(shape, target)


def tie_entries(shape: Shape, db_path: str, target: search.Target) -> tuple[dict[str, AttentionConfig], str | None]:
    """The configs of the DB's usable entries for `shape` at the least bucket distance, named by their buckets,
    and the name of the one `fatune.db.nearest` serves the call with (None: no entry)."""
    gpu, capability = device_identity(target.device)
    key = shape_key(shape)
    filters = {"gpu": gpu, "capability": capability, **dataclasses.asdict(key)}
    del filters["seqlen_q_bucket"], filters["seqlen_k_bucket"]
    with TunedDB(db_path, readonly=True) as db:
        usable = [e for e in db.entries(**filters) if not is_stale(e) and not is_decode(e.seqlen_q_bucket)]
    served = nearest(usable, key)
    if served is None:
        return {}, None
    least = bucket_distance(served[0], key)

    def name(entry) -> str:
        return f"Lq={entry.seqlen_q_bucket} Lk={entry.seqlen_k_bucket} entry"

    tied = sorted((e for e in usable if bucket_distance(e, key) == least),
                  key=lambda e: (e.seqlen_q_bucket, e.seqlen_k_bucket))
    return {name(e): e.attention_config() for e in tied}, name(served[0])


def tie_row(shape: Shape, db_path: str, target: search.Target, echo: Callable[[str], None]) -> dict | None:
    """Training-step ms of the tied entries' configs and the heuristic's at `shape`, alternately (medians), and
    which entry the dispatcher serves; None when fewer than two entries tie."""
    configs, served = tie_entries(shape, db_path, target)
    if len(configs) < 2:
        echo(f"tie {shape.label()}: {len(configs)} nearest entries in {db_path}, no tie to time")
        return None
    configs["heuristic"] = heuristic_of(shape, target)
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(1 if target.interpret else ROUNDS):
        for name, config in configs.items():
            times[name].append(step_ms(shape, config, target))
    row = {name: {"config": short(config), "ms": statistics.median(times[name])} for name, config in configs.items()}
    row[served]["served"] = True
    return row


def table(state: dict) -> str:
    lines = [("| part | shape | heuristic / other config | ms (heuristic or representative) | ms (tuned or exact) "
              "| tuned gain or nearest-bucket loss |"), "|---|---|---|---|---|---|"]
    for label, row in state.get("gain", {}).items():
        lines.append(f"| gain | {label} | {row['heuristic']} | {row['heuristic_ms']:.3f} | {row['tuned_ms']:.3f} "
                     f"({row['tuned']}) | {row['heuristic_ms'] / row['tuned_ms']:.3f}x |")
    for label, row in state.get("nearest", {}).items():
        lines.append(f"| nearest | {label} | {row['representative']} | {row['representative_ms']:.3f} | "
                     f"{row['exact_ms']:.3f} ({row['exact']}) | "
                     f"{100 * (1 - row['exact_ms'] / row['representative_ms']):.1f}% |")
    if state.get("tie"):
        lines += ["", "| tie | shape | config | training step ms | vs fastest |", "|---|---|---|---|---|"]
        for label, row in state["tie"].items():
            fastest = min(timed["ms"] for timed in row.values())
            for name, timed in row.items():
                served = " (served)" if timed.get("served") else ""
                lines.append(f"| tie | {label} | {name}{served}: {timed['config']} | {timed['ms']:.3f} | "
                             f"{timed['ms'] / fastest:.3f}x |")
    return "\n".join(lines)


def rows(state: dict) -> list[dict]:
    """One row per part, shape and timed config: its name, config, training-step ms and ratio."""
    found = []
    for label, row in state.get("gain", {}).items():
        found += [{"suite": NAME, "part": "gain", "shape": label, "config_name": "heuristic",
                   "config": row["heuristic"], "ms": row["heuristic_ms"], "ratio": 1.0},
                  {"suite": NAME, "part": "gain", "shape": label, "config_name": "tuned", "config": row["tuned"],
                   "ms": row["tuned_ms"], "ratio": row["heuristic_ms"] / row["tuned_ms"]}]
    for label, row in state.get("nearest", {}).items():
        found += [{"suite": NAME, "part": "nearest", "shape": label,
                   "config_name": f"searched at L={row['representative_length']}", "config": row["representative"],
                   "ms": row["representative_ms"], "ratio": 1.0},
                  {"suite": NAME, "part": "nearest", "shape": label, "config_name": "searched at its own L",
                   "config": row["exact"], "ms": row["exact_ms"], "ratio": row["representative_ms"] / row["exact_ms"]}]
    for label, row in state.get("tie", {}).items():
        fastest = min(timed["ms"] for timed in row.values())
        found += [{"suite": NAME, "part": "tie", "shape": label, "config_name": name, "config": timed["config"],
                   "ms": timed["ms"], "ratio": timed["ms"] / fastest, "served": bool(timed.get("served"))}
                  for name, timed in row.items()]
    return found


def report(state: dict) -> Report:
    return Report(NAME, rows(state), table(state))


def run(folder: Path, part: str, *, interpret: bool, shapes: list[int] | None = None, trials: int = TRIALS,
        db: str = DEFAULT_DB, compile_workers: int = 1, echo: Callable[[str], None] = print) -> Report:
    """Run one part for the chosen shapes, extending the folder's state.json; the report of all stored."""
    state = resumable.load(folder)
    if part == "table":
        return report(state)
    target = search.Target.detect(interpret)
    cases = {"gain": INTERPRETER_GAIN if interpret else GAIN_SHAPES,
             "nearest": INTERPRETER_NEAREST if interpret else NEAREST_SHAPES,
             "tie": INTERPRETER_TIE if interpret else TIE_SHAPES}[part]
    done = state.setdefault(part, {})
    pool_context = contextlib.nullcontext() if part == "tie" else resumable.compile_pool(target, compile_workers)
    with pool_context as pool:
        for case in resumable.pick(cases, shapes):
            shape, length = case if part == "nearest" else (case, 0)
            if shape.label() in done:
                continue
            if part == "tie":
                row = tie_row(shape, db, target, echo)
                if row is None:
                    continue
            elif part == "gain":
                tuned, heuristic = searched_config(shape, target, trials, pool), heuristic_of(shape, target)
                heuristic_ms, tuned_ms = side_by_side(shape, heuristic, tuned, target)
                row = {"tuned": short(tuned), "tuned_ms": tuned_ms, "heuristic": short(heuristic),
                       "heuristic_ms": heuristic_ms}
            else:
                representative = searched_config(shape.with_(seqlen_q=length, seqlen_k=length), target, trials, pool)
                exact = searched_config(shape, target, trials, pool)
                representative_ms, exact_ms = side_by_side(shape, representative, exact, target)
                row = {"representative_length": length, "representative": short(representative),
                       "representative_ms": representative_ms, "exact": short(exact), "exact_ms": exact_ms}
            done[shape.label()] = row
            echo(f"{part} {shape.label()}: {row}")
            resumable.save(folder, state)
    return report(state)
