"""`fatune bench`: fatune against torch SDPA backends and FlexAttention in one run."""

from __future__ import annotations

import json
from pathlib import Path

import click

from fatune.cli.options import apply_mask, int_list, mask_variant_options, name_list


@click.command()
@click.option("--head-dims", default="64,128", show_default=True, callback=int_list, help="Comma-separated head dims.")
@click.option("--lengths", default="1024,2048,4096,8192,16384", show_default=True, callback=int_list,
              help="Comma-separated sequence lengths (L_q = L_k).")
@click.option("--causal", type=click.Choice(["both", "yes", "no"]), default="both", show_default=True)
@click.option("--dtypes", default="bf16", show_default=True, callback=name_list, help="Comma-separated: bf16, fp16.")
@click.option("--impls", default="fatune,fatune-heuristic,sdpa-cudnn,sdpa-flash,sdpa-efficient,sdpa-math,flex",
              show_default=True, callback=name_list, help="Implementations to compare.")
@click.option("--gqa", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Query heads per key/value head (grouped-query attention).")
@click.option("--mask", type=click.Choice(["none", "window", "padding", "packed"]), default="none", show_default=True,
              help="A mask variant on every shape: a causal sliding window (--window keys; implies --causal yes), "
                   "key padding (--valid-keys of each sequence's keys) or the batch's tokens packed as --documents "
                   "documents (cu_seqlens; Flex gets a document mask, SDPA cannot take it); competitors get the "
                   "same mask.")
@mask_variant_options
@click.option("--tokens", default=16384, show_default=True, help="B * L per shape.")
@click.option("--model-dim", default=2048, show_default=True, help="H * D per shape.")
@click.option("--warmup-ms", default=25.0, show_default=True)
@click.option("--rep-ms", default=100.0, show_default=True)
@click.option("-o", "--output", type=click.Path(file_okay=False, path_type=Path), default=Path("bench-results"),
              show_default=True, help="Folder for bench.md, bench.json and bench.png.")
@click.option("--inference", is_flag=True,
              help="Only time inference shapes (decode, chunked prefill against a KV cache; GQA 32/8, d128), "
                   "forward only, against SDPA's backends.")
@click.option("--overhead", is_flag=True,
              help="Only measure host cost per call on a tiny problem (1x8x128x64): forward and training step.")
@click.option("--rounds", type=click.IntRange(1, 1000), default=5, show_default=True,
              help="With --overhead: rounds per implementation (the median is reported).")
@click.option("--dry-run", is_flag=True, help="List the shapes the run would time, and stop (no GPU needed).")
def bench(head_dims, lengths, causal, dtypes, impls, gqa, mask, window, valid_keys, documents, tokens, model_dim,
          warmup_ms, rep_ms, output, inference, overhead, rounds, dry_run) -> None:
    """Compare fatune with torch SDPA (each backend forced) and FlexAttention, same inputs, one run.

    Example:

    \b
        fatune bench --head-dims 128 --lengths 4096,16384 --causal yes -o results/
        fatune bench --head-dims 128 --lengths 8192 --mask window --window 1024 --impls fatune,flex
        fatune bench --head-dims 128 --lengths 8192 --causal yes --mask packed --documents 64 --impls fatune,flex
        fatune bench --overhead --rounds 15
        fatune bench --inference -o results/
    """
    import torch

    from fatune import bench as runner
    from fatune.spec import dtype_name

    causal_values = {"both": (False, True), "yes": (True,), "no": (False,)}[causal]
    shapes = apply_mask(runner.default_shapes(tuple(head_dims), tuple(lengths), causal_values,
                                              tuple(dtype_name(d) for d in dtypes), tokens, model_dim, gqa),
                        mask, window, valid_keys, documents)
    if dry_run:
        click.echo("\n".join(shape.label() for shape in shapes))
        return
    if not torch.cuda.is_available():
        raise click.ClickException("fatune bench times CUDA kernels and needs a CUDA GPU; none is visible")
    if inference:
        ceiling = runner.copy_bandwidth()
        rows = runner.bench_inference(warmup_ms=warmup_ms, rep_ms=rep_ms)
        meta = runner.environment()
        lines = [f"GPU {meta['gpu']}, torch {meta['torch']}, Triton {meta['triton']}, {meta['date']}; forward only, "
                 f"median of triton.testing.do_bench; device copy {ceiling:.2f} TB/s", "",
                 runner.inference_table(rows, ceiling)]
        output.mkdir(parents=True, exist_ok=True)
        (output / "inference.md").write_text("\n".join(lines) + "\n")
        (output / "inference.json").write_text(json.dumps({"meta": meta, "copy_tb_s": ceiling, "rows": rows},
                                                          indent=1))
        click.echo("\n".join(lines))
        return
    if overhead:
        click.echo("\n".join(runner.overhead_lines(runner.host_overhead(rounds=rounds), rounds=rounds)))
        return
    rows = []
    with click.progressbar(shapes, label="bench", item_show_func=lambda s: s.label() if s else "") as bar:
        for shape in bar:
            rows += runner.bench_shape(shape, impls, warmup_ms, rep_ms)
    output.mkdir(parents=True, exist_ok=True)
    meta = runner.environment()
    table, summary = runner.ratio_table(rows)
    lines = [f"GPU {meta['gpu']} (sm {meta['capability']}), torch {meta['torch']}, Triton {meta['triton']}, "
             f"CUDA {meta['cuda']}, cuDNN {meta['cudnn']}, {meta['date']}", "", table, ""]
    for name in summary.ratios:
        values = summary.ratios[name]
        lines.append(f"- fatune / {name}: geometric mean {summary.geomean(name):.3f}, worst {min(values):.3f}, "
                     f"best {max(values):.3f} over {len(values)} shapes")
    lines += ["", runner.detail_table(rows)]
    (output / "bench.md").write_text("\n".join(lines) + "\n")
    runner.write_json(rows, str(output / "bench.json"), meta)
    try:
        runner.plot(rows, str(output / "bench.png"))
    except ImportError:
        click.echo("matplotlib is not installed: no plot (pip install 'fatune[plot]')", err=True)
    click.echo("\n".join(lines[:len(lines) - 2]))
    click.echo(f"wrote {output / 'bench.md'}, bench.json, bench.png")
