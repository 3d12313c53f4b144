"""Suite `dense`: the training-step grid, fatune against torch SDPA's backends and FlexAttention.

The grid is head dim D x causal or not x sequence length L x dtype, at a fixed token count B·L and model width
H·D (`default_shapes`); `fatune bench`'s --mask and --gqa put a mask variant or grouped-query heads on every
shape of it. Every implementation runs on the same random inputs per shape (a seeded generator; q, k, v and
dO drawn from a standard normal).

Each implementation is timed as a training step runs it, through autograd: the forward alone (no grad), then
forward + backward from dO with the gradients reset between repeats; backward = their difference. The first
call (compiling: fatune's Triton kernels, Flex's torch.compile) is timed apart (compile_s) and kept out of
the timed region, as is a warm-up; the times are medians of CUDA-event timings (`triton.testing.do_bench`,
L2 flushed before each repeat). TFLOP/s count 4·B·H·Lq·Lk·D for the forward (halved when causal; the pairs a
window, key padding or packed documents keep), 2.5x that for the backward, 3.5x for forward + backward.
Also per row: tokens/s of the step, the step's peak extra memory, the output's largest difference from torch
SDPA's default backend, and for fatune where its configs came from (`fatune.explain`). Per shape, fatune's
forward+backward TFLOP/s over each competitor's; their geometric means over the grid summarise a run.

With `compile` (fatune bench --compile inductor) each implementation but Flex, which compiles its own, is timed
through torch.compile(fullgraph=True, dynamic=False), traced afresh per shape: the step a compiled model runs,
where fatune's calls take their routes as traced (fatune.ops).

In Triton's interpreter (`--interpret`) the same code runs on the CPU with wall-clock timings (a smoke run).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

import fatune
from fatune.bench.common import bench_device, error_text, geomean, peak_step_bytes, shape_columns, time_step
from fatune.bench.results import PlotSpec, Report
from fatune.hardware import device_arch, sm_count
from fatune.kernel.family import builtin_config, family
from fatune.kernel.gluon.family import default_backward, default_forward
from fatune.kernel.triton.heuristics import heuristic_config
from fatune.tuning.competitors import Attention, competitors, sdpa_default
from fatune.tuning.shape import Shape, make_inputs
from fatune.tuning.timing import tflops

NAME = "dense"
# fatune: dispatched (tuned DB or heuristic); -heuristic: the built-in heuristic; -plain: the heuristic's tiles
# without forward structure (no split-KV, no GQA packing), to show what the structure variants change
# fatune-kernels: the dispatched configs on fatune's own kernels, where a tuned entry routes the call to an SDPA
# backend it measured faster (fatune.runtime.routes)
FATUNE_IMPLS = ("fatune", "fatune-kernels", "fatune-heuristic", "fatune-plain", "fatune-gluon", "fatune-triton")
DEFAULT_IMPLS = ("fatune", "fatune-kernels", "fatune-heuristic", "sdpa-cudnn", "sdpa-flash", "sdpa-efficient",
                 "sdpa-math", "flex")
PLOT = PlotSpec(x="seqlen_q", y="fwd_bwd_tflops", panel=("dtype", "head_dim", "causal", "window", "documents"),
                xlabel="sequence length L", ylabel="fwd+bwd TFLOP/s")


@dataclass
class BenchRow:
    shape: Shape
    impl: str
    fwd_ms: float = math.nan
    bwd_ms: float = math.nan
    fwd_bwd_ms: float = math.nan
    compile_s: float = math.nan
    peak_bytes: int = 0
    max_abs_diff: float = math.nan  # output vs torch SDPA's default backend on the same inputs
    error: str = ""
    note: str = ""  # fatune's: the dispatch layer and the configs launched (fatune.explain)

    @property
    def fwd_tflops(self) -> float:
        return tflops(self.shape, "fwd", self.fwd_ms)

    @property
    def fwd_bwd_tflops(self) -> float:
        return tflops(self.shape, "fwd+bwd", self.fwd_bwd_ms)

    @property
    def tokens_per_s(self) -> float:
        tokens = self.shape.batch * self.shape.seqlen_q
        return tokens / (self.fwd_bwd_ms * 1e-3) if self.fwd_bwd_ms > 0 else 0.0

    def to_dict(self) -> dict:
        """The row in the common schema: the shape's columns, then the measurements."""
        return {"suite": NAME, **shape_columns(self.shape), "impl": self.impl, "fwd_ms": self.fwd_ms,
                "bwd_ms": self.bwd_ms, "fwd_bwd_ms": self.fwd_bwd_ms, "fwd_tflops": self.fwd_tflops,
                "fwd_bwd_tflops": self.fwd_bwd_tflops, "tokens_per_s": self.tokens_per_s,
                "peak_mib": self.peak_bytes / 2**20, "compile_s": self.compile_s, "max_abs_diff": self.max_abs_diff,
                "note": self.note, "error": self.error}


def _fatune_config(name: str, shape: Shape, device: torch.device):
    """The config an implementation named in FATUNE_IMPLS forces on `device` (None: dispatched): the built-in
    config (fatune-heuristic: what runs without a tuned entry), the Triton family's heuristic unsplit and unpacked
    (fatune-plain), with the Gluon family's forward and backward (fatune-gluon; the Triton family's where Gluon
    does not serve the shape), or the Triton family's alone (fatune-triton)."""
    if name not in ("fatune-heuristic", "fatune-plain", "fatune-gluon", "fatune-triton"):
        return None
    if name == "fatune-gluon":  # its forward and backward where each serves the shape, the Triton family's else
        gluon = family("gluon")
        config = family("triton").heuristic(shape.problem, device_arch(device), sm_count(device))
        if gluon.serves(shape.spec, device) is None:
            config = config.replace(fwd=default_forward(shape.spec))
        if gluon.serves_backward(shape.spec, device) is None:
            config = config.replace(dkdv=default_backward(shape.spec))
        return config
    if name == "fatune-triton":
        return family("triton").heuristic(shape.problem, device_arch(device), sm_count(device))
    if name == "fatune-heuristic":
        return builtin_config(shape.problem, device_arch(device), sm_count(device))
    config = heuristic_config(shape.problem, device_arch(device), sm_count(device), packed=False)
    return config.replace(fwd=dataclasses.replace(config.fwd, num_splits=1, pack_gqa=0))


def fatune_impl(name: str, shape: Shape, device: torch.device | str = "cuda",
                inputs: dict[str, torch.Tensor] | None = None) -> Attention:
    """The call an implementation named in FATUNE_IMPLS times. fatune-kernels passes the configs the dispatcher
    picks as an argument (never routed), looked up on `inputs` (else on its first call's)."""
    config = _fatune_config(name, shape, torch.device(device))
    kwargs = shape.attention_kwargs(device)
    if name == "fatune-kernels":
        decided = []

        def decide(q, k, v) -> None:
            decision = fatune.explain(q, k, v, **kwargs).decision
            decided.append(decision.config if decision else None)

        if inputs is not None:
            decide(inputs["q"], inputs["k"], inputs["v"])

        def kernels(q, k, v):
            if not decided:
                decide(q, k, v)
            return fatune.attention(q, k, v, config=decided[0], **kwargs)

        return kernels
    return lambda q, k, v: fatune.attention(q, k, v, config=config, **kwargs)


def fatune_note(name: str, shape: Shape, inputs: dict[str, torch.Tensor]) -> str:
    """Where a fatune implementation's configs came from and what it launched, e.g.
    'shipped-db: fwd 64x64/w4/s3/t, dkdv 64x64/w4/s2/t, dq 128x64/w8/s3' (no dq with atomic dQ)."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    explained = fatune.explain(q, k, v, config=_fatune_config(name, shape, q.device), **shape.attention_kwargs(q.device))
    if explained.decision is not None and explained.decision.route and name == "fatune":
        return f"{explained.decision.layer}: {explained.backend} ({explained.decision.margin:.2f}x fatune's kernels)"
    if explained.decision is None or explained.launched is None:
        return explained.backend
    launched = explained.launched
    adds_dq = launched.gluon_backward or launched.dkdv.atomic_dq  # no dQ kernel runs
    dq = "" if adds_dq else f", dq {launched.dq}"
    return f"{explained.decision.layer}: fwd {launched.fwd}, dkdv {launched.dkdv}{dq}"


def bench_shape(shape: Shape, impls: Iterable[str], warmup_ms: float = 25, rep_ms: float = 100,
                seed: int = 0, device: torch.device | None = None, compile: str | None = None) -> list[BenchRow]:
    """Time every implementation on one shape, on the same inputs (`compile`: through torch.compile with that
    backend)."""
    device = device or bench_device()
    inputs = make_inputs(shape, device, seed)
    impls = list(impls)
    runners: dict[str, Attention] = {name: fatune_impl(name, shape, device, inputs) for name in impls
                                     if name in FATUNE_IMPLS}
    others = tuple(name.removeprefix("sdpa-") for name in impls if name not in FATUNE_IMPLS)
    if device.type != "cuda":  # Flex is compiled for the GPU
        others = tuple(name for name in others if name != "flex")
    runners.update(competitors(shape, others))
    if compile:
        torch._dynamo.reset()  # each shape traced with its own sizes fixed (past dynamo's recompile limit: eager)
        runners = {name: runner if name == "flex" else
                   torch.compile(runner, fullgraph=True, dynamic=False, backend=compile)
                   for name, runner in runners.items()}
    with torch.no_grad():
        reference = sdpa_default(shape)(inputs["q"], inputs["k"], inputs["v"]).float()
    rows = []
    for name in impls:
        row = BenchRow(shape, name)
        runner = runners.get(name)
        if runner is None:
            row.error = "not available for this shape" if device.type == "cuda" else "not available on the CPU"
            rows.append(row)
            continue
        try:
            timing = time_step(runner, inputs, warmup_ms, rep_ms)
            row.fwd_ms, row.bwd_ms, row.fwd_bwd_ms = timing["fwd_ms"], timing["bwd_ms"], timing["fwd_bwd_ms"]
            row.compile_s = timing["compile_s"]
            row.peak_bytes = peak_step_bytes(runner, inputs)
            with torch.no_grad():
                row.max_abs_diff = (runner(inputs["q"], inputs["k"], inputs["v"]).float() - reference).abs().max().item()
        except Exception as error:  # noqa: BLE001 - a competitor that cannot run a shape is reported
            row.error = error_text(error)
        if name in FATUNE_IMPLS and not row.error:
            try:
                row.note = fatune_note(name, shape, inputs)
            except Exception as error:  # noqa: BLE001 - the timings stand without it
                row.note = f"not explained ({type(error).__name__})"
        rows.append(row)
        for name_ in ("q", "k", "v"):
            inputs[name_].grad = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def default_shapes(head_dims=(64, 128), lengths=(1024, 2048, 4096, 8192, 16384), causal=(False, True),
                   dtypes=("bfloat16",), tokens: int = 16384, model_dim: int = 2048, gqa: int = 1) -> list[Shape]:
    """The standard grid: B*L = tokens, H*D = model_dim; `gqa` query heads per K/V head."""
    return [
        Shape(batch=max(1, tokens // length), heads=max(1, model_dim // d), seqlen_q=length, seqlen_k=length,
              head_dim=d, dtype=dtype, causal=c, kv_heads=max(1, model_dim // d // gqa))
        for dtype in dtypes for d in head_dims for c in causal for length in lengths
    ]


@dataclass
class Summary:
    ratios: dict[str, list[float]] = field(default_factory=dict)  # competitor -> fatune/competitor TFLOP/s per shape

    def geomean(self, name: str) -> float:
        return geomean(self.ratios.get(name, []))


def ratio_table(rows: list[BenchRow], fatune_name: str = "fatune") -> tuple[str, Summary]:
    """Markdown: one line per shape with TFLOP/s per implementation and fatune's ratio to each."""
    shapes: dict[Shape, dict[str, BenchRow]] = {}
    for row in rows:
        shapes.setdefault(row.shape, {})[row.impl] = row
    impls = list(dict.fromkeys(row.impl for row in rows))
    others = [name for name in impls if name not in FATUNE_IMPLS]
    header = ["dtype", "D", "causal", "L", "B", "H"] + [f"{name} fwd+bwd TFLOP/s" for name in impls]
    header += [f"fatune / {name}" for name in others] + ["fatune / best"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    summary = Summary()
    for shape, by_impl in shapes.items():
        cells = [shape.dtype, str(shape.head_dim), "yes" if shape.causal else "no", str(shape.seqlen_q),
                 str(shape.batch), str(shape.heads)]
        cells += [f"{by_impl[name].fwd_bwd_tflops:.1f}" if name in by_impl and not by_impl[name].error else "n/a"
                  for name in impls]
        mine = by_impl.get(fatune_name)
        best = 0.0
        for name in others:
            theirs = by_impl.get(name)
            if mine and theirs and not mine.error and not theirs.error and theirs.fwd_bwd_tflops > 0:
                ratio = mine.fwd_bwd_tflops / theirs.fwd_bwd_tflops
                summary.ratios.setdefault(name, []).append(ratio)
                best = max(best, theirs.fwd_bwd_tflops)
                cells.append(f"{ratio:.2f}")
            else:
                cells.append("n/a")
        if mine and best > 0 and not mine.error:
            summary.ratios.setdefault("best", []).append(mine.fwd_bwd_tflops / best)
            cells.append(f"{mine.fwd_bwd_tflops / best:.2f}")
        else:
            cells.append("n/a")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines), summary


def detail_table(rows: list[BenchRow]) -> str:
    """Markdown: every measured number, one line per (shape, implementation)."""
    header = ["shape", "impl", "fwd ms", "bwd ms", "fwd+bwd ms", "fwd TFLOP/s", "fwd+bwd TFLOP/s", "tokens/s",
              "peak MiB", "compile s", "max abs(out - sdpa)", "note"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        if row.error:
            lines.append(f"| {row.shape.label()} | {row.impl} |" + " |" * 9 + f" {row.error} |")
            continue
        lines.append(
            f"| {row.shape.label()} | {row.impl} | {row.fwd_ms:.3f} | {row.bwd_ms:.3f} | {row.fwd_bwd_ms:.3f} | "
            f"{row.fwd_tflops:.1f} | {row.fwd_bwd_tflops:.1f} | {row.tokens_per_s:.3g} | "
            f"{row.peak_bytes / 2**20:.0f} | {row.compile_s:.1f} | {row.max_abs_diff:.2e} | {row.note} |"
        )
    return "\n".join(lines)


def summary_lines(summary: Summary) -> list[str]:
    """'- fatune / NAME: geometric mean ..., worst ..., best ... over N shapes', one per competitor."""
    return [f"- fatune / {name}: geometric mean {summary.geomean(name):.3f}, worst {min(values):.3f}, "
            f"best {max(values):.3f} over {len(values)} shapes" for name, values in summary.ratios.items()]


def report(rows: list[BenchRow], suite: str = NAME, plot: PlotSpec | None = PLOT) -> Report:
    """The run's rows, tables and geometric means in the common schema."""
    table, summary = ratio_table(rows)
    lines = [table, "", *summary_lines(summary)]
    summary_data = {name: {"geomean": summary.geomean(name), "worst": min(values), "best": max(values),
                           "shapes": len(values)} for name, values in summary.ratios.items()}
    return Report(suite, [row.to_dict() for row in rows], "\n".join([*lines, "", detail_table(rows)]),
                  summary={"fatune_over": summary_data}, echo="\n".join(lines), plot=plot)


def run(shapes: list[Shape], impls: Iterable[str], warmup_ms: float = 25, rep_ms: float = 100,
        each: Callable[[list[Shape]], Iterable[Shape]] = iter, compile: str | None = None) -> Report:
    """Time `impls` on every shape (`each`: how the shapes are walked, e.g. under a progress bar; `compile`: a
    torch.compile backend each implementation runs through)."""
    device = bench_device()
    rows: list[BenchRow] = []
    for shape in each(shapes):
        rows += bench_shape(shape, impls, warmup_ms, rep_ms, device=device, compile=compile)
    return report(rows)
