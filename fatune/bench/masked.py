"""Suite `masked`: masked, grouped-query and packed attention, fatune against FlexAttention and torch SDPA.

Cases per sequence length L (head dim D, H = model width / D heads, B = tokens / L sequences): causal sliding
windows of 256, 1024 and 4096 keys; GQA causal with H/8 K/V heads; key padding (each sequence keeps half its
keys, `seqlens_k`); causal by formula (is_causal); boolean mask tensors (B, 1, L, L): a causal one beside the
formula, a prefix LM (causal, plus a prefix every query sees: L/4 keys, L/8 in the next sequence, and so on: a
mask that differs per batch element) and a random one keeping 90% of the entries (no tile empty, none full: what
scanning a mask costs when it skips nothing); packed documents (2, 5 and 64 documents of random lengths in one
sequence of L tokens, causal, cu_seqlens). `--only` picks cases by name.

Every implementation runs on the same random inputs per case. FlexAttention gets the same mask as a block mask
(the tensor cases through a mask_mod that reads the tensor, a block mask per batch element), so it skips the
blocks fatune skips; SDPA's backends run where they can express the case (is_causal, enable_gqa, a boolean
mask tensor; never packed documents). For a mask tensor fatune also runs it summarised once by
`fatune.prepare_mask` (fatune-prepared), as Flex's block mask is made once outside the step.

Timing as the dense suite's: a training step through autograd (forward alone, then forward + backward from a
random dO, gradients reset between repeats), warm-up and first call (compile, timed apart) outside the timed
region, medians of CUDA-event timings (`triton.testing.do_bench`). TFLOP/s count the (query, key) pairs each
case keeps: 4·B·H·pairs·D forward (a full causal mask keeps half), 3.5x that forward + backward. Each output is
compared with torch SDPA's default backend on the same mask.

In Triton's interpreter (`--interpret`) tiny cases run on the CPU against SDPA's math backend, with wall-clock
timings (a smoke run).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import fatune
from fatune.bench import dense
from fatune.bench.common import bench_device, error_text, peak_step_bytes, shape_columns, time_step
from fatune.bench.results import PlotSpec, Report
from fatune.tuning.shape import Shape, make_inputs

NAME = "masked"
DEFAULT_IMPLS = ("fatune", "flex", "sdpa-cudnn", "sdpa-flash", "sdpa-efficient")
INTERPRETER_IMPLS = ("fatune", "sdpa-math")
WINDOWS = (256, 1024, 4096)
DOCUMENTS = (2, 5, 64)
TENSOR_MASKS = ("causal", "prefix LM", "random 90%")
DISAGREE = 0.05  # max |out - SDPA's| past this (unit-variance inputs, 16-bit outputs): not the same attention
PLOT = PlotSpec(x="seqlen_q", y="fwd_bwd_tflops", panel=("case",), xlabel="sequence length L",
                ylabel="fwd+bwd TFLOP/s")


@dataclass(frozen=True)
class Case:
    """One case: a name, the shape (sizes and the mask variant a Shape expresses) and, for a mask tensor, its kind."""

    name: str
    shape: Shape
    tensor: str = ""  # one of TENSOR_MASKS: the mask is a boolean tensor handed to every implementation


def cases(length: int, head_dim: int = 128, model_dim: int = 2048, tokens: int = 16384, dtype: str = "bfloat16",
          only: str = "") -> list[Case]:
    """The suite's cases at one length, those whose name contains one of `only`'s comma-separated texts."""
    heads = max(1, model_dim // head_dim)
    base = Shape(max(1, tokens // length), heads, length, length, head_dim, dtype)
    causal = base.with_(causal=True)
    found = [Case(f"causal window {w}", causal.with_(window=w)) for w in WINDOWS]
    kv_heads = max(1, heads // 8)
    found.append(Case(f"GQA {heads // kv_heads}:1 causal", causal.with_(kv_heads=kv_heads)))
    found.append(Case("key padding 50%", base.with_(valid_keys=0.5)))
    found.append(Case("causal (is_causal)", causal))
    found += [Case(f"bool mask tensor: {kind}", base, tensor=kind) for kind in TENSOR_MASKS]
    found += [Case(f"{n} packed documents, causal", causal.with_(batch=1, documents=n)) for n in DOCUMENTS if n < length]
    parts = [part.strip() for part in only.split(",") if part.strip()]
    return [case for case in found if not parts or any(part in case.name for part in parts)]


def mask_tensor(kind: str, batch: int, length: int, device: torch.device) -> torch.Tensor:
    """The (B, 1, L, L) boolean keep-mask of a tensor case (the same one every run: a seeded generator)."""
    positions = torch.arange(length, device=device)
    causal = positions[None, :] <= positions[:, None]
    if kind == "causal":
        return causal.expand(batch, 1, length, length)
    if kind == "prefix LM":  # prefixes of L/4 and L/8 keys in turn: a mask that differs per batch element
        prefix = torch.tensor([max(1, length // (4 << (b % 2))) for b in range(batch)], device=device)
        return (causal[None] | (positions[None, None, :] < prefix[:, None, None]))[:, None]
    if kind == "random 90%":
        generator = torch.Generator(device=device).manual_seed(length)
        return torch.rand(batch, 1, length, length, device=device, generator=generator) < 0.9
    raise ValueError(f"mask: expected one of {', '.join(TENSOR_MASKS)}, got {kind!r}")


def flex_tensor(mask: torch.Tensor, heads_differ: bool) -> Callable:
    """Flex with a block mask per batch element read from `mask` (B=None would take element 0's blocks for all)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.reset()  # a fresh compile per case: past dynamo's recompile limit Flex runs unfused
    compiled = torch.compile(flex_attention, dynamic=False)
    batch, _, q_len, k_len = mask.shape
    block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: mask[b, 0, q_idx, kv_idx], batch, None, q_len, k_len,
                                   device=mask.device)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask, enable_gqa=heads_differ)


def tensor_runners(mask: torch.Tensor, shape: Shape, impls: Iterable[str]) -> dict[str, Callable]:
    """The implementations of a mask-tensor case, by name (fatune-prepared beside fatune)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-flash": SDPBackend.FLASH_ATTENTION,
                "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa-math": SDPBackend.MATH}
    runners: dict[str, Callable] = {}
    for name in impls:
        if name == "fatune":
            runners["fatune"] = functools.partial(fatune.attention, attn_mask=mask)
            prepared = fatune.prepare_mask(mask, (shape.batch, shape.heads, shape.seqlen_q, shape.seqlen_k))
            runners["fatune-prepared"] = functools.partial(fatune.attention, attn_mask=prepared)
        elif name == "flex" and mask.device.type == "cuda":
            runners["flex"] = flex_tensor(mask, shape.kv_heads != shape.heads)
        elif name in backends:
            def run(q, k, v, backend=backends[name]):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            runners[name] = run
    return runners


def tensor_rows(case: Case, impls: Iterable[str], warmup_ms: float, rep_ms: float,
                device: torch.device) -> list[dict]:
    """Time a mask-tensor case: rows in the dense suite's columns, TFLOP/s from the pairs the tensor keeps."""
    shape = case.shape
    inputs = make_inputs(shape, device)
    mask = mask_tensor(case.tensor, shape.batch, shape.seqlen_q, device)
    pairs = float(mask.sum()) * shape.heads  # every head keeps the mask's pairs
    forward_flops = 2.0 * pairs * (shape.head_dim + shape.head_dim_v)
    runners = tensor_runners(mask, shape, impls)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    with torch.no_grad():
        reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).float()
    rows = []
    for name in dict.fromkeys(n for impl in impls for n in ((impl, "fatune-prepared") if impl == "fatune" else (impl,))):
        row = {"suite": NAME, "case": case.name, **shape_columns(shape), "mask": case.tensor, "impl": name}
        runner = runners.get(name)
        if runner is None:
            rows.append({**row, "error": "not available for this case"})
            continue
        try:
            timing = time_step(runner, inputs, warmup_ms, rep_ms)
            row.update(timing, peak_mib=peak_step_bytes(runner, inputs) / 2**20)
            row["fwd_tflops"] = forward_flops / (timing["fwd_ms"] * 1e-3) / 1e12
            row["fwd_bwd_tflops"] = 3.5 * forward_flops / (timing["fwd_bwd_ms"] * 1e-3) / 1e12
            with torch.no_grad():
                row["max_abs_diff"] = (runner(q, k, v).float() - reference).abs().max().item()
        except Exception as error:  # noqa: BLE001 - a backend that cannot take the mask is reported
            row["error"] = error_text(error)
        for tensor in (q, k, v):
            tensor.grad = None
        rows.append(row)
    return rows


def case_rows(case: Case, impls: tuple[str, ...], warmup_ms: float, rep_ms: float, device: torch.device) -> list[dict]:
    if case.tensor:
        return tensor_rows(case, impls, warmup_ms, rep_ms, device)
    return [{"suite": NAME, "case": case.name, **{key: value for key, value in row.to_dict().items() if key != "suite"}}
            for row in dense.bench_shape(case.shape, impls, warmup_ms, rep_ms, device=device)]


def table(rows: list[dict]) -> str:
    """Markdown: per case and length, each implementation's forward / forward+backward ms, fatune's (and the
    prepared mask's) speed over the best other implementation, and any output that differs from SDPA's."""
    groups: dict[tuple[str, int], dict[str, dict]] = {}
    for row in rows:
        groups.setdefault((row["case"], row["seqlen_q"]), {})[row["impl"]] = row
    impls = sorted(dict.fromkeys(row["impl"] for row in rows), key=lambda name: not name.startswith("fatune"))
    header = ["case", "L", "B", "H", "H_kv", *[f"{name} ms (fwd / fwd+bwd)" for name in impls],
              "fatune / best other", "fatune-prepared / best other", "differs from SDPA"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def done(row: dict | None) -> bool:
        return bool(row) and not row.get("error") and math.isfinite(row.get("fwd_bwd_ms") or math.nan)

    for (name, length), by in groups.items():
        first = next(iter(by.values()))
        cells = [name, str(length), str(first["batch"]), str(first["heads"]), str(first["kv_heads"])]
        for impl in impls:
            row = by.get(impl)
            cells.append(f"{row['fwd_ms']:.3f} / {row['fwd_bwd_ms']:.3f}" if done(row) else
                         (row or {}).get("error", "n/a")[:40] or "n/a")
        others = [row["fwd_bwd_ms"] for impl, row in by.items() if not impl.startswith("fatune") and done(row)]
        for mine in ("fatune", "fatune-prepared"):
            cells.append(f"{min(others) / by[mine]['fwd_bwd_ms']:.2f}x" if others and done(by.get(mine)) else "n/a")
        cells.append(", ".join(f"{impl} by {row['max_abs_diff']:.3f}" for impl, row in by.items()
                               if done(row) and (row.get("max_abs_diff") or 0) > DISAGREE) or "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plan(lengths: Iterable[int], head_dims: Iterable[int], model_dim: int, tokens: int, dtypes: Iterable[str],
         only: str = "") -> list[Case]:
    return [case for dtype in dtypes for d in head_dims for length in lengths
            for case in cases(length, d, model_dim, tokens, dtype, only)]


def run(chosen: list[Case], impls: tuple[str, ...] | None = None, warmup_ms: float = 25, rep_ms: float = 100,
        each: Callable[[list[Case]], Iterable[Case]] = iter) -> Report:
    """Time `impls` (default: the GPU's or the interpreter's) on every case."""
    device = bench_device()
    impls = tuple(impls or (DEFAULT_IMPLS if device.type == "cuda" else INTERPRETER_IMPLS))
    rows = [row for case in each(chosen) for row in case_rows(case, impls, warmup_ms, rep_ms, device)]
    fatune_rows = [row for row in rows if row["impl"] == "fatune" and not row.get("error")]
    summary = {"cases": len(chosen), "fatune_rows": len(fatune_rows)}
    return Report(NAME, rows, table(rows), summary=summary, plot=PLOT)
