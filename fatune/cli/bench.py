"""`fatune bench`: the benchmark suites (fatune.bench), fatune beside torch SDPA's backends and FlexAttention."""

from __future__ import annotations

import math
import os
from pathlib import Path

import click

from fatune.bench import SUITES
from fatune.cli.options import (
    ARGV,
    MAX_SIZE,
    apply_mask,
    check_shapes,
    int_list,
    mask_variant_options,
    name_list,
    reexec_interpreted,
)
from fatune.kernel.spec import dtype_name
from fatune.settings import interpreting

SUITE_DEFAULTS = {  # per suite: the --head-dims and --lengths a run gets when they are not given
    "dense": ("64,128", "1024,2048,4096,8192,16384"),
    "masked": ("128", "8192"),
}
RESUMABLE = ("search-quality", "tuning-gain")


def _counts(value: str, allow_empty: bool = False) -> list[int]:
    """'0,1,2' -> [0, 1, 2]: integers from 0 (seeds, indices); '' -> [] where allowed."""
    parts = [part.strip() for part in value.split(",") if part.strip()]
    if not (parts or allow_empty and not value.strip()) or not all(part.isdigit() for part in parts):
        raise click.BadParameter(f"expected comma-separated integers from 0 such as 0,1,2, got {value!r}")
    return [int(part) for part in parts]


def _milliseconds(value: float, positive: bool = False) -> float:
    """A timing budget: finite, at most an hour, and > 0 (`positive`) or >= 0 (click's FloatRange lets NaN by)."""
    if not (math.isfinite(value) and (value > 0 if positive else value >= 0) and value <= 3.6e6):
        raise click.BadParameter(f"expected a number of milliseconds {'> 0' if positive else '>= 0'} and at most "
                                 f"3600000, got {value}")
    return value


def _impl_names(suite: str) -> tuple[str, ...]:
    """The implementations a suite can time (--impls)."""
    from fatune.tuning.competitors import SDPA_BACKENDS

    sdpa = tuple(f"sdpa-{backend}" for backend in SDPA_BACKENDS)
    if suite == "dense":
        from fatune.bench import dense

        return (*dense.FATUNE_IMPLS, *sdpa, "flex")
    if suite == "masked":  # its cases without a mask tensor run as dense shapes
        from fatune.bench import dense

        return (*dense.FATUNE_IMPLS, "flex", *sdpa)
    if suite == "inference":
        return ("fatune", "fatune-unsplit", "fatune-paged", *sdpa)
    return ()


def _ints_or_none(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int] | None:
    return None if value is None else int_list(ctx, param, value)


@click.command()
@click.option("--suite", type=click.Choice(SUITES), default=None,
              help="What to measure (default: dense): dense (the training-step grid), masked (windows, padding, "
                   "packed documents, GQA, mask tensors), inference (decode, chunked prefill), overhead (host cost "
                   "per call), search-quality, tuning-gain, transformers (a Hugging Face Llama's training step and "
                   "generation, fatune against SDPA).")
@click.option("--head-dims", default=None, callback=_ints_or_none,
              help="Comma-separated head dims (dense: 64,128; masked: 128).")
@click.option("--lengths", default=None, callback=_ints_or_none,
              help="Comma-separated sequence lengths, L_q = L_k (dense: 1024,2048,4096,8192,16384; masked: 8192).")
@click.option("--causal", type=click.Choice(["both", "yes", "no"]), default="both", show_default=True)
@click.option("--dtypes", default="bf16", show_default=True, callback=name_list, help="Comma-separated: bf16, fp16.")
@click.option("--impls", default=None, callback=lambda ctx, param, value: None if value is None else
              name_list(ctx, param, value),
              help="Implementations to compare (dense: fatune,fatune-kernels,fatune-heuristic,sdpa-cudnn,sdpa-flash,"
                   "sdpa-efficient,sdpa-math,flex; fatune-plain, fatune-gluon, fatune-triton too; fatune is what the "
                   "dispatcher runs, a faster SDPA backend included, fatune-kernels fatune's own kernels; masked: fatune,flex,sdpa-cudnn,sdpa-flash,"
                   "sdpa-efficient; inference: fatune,fatune-unsplit,fatune-paged,sdpa-flash,sdpa-cudnn,"
                   "sdpa-efficient).")
@click.option("--gqa", type=click.IntRange(1, 64), default=1, show_default=True,
              help="dense: query heads per key/value head (grouped-query attention).")
@click.option("--mask", type=click.Choice(["none", "window", "padding", "packed"]), default="none", show_default=True,
              help="dense: a mask variant on every shape: a causal sliding window (--window keys; implies --causal "
                   "yes), key padding (--valid-keys of each sequence's keys) or the batch's tokens packed as "
                   "--documents documents (cu_seqlens; Flex gets a document mask, SDPA cannot take it); competitors "
                   "get the same mask.")
@mask_variant_options
@click.option("--tokens", type=click.IntRange(1, MAX_SIZE), default=None,
              help="dense, masked: B * L per shape (default 16384; 64 with --interpret).")
@click.option("--model-dim", type=click.IntRange(1, MAX_SIZE), default=None,
              help="dense, masked: H * D per shape (default 2048; 64 with --interpret).")
@click.option("--only", default="", help="masked: the cases whose name contains one of these comma-separated texts.")
@click.option("--warmup-ms", default=25.0, show_default=True, callback=lambda ctx, param, value: _milliseconds(value))
@click.option("--rep-ms", default=100.0, show_default=True,
              callback=lambda ctx, param, value: _milliseconds(value, positive=True))
@click.option("--calls", type=click.IntRange(1), default=2000, show_default=True,
              help="overhead: calls per round of each workload.")
@click.option("--rounds", type=click.IntRange(1, 1000), default=5, show_default=True,
              help="overhead: rounds per implementation (the median is reported).")
@click.option("--part", type=click.Choice(["grid", "search", "retime", "gain", "nearest", "tie", "table"]),
              default=None, help="search-quality: grid, search, retime or table; tuning-gain: gain, nearest, tie or "
                                 "table (each run adds its part to the output folder's state.json).")
@click.option("--shapes", "shape_indices", default="", callback=lambda ctx, param, value: _counts(value, True),
              help="search-quality, tuning-gain: indices into the part's shape list, from 0 (default: all).")
@click.option("--trials", type=click.IntRange(1), default=None,
              help="search-quality, tuning-gain: trials per kernel of each search (default 50, 30).")
@click.option("--seeds", default="0,1,2", show_default=True, callback=lambda ctx, param, value: _counts(value),
              help="search-quality --part search: the search seeds.")
@click.option("--sampler", default="tpe", show_default=True,
              help="search-quality --part search: how trials are drawn (tpe, tpe-independent, random).")
@click.option("--checkpoints", default="10,20,30,50", show_default=True, callback=int_list,
              help="search-quality: the trial counts after which each study's best is timed.")
@click.option("--kernels", default="fwd,dkdv,dq", show_default=True, callback=name_list,
              help="search-quality --part grid/retime: the kernels (the forward's grid is the largest).")
@click.option("--regrid", is_flag=True, help="search-quality --part grid: time again the grids of a space that "
                                            "changed since they were stored.")
@click.option("--compile-workers", type=click.IntRange(0), default=max(1, min(15, (os.cpu_count() or 2) - 1)),
              show_default=True, help="search-quality, tuning-gain: processes compiling candidates ahead.")
@click.option("--db", "db_path", default="tuned_db/nvidia-h200.sqlite", show_default=True,
              help="tuning-gain --part tie: the tuned DB whose tied entries are timed.")
@click.option("--merge", type=click.Path(exists=True, file_okay=False, path_type=Path), multiple=True,
              help="search-quality, tuning-gain: another run's output folder whose state.json is merged in first.")
@click.option("-o", "--output", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder for results.json, results.csv, bench.md and bench.png (default: bench-results/SUITE).")
@click.option("--inference", is_flag=True, help="Deprecated: --suite inference.")
@click.option("--overhead", is_flag=True, help="Deprecated: --suite overhead.")
@click.option("--compile", "compile_backend", type=click.Choice(["inductor", "aot_eager"]), default=None,
              help="dense: time each implementation through torch.compile(fullgraph=True, dynamic=False) with this "
                   "backend, traced afresh per shape (what a compiled model runs; aot_eager: a CPU smoke run).")
@click.option("--interpret", is_flag=True,
              help="Run in Triton's interpreter on the CPU (a smoke run: tiny shapes, wall-clock timings that mean "
                   "nothing; overhead: fatune's own host cost with no-op launches).")
@click.option("--dry-run", is_flag=True, help="List what the run would time, and stop (no GPU needed).")
def bench(suite, head_dims, lengths, causal, dtypes, impls, gqa, mask, window, valid_keys, documents, tokens,
          model_dim, only, warmup_ms, rep_ms, calls, rounds, part, shape_indices, trials, seeds, sampler,
          checkpoints, kernels, regrid, compile_workers, db_path, merge, output, inference, overhead, compile_backend,
          interpret, dry_run) -> None:
    """Measure fatune beside torch SDPA (each backend forced) and FlexAttention: one suite per run, the same
    result files for all.

    Example:

    \b
        fatune bench --head-dims 128 --lengths 4096,16384 --causal yes -o results/
        fatune bench --head-dims 128 --lengths 8192 --mask window --window 1024 --impls fatune,flex
        fatune bench --head-dims 64,128 --compile inductor --impls fatune,fatune-kernels,sdpa-cudnn
        fatune bench --suite masked --lengths 2048,8192 --only "window,packed"
        fatune bench --suite inference -o results/inference
        fatune bench --suite overhead --rounds 15
        fatune bench --suite search-quality --part grid --shapes 0 -o sq/
        fatune bench --suite tuning-gain --part gain --trials 30 -o tg/
    """
    aliases = [name for name, flag in (("inference", inference), ("overhead", overhead)) if flag]
    if len(aliases) > 1 or (aliases and suite not in (None, aliases[0])):
        raise click.UsageError(f"--{aliases[0]} is --suite {aliases[0]}: give one suite")
    suite = suite or (aliases[0] if aliases else "dense")
    if aliases:
        click.echo(f"--{suite} is deprecated: use --suite {suite}", err=True)
    if compile_backend and suite != "dense":
        raise click.UsageError("--compile belongs to --suite dense")
    if part is not None and suite not in RESUMABLE:
        raise click.UsageError("--part belongs to --suite search-quality or tuning-gain")
    if suite in RESUMABLE:
        parts = ("grid", "search", "retime", "table") if suite == "search-quality" else ("gain", "nearest", "tie",
                                                                                          "table")
        if part not in parts:
            raise click.UsageError(f"--suite {suite} takes --part {'|'.join(parts)}")
    impls = impls or None  # "": the suite's default set
    if impls is not None:
        known = _impl_names(suite)
        unknown = [name for name in impls if name not in known]
        if not known or unknown:
            raise click.BadParameter(f"--suite {suite} times one or more of {', '.join(known)}, got "
                                     f"{','.join(impls)}" if known else
                                     f"--suite {suite} takes no --impls", param_hint="--impls")
    try:
        dtypes = [dtype_name(d) for d in dtypes]
    except ValueError as error:
        raise click.BadParameter(str(error).removeprefix("dtype: "), param_hint="--dtypes") from None
    output = output or Path("bench-results") / suite
    tokens = tokens or (64 if interpret else 16384)  # --interpret: small shapes
    model_dim = model_dim or (64 if interpret else 2048)
    planned = _plan(suite, head_dims, lengths, causal, dtypes, gqa, mask, window, valid_keys, documents, tokens,
                    model_dim, only)
    check_shapes([getattr(item, "shape", item) for item in planned])  # masked cases hold theirs
    if dry_run:
        click.echo("\n".join(_listing(suite, planned, part, shape_indices, interpret or interpreting())))
        return
    ctx = click.get_current_context()
    if interpret:
        reexec_interpreted(ctx)
    interpret = interpret or interpreting()
    if not interpret and not (suite in RESUMABLE and part == "table"):
        import torch

        if not torch.cuda.is_available():
            raise click.ClickException("fatune bench times CUDA kernels and needs a CUDA GPU; none is visible "
                                       "(--interpret runs a suite in Triton's interpreter on the CPU)")
    if interpret:
        click.echo("Triton interpreter: the timings below are NOT meaningful (CPU emulation).", err=True)
    report = _run(suite, planned, impls, warmup_ms, rep_ms, calls, rounds, part, shape_indices, trials, seeds,
                  sampler, checkpoints, kernels, regrid, compile_workers, db_path, merge, output, interpret,
                  compile_backend)
    from fatune.bench import results

    env = results.environment(ctx.meta.get(ARGV), "cpu" if interpret else None)
    written = results.write(output, report, env)
    click.echo(results.environment_line(env))
    click.echo(report.echo or report.markdown)
    missing = " (no plot: pip install 'fatune[plot]' for matplotlib)" if report.plot and len(written) == 3 else ""
    click.echo(f"wrote {', '.join(str(path) for path in written)}{missing}")


def _plan(suite, head_dims, lengths, causal, dtypes, gqa, mask, window, valid_keys, documents, tokens, model_dim,
          only) -> list:
    """The shapes (dense) or cases (masked) a run times; nothing for the other suites."""
    if suite not in SUITE_DEFAULTS:
        return []
    default_dims, default_lengths = SUITE_DEFAULTS[suite]
    head_dims = head_dims or [int(d) for d in default_dims.split(",")]
    lengths = lengths or [int(n) for n in default_lengths.split(",")]
    dtypes = tuple(dtypes)
    if suite == "masked":
        from fatune.bench import masked

        return masked.plan(lengths, head_dims, model_dim, tokens, dtypes, only)
    from fatune.bench import dense

    causal_values = {"both": (False, True), "yes": (True,), "no": (False,)}[causal]
    return apply_mask(dense.default_shapes(tuple(head_dims), tuple(lengths), causal_values, dtypes, tokens,
                                           model_dim, gqa), mask, window, valid_keys, documents)


def _listing(suite: str, planned: list, part: str | None, indices: list[int], interpret: bool) -> list[str]:
    """What --dry-run prints: one line per shape, case or workload."""
    if suite == "dense":
        return [shape.label() for shape in planned]
    if suite == "masked":
        return [f"{case.name}: {case.shape.label()}" for case in planned]
    if suite == "inference":
        from fatune.bench import inference

        return [shape.label() for shape in (inference.INTERPRETER_SHAPES if interpret else inference.INFERENCE_SHAPES)]
    if suite == "transformers":
        from fatune.bench import models

        workload = models.INTERPRETER_WORKLOAD if interpret else models.GPU_WORKLOAD
        return [f"{part} {impl}: {workload.label()}" for part in ("train", "generate") for impl in models.IMPLS]
    if suite == "overhead":
        from fatune.bench import overhead

        return [f"{workload} {impl}: {overhead.SHAPE.label()}" for workload, impl in overhead.WORKLOADS]
    from fatune.bench import resumable, search_quality, tuning_gain

    if part == "table":
        return []
    if suite == "search-quality":
        shapes = search_quality.INTERPRETER_SHAPES if interpret else search_quality.GPU_SHAPES
    else:
        shapes = {"gain": (tuning_gain.INTERPRETER_GAIN, tuning_gain.GAIN_SHAPES),
                  "nearest": ([s for s, _ in tuning_gain.INTERPRETER_NEAREST], [s for s, _ in tuning_gain.NEAREST_SHAPES]),
                  "tie": (tuning_gain.INTERPRETER_TIE, tuning_gain.TIE_SHAPES)}[part][0 if interpret else 1]
    try:
        return [f"{part} {shape.label()}" for shape in resumable.pick(list(shapes), indices)]
    except ValueError as error:
        raise click.BadParameter(str(error).removeprefix("--shapes: "), param_hint="--shapes") from None


def _run(suite, planned, impls, warmup_ms, rep_ms, calls, rounds, part, indices, trials, seeds, sampler,
         checkpoints, kernels, regrid, compile_workers, db_path, merge, output, interpret, compile_backend=None):
    """Run the suite; its Report."""
    if suite == "dense":
        from fatune.bench import dense

        with click.progressbar(planned, label="bench", item_show_func=lambda s: s.label() if s else "") as bar:
            return dense.run(planned, impls or dense.DEFAULT_IMPLS, warmup_ms, rep_ms, each=lambda _: bar,
                             compile=compile_backend)
    if suite == "masked":
        from fatune.bench import masked

        with click.progressbar(planned, label="bench", item_show_func=lambda c: c.name if c else "") as bar:
            return masked.run(planned, impls, warmup_ms, rep_ms, each=lambda _: bar)
    if suite == "inference":
        from fatune.bench import inference

        return inference.run(tuple(impls) if impls else None, warmup_ms, rep_ms)
    if suite == "overhead":
        from fatune.bench import overhead

        return overhead.run(calls, rounds)
    if suite == "transformers":
        from fatune.bench import models

        return models.run(interpret)
    from fatune.bench import resumable

    try:  # this folder's state and the merged ones', checked before any measurement
        state = resumable.load(output)
        for folder in merge:
            resumable.merge(state, resumable.load(folder))
    except ValueError as error:
        raise click.ClickException(str(error)) from None
    if merge:
        resumable.save(output, state)
    echo = click.echo  # progress lines as they come
    try:
        if suite == "search-quality":
            from fatune.bench import search_quality
            from fatune.tuning.study import SAMPLERS

            if sampler not in SAMPLERS:
                raise click.BadParameter(f"expected one of {', '.join(SAMPLERS)}, got {sampler!r}",
                                         param_hint="--sampler")
            unknown = set(kernels) - set(search_quality.KERNELS)
            if unknown:
                raise click.BadParameter(f"expected a comma-separated subset of fwd,dkdv,dq, got {','.join(kernels)}",
                                         param_hint="--kernels")
            return search_quality.run(output, part, interpret=interpret, shapes=indices, kernels=tuple(kernels),
                                      seeds=tuple(seeds), trials=trials or search_quality.TRIALS,
                                      checkpoints=tuple(checkpoints), sampler=sampler, regrid=regrid,
                                      compile_workers=compile_workers, echo=echo)
        from fatune.bench import tuning_gain

        return tuning_gain.run(output, part, interpret=interpret, shapes=indices, trials=trials or tuning_gain.TRIALS,
                               db=db_path, compile_workers=compile_workers, echo=echo)
    except ValueError as error:
        if "--shapes" in str(error):
            raise click.BadParameter(str(error).removeprefix("--shapes: "), param_hint="--shapes") from None
        raise
