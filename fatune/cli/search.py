"""`fatune search`: tune launch configs for this GPU and store the winners in the tuned DB."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import click

from fatune.cli.options import (
    MAX_SIZE,
    apply_mask,
    check_shapes,
    finite,
    int_list,
    mask_variant_options,
    optional_int_list,
    parse_dtype,
    reexec_interpreted,
)

# the progress bar counts the storage's finished trials at most every PROGRESS_S, and spends at most PROGRESS_SHARE of
# the time counting (each count reads every trial of the shape's studies: a quarter second once they hold hundreds),
# yet counts at least every PROGRESS_MAX_S (one slow count, behind another host's lock, does not freeze the bar)
PROGRESS_S = 1.0
PROGRESS_SHARE = 0.02
PROGRESS_MAX_S = 30.0


class CountThrottle:
    """When the progress bar counts again: PROGRESS_S after its last count, or the count's cost / PROGRESS_SHARE
    if longer, at most PROGRESS_MAX_S."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.next_at = -math.inf

    def due(self) -> bool:
        return self.clock() >= self.next_at

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        started = self.clock()
        try:
            yield
        finally:
            ended = self.clock()
            self.next_at = ended + min(PROGRESS_MAX_S, max(PROGRESS_S, (ended - started) / PROGRESS_SHARE))


DEFAULT_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
DECODE_QUERIES = 16  # fatune.kernel.triton.heuristics.DECODE_QUERIES (not imported here: `fatune --help` stays fast)


def default_batch(tokens: int, seqlen_q: int, seqlen_k: int) -> int:
    """The batch when --batch is not given: B * L_q = tokens for prefill (training) shapes; for decode shapes
    (L_q <= DECODE_QUERIES, the query bucket fatune.tuning.study.forward_only tests; searched forward-only),
    B * L_k = tokens: a KV cache of that many tokens."""
    return max(1, tokens // (seqlen_k if seqlen_q <= DECODE_QUERIES else seqlen_q))


def _given_int_list(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int] | None:
    """int_list, or None when the option is not given (so that giving both of two aliases can be refused)."""
    return None if value is None else int_list(ctx, param, value)


@click.command()
@click.option("--head-dim", type=click.IntRange(1, 256), required=True, help="Head dim of query/key (and value).")
@click.option("--dtype", default="bf16", show_default=True, callback=parse_dtype, help="fp16, bf16 or fp32.")
@click.option("--lengths-q", "lengths_q", callback=_given_int_list,
              default=None,
              help="Comma-separated query lengths [default: 512,1024,2048,4096,8192,16384]. Lengths up to "
                   f"{DECODE_QUERIES} are inference (decode) shapes: only the forward is searched and timed.")
@click.option("--lengths", "lengths_old", callback=_given_int_list,
              default=None,
              help="Comma-separated query lengths, the same as --lengths-q (key lengths too unless --lengths-k).")
@click.option("--lengths-k", callback=optional_int_list, default="",
              help="Key lengths (default: same as --lengths-q).")
@click.option("--batch", type=click.IntRange(0, MAX_SIZE), default=0,
              help="Batch size (default: 16384 tokens / L_q; for decode shapes, L_q <= "
                   f"{DECODE_QUERIES}, max(1, 16384 / L_k): a KV cache of 16384 tokens).")
@click.option("--heads", type=click.IntRange(0, MAX_SIZE), default=0, help="Query heads (default: 2048 / head dim).")
@click.option("--kv-heads", type=click.IntRange(0, MAX_SIZE), default=0,
              help="Key/value heads for GQA (default, or 0: same as --heads).")
@click.option("--mask", type=click.Choice(["both", "none", "causal", "window", "padding", "packed"]), default="both",
              show_default=True, help="Mask variant(s): both = none and causal; packed = the batch's tokens packed "
                                      "as --documents documents (cu_seqlens), causal and not.")
@mask_variant_options
@click.option("--trials", type=click.IntRange(1), default=30, show_default=True,
              help="Optuna trials per kernel per shape, in all (every worker and host together).")
@click.option("--time-budget", type=click.FloatRange(0, min_open=True), default=600.0, show_default=True,
              callback=finite,
              help="Seconds per shape.")
@click.option("--seed", type=click.IntRange(-(2**63), 2**63 - 1), default=0, show_default=True,
              help="Sampler seed (same seed, same trial sequence).")
@click.option("--db", "db_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Tuned DB file (default: $FATUNE_DB or ~/.cache/fatune/tuned.sqlite).")
@click.option("--storage", default=None,
              help="Optuna storage URL; the same PostgreSQL URL on several hosts puts them on one search, e.g. "
                   "postgresql://user@host/db (default: SQLite file beside the DB).")
@click.option("--workers", type=click.IntRange(1), default=None,
              help="Worker processes on this host (default: one per visible GPU; 1 with --interpret).")
@click.option("--compile-workers", type=click.IntRange(0), default=None,
              help="Processes per worker compiling the next candidates ahead (default: the CPU cores per worker "
                   "less one, at most 8; 0 with --interpret).")
@click.option("--interpret", is_flag=True, help="Run in Triton's CPU interpreter: tiny shapes, timings not meaningful.")
@click.option("--family", "families", type=click.Choice(["all", "triton"]), default="all", show_default=True,
              help="Kernel families searched: all = the Triton family's kernels and, on Hopper GPUs, the Gluon "
                   "forward and backward beside the Triton ones (the faster of each is stored); triton = the Triton "
                   "family alone.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option("--profile", is_flag=True,
              help="After the results, print where each shape's wall time went in this process, seconds per phase "
                   "(studies, inputs, torch reference, asking Optuna, compile wait, build, check, quick and full "
                   "timing, telling, census, waiting for other workers, progress, SDPA, re-timing, DB write). "
                   "--json always includes it as each shape's \"breakdown\".")
def search(head_dim, dtype, lengths_q, lengths_old, lengths_k, batch, heads, kv_heads, mask, window, valid_keys,
           documents, trials, time_budget, seed, db_path, storage, workers, compile_workers, interpret, families,
           as_json, profile) -> None:
    """Search launch configs for each shape, timing forward+backward (decode: forward), and store the winners.

    Each kernel (forward, dK/dV, dQ) gets its own Optuna study; inference shapes (query
    lengths up to 16: decode) get the forward's alone, timed without the backward, and their
    entries keep the heuristic's backward configs. Winners are checked
    against torch, re-timed end to end and compared with torch's best SDPA backend in
    the same run. An interrupted (Ctrl-C) or killed search resumes from its Optuna storage
    when the same command runs again. Workers on this host (one per GPU) and the same command
    on other hosts sharing a --storage work on the same studies; each host stores the winners
    in its own DB. A candidate that fails to compile prints one line; what the compiler printed
    goes to a log in $FATUNE_LOG_DIR (default ~/.cache/fatune/logs).

    Example:

    \b
        fatune search --head-dim 64 --dtype bf16
        fatune search --head-dim 128 --dtype fp16 --lengths 4096 --mask causal --trials 40
        fatune search --head-dim 64 --dtype bf16 --storage postgresql://tuner@db-host/fatune
        fatune search --head-dim 128 --lengths-q 1 --lengths-k 8192 --heads 32 --kv-heads 8 --mask none
        fatune search --head-dim 128 --lengths 8192 --mask packed --documents 16
    """
    if lengths_q is not None and lengths_old is not None:
        raise click.UsageError("--lengths and --lengths-q are the same option (--lengths is the older name of "
                               "--lengths-q): give one")
    if interpret:
        reexec_interpreted(click.get_current_context())
    from fatune import db as tuned_db
    from fatune.tuning import storage as studies
    from fatune.tuning import workers as hosts
    from fatune.tuning.shape import Shape

    # the interpreter runs tiles as numpy arrays: keep its default shapes small
    lengths = lengths_q or lengths_old or list(DEFAULT_LENGTHS if not interpret else (64, 128))
    if len(lengths_k or lengths) != len(lengths):
        raise click.BadParameter("give as many key lengths as query lengths", param_hint="--lengths-k")
    tokens, model_dim = (64, 32) if interpret else (16384, 2048)
    heads = heads or max(1, model_dim // head_dim)
    if heads % (kv_heads or heads):
        raise click.BadParameter(f"expected a divisor of --heads {heads}, got {kv_heads}", param_hint="--kv-heads")
    lengths_k = lengths_k or lengths
    causal_values = {"both": (False, True), "none": (False,), "causal": (True,), "window": (True,),
                     "padding": (False, True), "packed": (False, True)}[mask]
    shapes = [Shape(batch=batch or default_batch(tokens, lq, lk), heads=heads, seqlen_q=lq, seqlen_k=lk,
                    head_dim=head_dim, dtype=dtype, causal=c, kv_heads=kv_heads or heads)
              for c in causal_values for lq, lk in zip(lengths, lengths_k)]
    shapes = apply_mask(shapes, mask, window, valid_keys, documents)
    check_shapes(shapes)

    # everything that can fail for a reason other than the search itself fails here, before any trial
    try:
        db_path = db_path or tuned_db.default_path()
        tuned_db.check_writable(db_path)
    except tuned_db.DBError as error:
        raise click.ClickException(str(error)) from None
    if storage is None:  # beside the DB, whose folder (the default ~/.cache/fatune on a new machine) may be new
        try:
            db_path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise click.ClickException(f"{db_path}: folder {db_path.parent} cannot be created "
                                       f"({error.strerror or error})") from None
    try:
        storage = studies.normalise_url(storage or studies.default_storage_url(db_path))
        studies.check_storage(storage)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--storage") from None
    try:
        workers = hosts.worker_count(workers, interpret)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--workers") from None
    from fatune.tuning import compile_log
    from fatune.tuning.space import GPU_SPACE, INTERPRETER_SPACE
    from fatune.tuning.target import Target

    log = compile_log.start()  # every worker's compiler output goes to this one file, if any is printed
    space = INTERPRETER_SPACE if interpret else GPU_SPACE
    if families == "triton":
        space = dataclasses.replace(space, families=("triton",))
    try:
        compile_workers = hosts.compile_worker_count(compile_workers, workers, interpret)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--compile-workers") from None
    job = hosts.Job(tuple(shapes), trials, time_budget, storage, seed, space, interpret, compile_workers, str(log))
    try:
        database = tuned_db.TunedDB(db_path)
    except tuned_db.DBError as error:
        raise click.ClickException(str(error)) from None
    from fatune.tuning.precompile import CompilePool

    # started first: its processes import torch and Triton while this one opens the storage and the GPU and
    # starts the helpers (the first candidates' compiles wait for the pool's start)
    with CompilePool(job.compile_workers, "cpu" if interpret else "cuda") as pool, database:
        try:
            storage = studies.open_storage(storage)
        except ValueError as error:
            raise click.ClickException(f"--storage {error}") from None
        try:
            target = Target.detect(interpret)
        except RuntimeError as error:
            raise click.ClickException(str(error)) from None
        started = time.time()
        try:
            with hosts.Helpers(job, workers) as helpers:
                results = _search(job, target, storage, database, pool)
        except KeyboardInterrupt:
            click.echo("\nfatune search: interrupted; finished shapes are stored, and running the same command "
                       "again resumes from the Optuna storage", err=True)
            sys.exit(130)
        for failure in helpers.failures():
            click.echo(f"fatune search: {failure}; the other workers finished its share", err=True)
    if compile_log.path().is_file():
        click.echo(f"fatune search: compiler output of the candidates: {compile_log.path()}", err=True)
    if as_json:
        click.echo(json.dumps([_result_json(r, stored, target) for r, stored in results], indent=1))
        return
    _print_table(results, target, database.path, time.time() - started, workers)
    if profile:
        _print_breakdown([result for result, _ in results])


def _search(job, target, storage, database, pool) -> list:
    """Search the shapes with a progress bar on stderr (trials finished by every worker and host, and an
    ETA) and store each one's winners as soon as they are measured; [(result, stored)]."""
    import optuna

    from fatune.tuning import search as tuner
    from fatune.tuning.space import trial_budget
    from fatune.tuning.study import shape_kernels

    optuna.logging.set_verbosity(optuna.logging.ERROR)  # a Ctrl-C'd trial's traceback is not the user's business
    shapes = list(job.shapes)
    results = []
    total = sum(trial_budget(job.space, target, shape, kernel, job.trials)
                for shape in shapes for kernel in shape_kernels(shape, target, job.space))
    with click.progressbar(length=total, label="search", file=sys.stderr, show_pos=True,
                           show_eta=True) as bar:
        throttle = CountThrottle()
        done: set = set()  # shapes whose studies have all their trials: not counted again

        def refresh(force: bool = False) -> None:
            if force or throttle.due():
                with throttle.counting():
                    bar.update(tuner.finished_trials(shapes, target, job.trials, storage, done, job.space) - bar.pos)

        def on_trial(shape, kernel, best_ms):
            bar.label = f"{shape.label()} {kernel} best {best_ms:.3f} ms"
            refresh()

        # shapes are pipelined (fatune.tuning.search.search_shapes): each result comes once its studies are done
        found = tuner.search_shapes(shapes, target, trials=job.trials, seconds=job.seconds, storage=storage,
                                    seed=job.seed, space=job.space, pool=pool, on_trial=on_trial,
                                    warm=lambda shape: tuner.warm_starts(database, target, shape))
        while True:
            try:
                result = next(found, None)
            except RuntimeError as error:
                raise click.ClickException(str(error)) from None
            if result is None:
                break
            started = time.perf_counter()
            stored = tuner.store(database, result, target)
            result.breakdown["db"] = time.perf_counter() - started
            results.append((result, stored))
            refresh(force=True)
    return results


def _result_json(result, stored: bool, target) -> dict:
    return {
        "shape": result.shape.label(), "config": result.config.to_dict(), "kernel_ms": result.kernel_ms,
        "fwd_ms": result.fwd_ms, "bwd_ms": _timed(result.bwd_ms), "fwd_bwd_ms": _timed(result.fwd_bwd_ms),
        "forward_only": result.forward_only, "tflops": result.tflops,
        "sdpa_backend": result.sdpa_backend, "sdpa_ms": None if math.isnan(result.sdpa_ms) else result.sdpa_ms,
        "speedup": None if math.isnan(result.speedup) else result.speedup, "trials": result.trials,
        "rejected": result.rejected, "seconds": result.seconds, "trials_per_s": result.trials_per_s,
        "breakdown": result.breakdown, "stored": stored,
        "interpreted": target.interpret, "gpu": target.gpu,
    }


def _timed(ms: float) -> float | None:
    """A time for the JSON output: None (null) when not timed (the backward of a forward-only shape)."""
    return None if math.isnan(ms) else ms


def _cell(ms: float) -> str:
    """A time for the table: '–' when not timed (the backward of a forward-only shape)."""
    return "–" if math.isnan(ms) else f"{ms:.3f}"


def _print_table(results, target, db_path, seconds: float, workers: int) -> None:
    click.echo(f"\n{target.gpu} (sm {target.capability}); tuned DB {db_path}")
    if target.interpret:
        click.echo("Triton interpreter: the timings below are NOT meaningful (CPU emulation).")
    header = f"{'shape':44} {'fwd ms':>8} {'bwd ms':>8} {'f+b ms':>8} {'TFLOP/s':>8} {'SDPA best':>16} {'speedup':>7} " \
             f"{'trials':>6} {'wall s':>7} {'trials/s':>8}  configs fwd | dkdv | dq"
    click.echo(header)
    click.echo("-" * len(header))
    for result, stored in results:
        sdpa = f"{result.sdpa_backend} {result.sdpa_ms:.3f}" if result.sdpa_backend else "n/a"
        speed = f"{result.speedup:.2f}x" if not math.isnan(result.speedup) else "n/a"
        configs = f"{result.config.fwd} | {result.config.dkdv} | {result.config.dq}"
        click.echo(f"{result.shape.label():44} {result.fwd_ms:8.3f} {_cell(result.bwd_ms):>8} {_cell(result.fwd_bwd_ms):>8} "
                   f"{result.tflops:8.1f} {sdpa:>16} {speed:>7} {result.trials:6d} {result.seconds:7.1f} "
                   f"{result.trials_per_s:8.2f}  {configs}{'' if stored else '  (DB kept a faster entry)'}")
    trials = sum(result.trials for result, _ in results)
    click.echo(f"{len(results)} shapes, {trials} trials in {seconds:.1f} s wall ({trials / seconds:.2f} trials/s) "
               f"with {workers} worker{'s' if workers > 1 else ''} on this host")


BREAKDOWN_COLUMNS = (  # (phase in ShapeResult.breakdown, column title); fatune.tuning.search.SHAPE_PHASES plus "other"
    ("studies", "studies"), ("inputs", "inputs"), ("reference", "ref"), ("ask", "ask"),
    ("compile_wait", "compile"), ("build", "build"), ("check", "check"), ("quick", "quick"), ("full", "full"),
    ("tell", "tell"), ("census", "census"), ("wait", "wait"), ("progress", "progress"), ("sdpa", "sdpa"),
    ("retime", "retime"), ("db", "db"), ("other", "other"),
)


def _print_breakdown(results) -> None:
    """(--profile) Where each shape's wall time went in this process, seconds per phase: fixed costs (studies, inputs,
    torch reference, SDPA timing, end-to-end re-timing, DB write) and the sums over its trials (asking,
    waiting for the compile pool, building the runner and loading kernels, checking, quick and full
    timing, telling; census and wait: looking at and waiting for other processes' trials)."""
    if not results:
        return
    click.echo("\nwall time per shape in this process, seconds per phase (trial phases summed over its trials):")
    header = f"{'shape':44} {'wall':>6} " + " ".join(f"{title:>8}" for _, title in BREAKDOWN_COLUMNS)
    click.echo(header)
    for result in results:
        cells = " ".join(f"{result.breakdown.get(phase, 0.0):8.2f}" for phase, _ in BREAKDOWN_COLUMNS)
        click.echo(f"{result.shape.label():44} {result.seconds + result.breakdown.get('db', 0.0):6.1f} {cells}")
