"""`fatune bench`: fatune against torch SDPA's backends and FlexAttention, side by side, one run.

Every implementation runs on the same random inputs per shape. Reported per shape and
implementation: forward, backward and forward+backward median times, TFLOP/s, tokens/s,
peak extra memory of a training step, first-call (compile) seconds, and the ratio of
fatune's forward+backward TFLOP/s to the best competitor's.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from fatune.competitors import Attention, competitors, sdpa_default
from fatune.measure import Shape, bench, make_inputs, tflops, time_training_step
from fatune.spec import DTYPES, KernelSpec

# fatune: dispatched (tuned DB or heuristic); -heuristic: the built-in heuristic; -plain: the heuristic's tiles
# without forward structure (no split-KV, no GQA packing), to show what the structure variants change
FATUNE_IMPLS = ("fatune", "fatune-heuristic", "fatune-plain")


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
        data = asdict(self)
        data["shape"] = asdict(self.shape)
        data.update(fwd_tflops=self.fwd_tflops, fwd_bwd_tflops=self.fwd_bwd_tflops, tokens_per_s=self.tokens_per_s)
        return data


def _fatune_config(name: str, shape: Shape, device: torch.device):
    """The config an implementation named in FATUNE_IMPLS forces on `device` (None: dispatched)."""
    from fatune.db import is_decode, seqlen_bucket
    from fatune.dispatch import device_arch, sm_count
    from fatune.heuristics import default_config

    if name not in ("fatune-heuristic", "fatune-plain"):
        return None
    decode = is_decode(seqlen_bucket(shape.seqlen_q))
    shares = decode and shape.decode_shares_sms(sm_count(device), packed=name != "fatune-plain")
    config = default_config(shape.spec, device_arch(device), decode, shares, shape.heads // shape.kv_heads)
    if name == "fatune-plain":
        config = config.replace(fwd=dataclasses.replace(config.fwd, num_splits=1, pack_gqa=0))
    return config


def fatune_impl(name: str, shape: Shape, device: str = "cuda") -> Attention:
    import fatune

    config = _fatune_config(name, shape, torch.device(device))
    kwargs = shape.attention_kwargs(device)
    return lambda q, k, v: fatune.attention(q, k, v, config=config, **kwargs)


def fatune_note(name: str, shape: Shape, inputs: dict[str, torch.Tensor]) -> str:
    """Where a fatune implementation's configs came from and what it launched, e.g.
    'shipped-db: fwd 64x64/w4/s3/t, dkdv 64x64/w4/s2/t, dq 128x64/w8/s3' (no dq with atomic dQ)."""
    import fatune

    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    explained = fatune.explain(q, k, v, config=_fatune_config(name, shape, q.device), **shape.attention_kwargs(q.device))
    if explained.decision is None or explained.launched is None:
        return explained.backend
    launched = explained.launched
    dq = "" if launched.dkdv.atomic_dq else f", dq {launched.dq}"  # atomic dQ: no dQ kernel runs
    return f"{explained.decision.layer}: fwd {launched.fwd}, dkdv {launched.dkdv}{dq}"


def _peak_bytes(attention: Attention, inputs: dict[str, torch.Tensor]) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    attention(inputs["q"], inputs["k"], inputs["v"]).backward(inputs["do"])
    torch.cuda.synchronize()
    for name in ("q", "k", "v"):
        inputs[name].grad = None
    return torch.cuda.max_memory_allocated() - base


def bench_shape(shape: Shape, impls: Iterable[str], warmup_ms: float = 25, rep_ms: float = 100,
                seed: int = 0) -> list[BenchRow]:
    """Time every implementation on one shape, on the same inputs."""
    inputs = make_inputs(shape, "cuda", seed)
    impls = list(impls)
    runners: dict[str, Attention] = {name: fatune_impl(name, shape) for name in impls if name in FATUNE_IMPLS}
    others = tuple(name.removeprefix("sdpa-") for name in impls if name not in FATUNE_IMPLS)
    runners.update(competitors(shape, others))
    with torch.no_grad():
        reference = sdpa_default(shape)(inputs["q"], inputs["k"], inputs["v"]).float()
    rows = []
    for name in impls:
        row = BenchRow(shape, name)
        runner = runners.get(name)
        if runner is None:
            row.error = "not available for this shape"
            rows.append(row)
            continue
        try:
            timing = time_training_step(runner, inputs, warmup_ms, rep_ms)
            row.fwd_ms, row.bwd_ms, row.fwd_bwd_ms = timing["fwd_ms"], timing["bwd_ms"], timing["fwd_bwd_ms"]
            row.compile_s = timing["compile_s"]
            row.peak_bytes = _peak_bytes(runner, inputs)
            with torch.no_grad():
                row.max_abs_diff = (runner(inputs["q"], inputs["k"], inputs["v"]).float() - reference).abs().max().item()
        except Exception as error:  # a competitor that cannot run a shape is reported, not fatal
            row.error = f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
        if name in FATUNE_IMPLS and not row.error:
            try:
                row.note = fatune_note(name, shape, inputs)
            except Exception as error:  # the timings stand without it
                row.note = f"not explained ({type(error).__name__})"
        rows.append(row)
        for name_ in ("q", "k", "v"):
            inputs[name_].grad = None
        torch.cuda.empty_cache()
    return rows


def default_shapes(head_dims=(64, 128), lengths=(1024, 2048, 4096, 8192, 16384), causal=(False, True),
                   dtypes=("bfloat16",), tokens: int = 16384, model_dim: int = 2048, gqa: int = 1) -> list[Shape]:
    """The standard grid: B*L = tokens, H*D = model_dim; `gqa` query heads per K/V head."""
    return [
        Shape(batch=max(1, tokens // length), heads=model_dim // d, seqlen_q=length, seqlen_k=length, head_dim=d,
              dtype=dtype, causal=c, kv_heads=max(1, model_dim // d // gqa))
        for dtype in dtypes for d in head_dims for c in causal for length in lengths
    ]


@dataclass
class Summary:
    ratios: dict[str, list[float]] = field(default_factory=dict)  # competitor -> fatune/competitor TFLOP/s per shape

    def geomean(self, name: str) -> float:
        values = [v for v in self.ratios.get(name, []) if v > 0]
        return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.nan


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


def write_json(rows: list[BenchRow], path: str, meta: dict) -> None:
    with open(path, "w") as handle:
        json.dump({"meta": meta, "rows": [row.to_dict() for row in rows]}, handle, indent=1)


def plot(rows: list[BenchRow], path: str) -> None:
    """PNG: forward+backward TFLOP/s against L, one line per implementation, a panel per (dtype, D, causal)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict[tuple, dict[str, list[tuple[int, float]]]] = {}
    for row in rows:
        if row.error:
            continue
        key = (row.shape.dtype, row.shape.head_dim, row.shape.causal)
        panels.setdefault(key, {}).setdefault(row.impl, []).append((row.shape.seqlen_q, row.fwd_bwd_tflops))
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(5 * max(1, len(panels)), 4), squeeze=False)
    for axis, (key, lines) in zip(axes[0], sorted(panels.items())):
        for impl, points in sorted(lines.items()):
            points.sort()
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=impl)
        axis.set_xscale("log", base=2)
        axis.set_title(f"{key[0]} D={key[1]} {'causal' if key[2] else 'full'}")
        axis.set_xlabel("sequence length L")
        axis.set_ylabel("fwd+bwd TFLOP/s")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def environment() -> dict:
    """GPU, versions and date for the record."""
    import datetime

    import triton

    props = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None
    return {
        "gpu": props.name if props else "none",
        "capability": f"{props.major}.{props.minor}" if props else "",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


ProgressFn = Callable[[str], None]


def host_overhead(calls: int = 2000, shape: Shape | None = None, rounds: int = 5) -> dict[str, dict[str, float]]:
    """Microseconds per call of fatune.attention and torch SDPA on a tiny (host-bound) problem.

    Two ways a user calls it: "forward" (inputs without grad, as inference runs) and "step"
    (inputs requiring grad: forward, then backward from a fixed dO, gradients cleared before
    each step, as a training step runs it). Each is warmed up, then called back to back; the
    wall time up to a final synchronize, divided by the number of calls, is one round's
    per-call cost. Median of `rounds` rounds, implementations interleaved round by round.
    """
    import statistics
    import time

    import fatune

    shape = shape or Shape(batch=1, heads=8, seqlen_q=128, seqlen_k=128, head_dim=64, dtype="bfloat16", causal=True)
    inputs = make_inputs(shape, "cuda")
    grads = [inputs[name] for name in ("q", "k", "v")]
    plain = [t.detach() for t in grads]
    grad_out = inputs["do"]
    implementations = {
        "fatune": lambda q, k, v: fatune.attention(q, k, v, is_causal=shape.causal),
        "sdpa": lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=shape.causal),
    }

    def forward(fn):
        return lambda: fn(*plain)

    def step(fn):
        def run():
            for tensor in grads:
                tensor.grad = None
            fn(*grads).backward(grad_out)
        return run

    results: dict[str, dict[str, float]] = {}
    for mode, make, count in (("forward", forward, calls), ("step", step, max(1, calls // 4))):
        runs = {name: make(fn) for name, fn in implementations.items()}
        samples: dict[str, list[float]] = {name: [] for name in runs}
        for run in runs.values():
            for _ in range(100):
                run()
        torch.cuda.synchronize()
        for _ in range(rounds):
            for name, run in runs.items():
                start = time.perf_counter()
                for _ in range(count):
                    run()
                torch.cuda.synchronize()
                samples[name].append((time.perf_counter() - start) / count * 1e6)
        results[mode] = {name: statistics.median(values) for name, values in samples.items()}
        results[mode]["ratio"] = results[mode]["fatune"] / results[mode]["sdpa"]
    return results


def overhead_lines(results: dict[str, dict[str, float]], shape_label: str = "1x8x128x64 causal bf16",
                   rounds: int = 5) -> list[str]:
    """The host-cost table `fatune bench --overhead` prints."""
    lines = [f"host cost per call, {shape_label} (median of {rounds} rounds):"]
    for mode, row in results.items():
        lines.append(f"  {mode:8} fatune {row['fatune']:7.1f} us   torch SDPA {row['sdpa']:7.1f} us   "
                     f"ratio {row['ratio']:.2f}")
    return lines


@dataclass(frozen=True)
class InferenceShape:
    """A forward-only inference call: `seqlen_q` new queries (1: decode) against a cache of `seqlen_k` keys."""

    label: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"

    @property
    def causal(self) -> bool:
        return self.seqlen_q > 1  # a chunk of new queries attends causally, aligned to the cache's end

    def cache_bytes(self) -> int:
        """K and V bytes: what a decode step must read from memory at least."""
        return 2 * self.batch * self.kv_heads * self.seqlen_k * self.head_dim * torch.finfo(DTYPES[self.dtype]).bits // 8


INFERENCE_SHAPES = (
    InferenceShape("decode B=8 Lk=8192", 8, 1, 8192),
    InferenceShape("decode B=1 Lk=32768", 1, 1, 32768),
    InferenceShape("decode B=64 Lk=2048", 64, 1, 2048),
    InferenceShape("chunk Lq=128 B=4 Lk=8192", 4, 128, 8192),
)


def copy_bandwidth(gigabytes: float = 2.0) -> float:
    """Measured device-to-device copy rate in TB/s (bytes read + written), the memory-bound ceiling."""
    source = torch.empty(int(gigabytes * 2**30) // 2, dtype=torch.float16, device="cuda").normal_()
    target = torch.empty_like(source)
    ms = bench(lambda: target.copy_(source), 25, 100)
    return 2 * source.numel() * 2 / (ms * 1e-3) / 1e12


PAGE_SIZE = 16  # keys per page of the paged-cache rows (vLLM's default block size)


def paged_cache(k: torch.Tensor, v: torch.Tensor, page_size: int = PAGE_SIZE, seed: int = 0) -> tuple:
    """(B, H_kv, L, D) keys and values as a paged cache in shuffled page order: (k pages, v pages, block table)."""
    batch, heads, length, _ = k.shape
    if length % page_size:
        raise ValueError(f"page_size: expected a divisor of the cache length {length}, got {page_size}")
    per_sequence = length // page_size

    def pages(t: torch.Tensor) -> torch.Tensor:  # logical page (b, j) at row b * per_sequence + j
        return t.reshape(batch, heads, per_sequence, page_size, t.shape[-1]).transpose(1, 2).reshape(
            batch * per_sequence, heads, page_size, t.shape[-1])

    order = torch.randperm(batch * per_sequence, generator=torch.Generator().manual_seed(seed)).to(k.device)
    table = torch.argsort(order).to(torch.int32).view(batch, per_sequence)  # where each logical page landed
    return pages(k)[order].contiguous(), pages(v)[order].contiguous(), table


def inference_implementations(shape: InferenceShape) -> dict[str, Callable]:
    """fatune (dispatched; forced to one program per query tile as before split-KV; reading the same cache
    through a block table, in shuffled pages of PAGE_SIZE keys) and SDPA backends."""
    import fatune
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    from fatune.dispatch import device_arch
    from fatune.heuristics import default_config

    kwargs = {"enable_gqa": True, "is_causal": shape.causal, "causal_alignment": "bottom_right"}
    plain = default_config(KernelSpec(shape.dtype, shape.head_dim), device_arch(torch.device("cuda")))
    plain = plain.replace(fwd=dataclasses.replace(plain.fwd, num_splits=1, pack_gqa=0))
    mask = causal_lower_right(shape.seqlen_q, shape.seqlen_k) if shape.causal else None
    impls: dict[str, Callable] = {
        "fatune": lambda q, k, v: fatune.attention(q, k, v, **kwargs),
        "fatune-unsplit": lambda q, k, v: fatune.attention(q, k, v, config=plain, **kwargs),
    }
    paged: dict = {}

    def run_paged(q, k, v):
        if paged.get("source") is not k:  # paged once per cache, outside the timed calls after the first
            paged.update(source=k, cache=paged_cache(k, v))
        k_pages, v_pages, table = paged["cache"]
        return fatune.attention(q, k_pages, v_pages, block_table=table, **kwargs)

    impls["fatune-paged"] = run_paged
    for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def run(q, k, v, backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        impls[name] = run
    return impls


def bench_inference(shapes=INFERENCE_SHAPES, warmup_ms: float = 25, rep_ms: float = 100) -> list[dict]:
    """Forward-only median microseconds of every implementation per shape, same inputs; K/V read rate."""
    rows = []
    for shape in shapes:
        generator = torch.Generator(device="cuda").manual_seed(0)
        dtype = DTYPES[shape.dtype]
        q, k, v = (torch.randn(shape.batch, h, n, shape.head_dim, device="cuda", generator=generator).to(dtype)
                   for h, n in ((shape.heads, shape.seqlen_q), (shape.kv_heads, shape.seqlen_k),
                                (shape.kv_heads, shape.seqlen_k)))
        reference = None
        for name, impl in inference_implementations(shape).items():
            row = {"shape": shape.label, "impl": name}
            try:
                with torch.no_grad():
                    out = impl(q, k, v)
                    reference = out.float() if reference is None else reference
                    row["max_abs_diff"] = (out.float() - reference).abs().max().item()
                    row["us"] = bench(lambda: impl(q, k, v), warmup_ms, rep_ms) * 1e3
                row["kv_tb_s"] = shape.cache_bytes() / (row["us"] * 1e-6) / 1e12
            except Exception as error:  # a backend that cannot take the shape is reported, not fatal
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"
            rows.append(row)
    return rows


def inference_table(rows: list[dict], ceiling_tb_s: float) -> str:
    """Markdown: microseconds per implementation, fatune / best SDPA, fatune's K/V read rate."""
    shapes = list(dict.fromkeys(row["shape"] for row in rows))
    impls = list(dict.fromkeys(row["impl"] for row in rows))
    by = {(row["shape"], row["impl"]): row for row in rows}
    header = ["shape"] + [f"{name} us" for name in impls] + ["fatune / best SDPA", "fatune K/V TB/s",
                                                              f"% of copy ({ceiling_tb_s:.2f} TB/s)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for shape in shapes:
        cells = [shape]
        for name in impls:
            row = by.get((shape, name), {})
            cells.append(f"{row['us']:.1f}" if "us" in row else "n/a")
        mine = by.get((shape, "fatune"), {})
        sdpa = [by[(shape, n)]["us"] for n in impls if n.startswith("sdpa") and "us" in by.get((shape, n), {})]
        cells.append(f"{min(sdpa) / mine['us']:.2f}" if sdpa and "us" in mine else "n/a")
        cells.append(f"{mine.get('kv_tb_s', 0):.2f}")
        cells.append(f"{100 * mine.get('kv_tb_s', 0) / ceiling_tb_s:.0f}%")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
