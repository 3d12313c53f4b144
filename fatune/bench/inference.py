"""Suite `inference`: decode and chunked prefill against a KV cache, forward only, fatune against torch SDPA.

The shapes (`INFERENCE_SHAPES`: GQA 32 query heads on 8 K/V heads, head dim 128, bf16) are decode steps (one
query per sequence against caches of 2k-32k keys, batch 1-64) and a chunk of 128 new queries attending
causally to the end of an 8k cache (`Shape(bottom_right=True)`: causal_alignment="bottom_right", what SDPA
gets as `causal_lower_right`). Implementations: fatune as dispatched; fatune-unsplit (the heuristic's tiles,
one program per query tile, no split-KV and no GQA packing: what the split and the packing gain); fatune-paged
(the same cache read through a block table, in shuffled pages of PAGE_SIZE keys); SDPA's flash, cuDNN and
memory-efficient backends, each forced.

Every implementation runs on the same random inputs per shape, forward only without autograd, as inference
runs it: the first call (compile) timed apart, then the median of CUDA-event timings (`triton.testing.
do_bench`, warm-up first, L2 flushed before each repeat), in microseconds. A decode step is memory-bound: its
floor is reading K and V once, so each row also gives the K/V read rate (cache bytes / time) and the table
sets fatune's against the GPU's measured device-to-device copy rate. TFLOP/s count 4·B·H·Lq·Lk·D (for the chunk,
the (query, key) pairs its bottom-right causal mask keeps).

In Triton's interpreter (`--interpret`) tiny shapes run on the CPU against SDPA's math backend, with
wall-clock timings (a smoke run).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

import fatune
from fatune.bench.common import bench_device, error_text, shape_columns, time_inference
from fatune.bench.results import PlotSpec, Report
from fatune.hardware import device_arch
from fatune.kernel.triton.heuristics import default_config
from fatune.tuning.shape import Shape, make_inputs
from fatune.tuning.timing import bench, tflops

NAME = "inference"
INFERENCE_SHAPES = (
    Shape(8, 32, 1, 8192, 128, "bfloat16", kv_heads=8),  # decode
    Shape(1, 32, 1, 32768, 128, "bfloat16", kv_heads=8),
    Shape(64, 32, 1, 2048, 128, "bfloat16", kv_heads=8),
    Shape(4, 32, 128, 8192, 128, "bfloat16", causal=True, bottom_right=True, kv_heads=8),  # chunked prefill
)
INTERPRETER_SHAPES = (
    Shape(1, 2, 1, 64, 16, "float16", kv_heads=1),
    Shape(1, 2, 16, 64, 16, "float16", causal=True, bottom_right=True, kv_heads=1),
)
DEFAULT_IMPLS = ("fatune", "fatune-unsplit", "fatune-paged", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient")
INTERPRETER_IMPLS = ("fatune", "fatune-unsplit", "fatune-paged", "sdpa-math")
PAGE_SIZE = 16  # keys per page of the paged-cache rows (vLLM's default block size)
PLOT = PlotSpec(x="seqlen_k", y="us", panel=("kind", "batch"), xlabel="cache length Lk", ylabel="us per call")


def kind(shape: Shape) -> str:
    return "decode" if shape.seqlen_q == 1 else "chunked prefill"


def copy_bandwidth(gigabytes: float = 2.0) -> float:
    """Measured device-to-device copy rate in TB/s (bytes read + written), the memory-bound ceiling."""
    source = torch.empty(int(gigabytes * 2**30) // 2, dtype=torch.float16, device="cuda").normal_()
    target = torch.empty_like(source)
    ms = bench(lambda: target.copy_(source), 25, 100)
    return 2 * source.numel() * 2 / (ms * 1e-3) / 1e12


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


def implementations(shape: Shape, device: torch.device) -> dict[str, Callable]:
    """Every implementation this suite knows, by name (a backend that cannot take the shape fails when called)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    kwargs = shape.attention_kwargs(device)
    plain = default_config(shape.spec, device_arch(device))
    plain = plain.replace(fwd=dataclasses.replace(plain.fwd, num_splits=1, pack_gqa=0))
    mask = None
    if shape.causal:
        mask = causal_lower_right(shape.seqlen_q, shape.seqlen_k) if shape.bottom_right else True
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
                          ("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION), ("sdpa-math", SDPBackend.MATH)):
        def run(q, k, v, backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is True else mask,
                                                      is_causal=mask is True, enable_gqa=True)
        impls[name] = run
    return impls


def bench_shape(shape: Shape, impls: tuple[str, ...], warmup_ms: float = 25, rep_ms: float = 100,
                device: torch.device | None = None) -> list[dict]:
    """Forward-only microseconds of every implementation on one shape, same inputs; the K/V read rate."""
    device = device or bench_device()
    inputs = {name: tensor.detach() for name, tensor in make_inputs(shape, device).items()}
    known = implementations(shape, device)
    reference = None
    rows = []
    for name in impls:
        row = {"suite": NAME, "kind": kind(shape), **shape_columns(shape), "impl": name}
        try:
            impl = known[name]
            with torch.no_grad():
                out = impl(inputs["q"], inputs["k"], inputs["v"]).float()
            reference = out if reference is None else reference
            timing = time_inference(impl, inputs, warmup_ms, rep_ms)
            row.update(us=timing["fwd_ms"] * 1e3, compile_s=timing["compile_s"],
                       fwd_tflops=tflops(shape, "fwd", timing["fwd_ms"]),
                       kv_tb_s=shape.cache_bytes() / (timing["fwd_ms"] * 1e-3) / 1e12,
                       max_abs_diff=(out - reference).abs().max().item())
        except Exception as error:  # noqa: BLE001 - a backend that cannot take the shape is reported
            row["error"] = "unknown implementation" if name not in known else error_text(error, 120)
        rows.append(row)
    return rows


def table(rows: list[dict], ceiling_tb_s: float) -> str:
    """Markdown: microseconds per implementation, fatune / best SDPA, fatune's K/V read rate."""
    shapes = list(dict.fromkeys(row["shape"] for row in rows))
    impls = list(dict.fromkeys(row["impl"] for row in rows))
    by = {(row["shape"], row["impl"]): row for row in rows}
    copy = f"{ceiling_tb_s:.2f} TB/s" if math.isfinite(ceiling_tb_s) else "not measured"
    header = ["shape", "kind"] + [f"{name} us" for name in impls] + ["fatune / best SDPA", "fatune K/V TB/s",
                                                                      f"% of copy ({copy})"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for shape in shapes:
        first = next(row for row in rows if row["shape"] == shape)
        cells = [shape, first["kind"]]
        for name in impls:
            row = by.get((shape, name), {})
            cells.append(f"{row['us']:.1f}" if "us" in row else "n/a")
        mine = by.get((shape, "fatune"), {})
        sdpa = [by[(shape, n)]["us"] for n in impls if n.startswith("sdpa") and "us" in by.get((shape, n), {})]
        cells.append(f"{min(sdpa) / mine['us']:.2f}" if sdpa and "us" in mine else "n/a")
        rate = mine.get("kv_tb_s", math.nan)
        cells.append(f"{rate:.2f}" if math.isfinite(rate) else "n/a")
        cells.append(f"{100 * rate / ceiling_tb_s:.0f}%" if math.isfinite(rate * ceiling_tb_s) else "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def shapes_for(device: torch.device) -> tuple[Shape, ...]:
    return INFERENCE_SHAPES if device.type == "cuda" else INTERPRETER_SHAPES


def run(impls: tuple[str, ...] | None = None, warmup_ms: float = 25, rep_ms: float = 100,
        shapes: tuple[Shape, ...] | None = None) -> Report:
    """Time `impls` (default: all the GPU's, or the interpreter's) on `shapes` (default: the suite's)."""
    device = bench_device()
    impls = impls or (DEFAULT_IMPLS if device.type == "cuda" else INTERPRETER_IMPLS)
    ceiling = copy_bandwidth() if device.type == "cuda" else math.nan
    rows = [row for shape in shapes or shapes_for(device) for row in bench_shape(shape, impls, warmup_ms, rep_ms,
                                                                                  device)]
    markdown = (f"Forward only, median of triton.testing.do_bench; device copy "
                f"{ceiling:.2f} TB/s\n\n" if math.isfinite(ceiling) else "Forward only, wall clock (interpreter)\n\n")
    markdown += table(rows, ceiling)
    return Report(NAME, rows, markdown, summary={"copy_tb_s": ceiling}, plot=PLOT)
