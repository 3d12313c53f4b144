"""`fatune db`: inspect, export, import and prune tuned databases; ask which entry a call would use."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import click

from fatune.cli.options import (
    MAX_LENGTH,
    parse_capability,
    parse_dtype,
    reexec_interpreted,
)


def db_option(fn: Callable) -> Callable:
    return click.option("--db", "db_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
                        help="Tuned DB file (default: $FATUNE_DB or ~/.cache/fatune/tuned.sqlite).")(fn)


def filter_options(fn: Callable) -> Callable:
    """--gpu, --dtype, --head-dim, --mask: narrow the entries a command works on."""
    fn = click.option("--mask", "mask_variant", default=None, help="Mask variant, e.g. causal.")(fn)
    fn = click.option("--head-dim", type=click.IntRange(1, 256), default=None, help="Query/key head dim.")(fn)
    fn = click.option("--dtype", default=None, callback=parse_dtype, help="fp16, bf16 or fp32.")(fn)
    fn = click.option("--gpu", default=None, help="GPU name as recorded, e.g. 'NVIDIA H200'.")(fn)
    return fn


def _open(db_path: Path | None, readonly: bool = True, create: bool = True):
    """The tuned DB (checked writable before any work unless readonly); one line if it cannot be used."""
    from fatune.db import DBError, TunedDB, default_path

    try:
        return TunedDB(db_path or default_path(), readonly=readonly, create=create)
    except DBError as error:
        raise click.ClickException(str(error)) from None


def _entries(db_path: Path | None, gpu, dtype, head_dim, mask_variant) -> list:
    """The valid matching entries; invalid rows are named on stderr and passed over."""
    with _open(db_path) as database:
        return list(database.entries(on_invalid=lambda message: click.echo(f"warning: {message}", err=True),
                                     gpu=gpu, dtype=dtype, head_dim=head_dim, mask_variant=mask_variant))


@click.group()
def db() -> None:
    """Inspect and ship tuned databases (what `fatune search` writes, what the dispatcher reads)."""


@db.command("list")
@db_option
@filter_options
@click.option("--json", "as_json", is_flag=True, help="Print the entries as JSON.")
def list_entries(db_path, gpu, dtype, head_dim, mask_variant, as_json) -> None:
    """List the tuned entries, one line each.

    Example:

        fatune db list --dtype bf16 --head-dim 128
    """
    entries = _entries(db_path, gpu, dtype, head_dim, mask_variant)
    if as_json:
        click.echo(json.dumps([asdict(entry) for entry in entries], indent=1))
        return
    click.echo(f"{'gpu':14} {'dtype':9} {'d':>4} {'mask':18} {'g':>2} {'Lq<=':>6} {'Lk<=':>6} {'fwd ms':>8} "
               f"{'f+b ms':>8} {'TFLOP/s':>8} {'speedup':>8} {'runs':>14} {'trials':>6}  stale")
    from fatune.db import is_stale

    for e in entries:
        stale = "; ".join(is_stale(e))
        click.echo(f"{e.gpu[:14]:14} {e.dtype:9} {e.head_dim:4d} {e.mask_variant[:18]:18} {e.group_size:2d} "
                   f"{e.seqlen_q_bucket:6d} {e.seqlen_k_bucket:6d} {e.fwd_ms:8.3f} "
                   f"{'–' if e.forward_only else f'{e.fwd_bwd_ms:.3f}':>8} {e.tflops:8.1f} "
                   f"{e.speedup:8.2f} {_runs(e):>14} {e.trials:6d}  {stale}{' (interpreter)' if e.interpreted else ''}")
    click.echo(f"{len(entries)} entries")


def _runs(entry) -> str:
    """What a call of the entry's key runs: the torch SDPA backend it routes to, else fatune's kernel family."""
    if entry.route():
        return f"sdpa-{entry.route()}"
    try:
        return entry.attention_config().family
    except ValueError:
        return "?"


@db.command()
@db_option
@filter_options
def show(db_path, gpu, dtype, head_dim, mask_variant) -> None:
    """Show every field of the matching entries (configs, times, versions) as JSON.

    Example:

        fatune db show --head-dim 64 --mask causal
    """
    entries = _entries(db_path, gpu, dtype, head_dim, mask_variant)
    if not entries:
        raise click.ClickException("no matching entries")
    click.echo(json.dumps([asdict(entry) for entry in entries], indent=1, sort_keys=True))


@db.command("export")
@db_option
@filter_options
@click.argument("output", type=click.Path(dir_okay=False, path_type=Path))
def export_db(db_path, gpu, dtype, head_dim, mask_variant, output) -> None:
    """Write the matching entries to OUTPUT: a tuned DB (SQLite), or JSON for review if OUTPUT ends in .json.

    Example:

        fatune db export --gpu "NVIDIA H200" --dtype bf16 h200-bf16.sqlite
    """
    from fatune.db import DBError, export_entries

    entries = _entries(db_path, gpu, dtype, head_dim, mask_variant)
    try:
        count = export_entries(entries, output)
    except DBError as error:
        raise click.ClickException(str(error)) from None
    click.echo(f"exported {count} entries to {output}")


@db.command("import")
@db_option
@click.argument("source", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--force", is_flag=True,
              help="Import entries tuned with another Triton version or kernels that have changed since.")
def import_db(db_path, source, force) -> None:
    """Merge SOURCE (tuned DB or its JSON export) into the DB as a search writes: per key, of two entries of one
    problem the faster stays, of different problems the newer, and a current entry over a stale one.

    A corrupt, foreign or stale file, or one with any invalid entry, is refused and the DB is
    left untouched.

    Example:

        fatune db import h200-bf16.sqlite
    """
    from fatune.db import DBError, import_entries

    with _open(db_path, readonly=False) as database:
        try:
            written, kept = import_entries(database, source, force=force)
        except DBError as error:
            raise click.ClickException(str(error)) from None
    click.echo(f"imported {written} entries from {source}; kept {kept} entries already there (faster on the same "
               f"problem, newer, or current where the imported one is stale)")


@db.command()
@db_option
@filter_options
@click.option("--stale/--all", default=True, show_default=True,
              help="Drop only entries tuned with another Triton version or kernels that have changed since, "
                   "or every match. Invalid rows (no fatune can use them) are dropped either way.")
@click.option("--dry-run", is_flag=True, help="Only say what would be dropped.")
def prune(db_path, gpu, dtype, head_dim, mask_variant, stale, dry_run) -> None:
    """Drop stale entries (another Triton version, or kernels that have changed since), or every matching entry;
    and invalid rows.

    Example:

        fatune db prune --dry-run
    """
    from fatune.db import is_stale

    with _open(db_path, readonly=dry_run, create=False) as database:
        filters = {"gpu": gpu, "dtype": dtype, "head_dim": head_dim, "mask_variant": mask_variant}
        entries = [e for e in database.entries(on_invalid=lambda message: None, **filters)
                   if not stale or is_stale(e)]
        invalid = database.invalid_rows(**filters)
        count = len(entries) if dry_run else database.delete(entries)
        dropped = len(invalid) if dry_run else database.delete_rows(invalid)
    click.echo(f"{'would drop' if dry_run else 'dropped'} {count} entries"
               + (f" and {dropped} invalid rows" if invalid else ""))


@db.command()
@db_option
@filter_options
@click.option("--rounds", type=click.IntRange(1, 50), default=3, show_default=True,
              help="Timings of each config per entry, alternating (their median decides).")
@click.option("--compile-workers", type=click.IntRange(0, 256), default=None,
              help="Processes compiling the next entries' kernels while one is timed (default: CPU cores - 1, "
                   "at most 16).")
@click.option("--interpret", is_flag=True, help="Run in Triton's interpreter on the CPU (timings not meaningful).")
@click.option("--group", "group_size", type=click.IntRange(1, 65536), default=None,
              help="Only entries of this GQA group (query heads per K/V head; 1: no GQA).")
@click.option("--include-current", "current_too", is_flag=True,
              help="Current entries too: re-time them beside today's heuristic (after a heuristic change).")
@click.option("--adopt", is_flag=True,
              help="Entries tuned on other GPUs too: each is re-timed here and written as this GPU's entry (torch's "
                   "SDPA backends timed here too), in its row's place. Seeds a DB for a new GPU from another's.")
@click.option("--dry-run", is_flag=True, help="Only say which entries would be timed, on which problem.")
def refresh(db_path, gpu, dtype, head_dim, mask_variant, rounds, compile_workers, interpret, group_size, current_too,
            adopt, dry_run) -> None:
    """Re-time stale entries with today's kernels instead of searching again.

    An entry tuned on this GPU whose kernels have changed since (or whose Triton version differs)
    has its stored configs timed again beside the heuristic's, on the problem it was measured on
    (key padding and packed documents at `fatune search`'s defaults), both checked against torch;
    the faster takes its place under today's versions, unless a current entry of that key is
    already there. Entries of other GPUs are left alone. To find new configs, run `fatune search`.
    With --include-current, current entries are re-timed too, beside today's heuristic (after it changed).
    With --adopt, entries tuned on other GPUs are re-timed on this one and replaced by this GPU's entries
    (routes to torch's SDPA backends decided by this GPU's timings): a copy of one GPU's DB becomes
    another's. A run that had entries to re-time and re-timed none of them (each tuned on another GPU, or
    failed) exits 1.

    Example:

        fatune db refresh --db tuned_db/nvidia-h200.sqlite

        fatune db refresh --include-current --group 8 --mask causal

        cp tuned_db/nvidia-h200.sqlite tuned_db/nvidia-h100.sqlite

        fatune db refresh --db tuned_db/nvidia-h100.sqlite --adopt    # on the H100
    """
    import os

    if interpret and not dry_run:  # a dry run times nothing
        with _open(db_path, readonly=False, create=False):  # a DB that cannot be used fails before the restart
            pass
        reexec_interpreted(click.get_current_context())
    from fatune.tuning.refresh import none_refreshed, refresh_db
    from fatune.tuning.target import Target

    try:
        target = Target.detect(interpret)
    except RuntimeError as error:
        if not dry_run:
            raise click.ClickException(str(error)) from None
        target = None  # a dry run without a GPU: every stale entry is listed
    if compile_workers is None:
        compile_workers = min(16, max(0, (os.cpu_count() or 1) - 1))
    counts: dict[str, int] = {}
    results = []
    with _open(db_path, readonly=dry_run, create=False) as database:
        for result in refresh_db(database, target, rounds=rounds, dry_run=dry_run, compile_workers=compile_workers,
                                 on_invalid=lambda message: click.echo(f"warning: {message}", err=True),
                                 current_too=current_too, adopt=adopt, gpu=gpu, dtype=dtype, head_dim=head_dim,
                                 mask_variant=mask_variant, group_size=group_size):
            outcome = result.outcome.split(":")[0]
            counts[outcome] = counts.get(outcome, 0) + 1
            results.append(result)
            click.echo(result.describe())
    click.echo(", ".join(f"{count} {outcome}" for outcome, count in sorted(counts.items())) or "no entries")
    failure = "" if dry_run else none_refreshed(results, current_too, adopt)
    if failure:  # the stale entries are all still stale: not a success
        raise click.ClickException(failure)


@db.command()
@db_option
@click.option("--head-dim", type=click.IntRange(1, 256), required=True)
@click.option("--head-dim-v", type=click.IntRange(0, 256), default=0, help="Value head dim (default, or 0: --head-dim).")
@click.option("--dtype", default="bf16", show_default=True, callback=parse_dtype)
@click.option("--seqlen", type=click.IntRange(1, MAX_LENGTH), required=True,
              help="Query length (and key length unless --seqlen-k).")
@click.option("--seqlen-k", type=click.IntRange(0, MAX_LENGTH), default=0)
@click.option("--batch", type=click.IntRange(1, 1 << 20), default=1, show_default=True,
              help="Sequences (decode calls: the heuristic's pipeline depth follows the programs per multiprocessor).")
@click.option("--sms", type=click.IntRange(1, 1 << 16), default=None,
              help="Multiprocessors of the GPU (default: this machine's GPU's, unless --gpu or --capability names "
                   "another; then one program per multiprocessor is assumed for decode calls).")
@click.option("--heads", type=click.IntRange(1, 65536), default=16, show_default=True)
@click.option("--kv-heads", type=click.IntRange(0, 65536), default=0, help="Key/value heads (default, or 0: --heads).")
@click.option("--causal", is_flag=True)
@click.option("--window", type=click.IntRange(-1), default=-1, help="Causal sliding window (left size).")
@click.option("--gpu", default=None, help="GPU name (default: this machine's GPU).")
@click.option("--capability", default=None, callback=parse_capability, help="Compute capability of --gpu, e.g. 9.0.")
def which(db_path, head_dim, head_dim_v, dtype, seqlen, seqlen_k, batch, sms, heads, kv_heads, causal, window, gpu,
          capability) -> None:
    """Say which tuned entry (or heuristic) fatune.attention would use for a call, and why.

    A DB that cannot be used is listed as skipped, as fatune.attention would skip it.

    Example:

        fatune db which --head-dim 64 --dtype bf16 --seqlen 4096 --causal
    """
    import torch

    from fatune.call import check_inputs
    from fatune.db import check_readable
    from fatune.hardware import device_arch, device_identity, sm_count
    from fatune.kernel.spec import DTYPES
    from fatune.kernel.family import family
    from fatune.runtime.dispatch import Dispatcher
    from fatune.tuning.shape import Shape

    if heads % (kv_heads or heads):
        raise click.BadParameter(f"expected a divisor of --heads {heads}, got {kv_heads}", param_hint="--kv-heads")
    if db_path is not None:
        check_readable(db_path)  # a DB named on the command line must exist
    shape = Shape(batch=batch, heads=heads, seqlen_q=seqlen, seqlen_k=seqlen_k or seqlen, head_dim=head_dim,
                  dtype=dtype, causal=causal or window >= 0, kv_heads=kv_heads or heads, head_dim_v=head_dim_v,
                  window=window)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name, cap = device_identity(device)
    arch = device_arch(device)
    if gpu:
        name = gpu
    if capability:
        cap, arch = f"{capability[0]}.{capability[1]}", capability
    # one-row stand-ins expanded by strides: the call's sizes without its memory
    element = DTYPES[shape.dtype]
    try:
        q, k, v = (torch.empty(1, h, 1, d, dtype=element).expand(batch, h, length, d)
                   for h, length, d in ((shape.heads, shape.seqlen_q, head_dim),
                                        (shape.kv_heads, shape.seqlen_k, head_dim),
                                        (shape.kv_heads, shape.seqlen_k, shape.head_dim_v)))
        problem = check_inputs(q, k, v, **shape.attention_kwargs("cpu"))
    except (RuntimeError, ValueError) as error:
        raise click.UsageError(f"no such call: {error}") from None
    if sms is None and not (gpu or capability):
        sms = sm_count(device)  # this machine's GPU (the interpreter's 4 without one)
    decision = Dispatcher(user_db=db_path).lookup(problem, name, cap, arch, sms)
    click.echo(f"call: {shape.label()} on {name} (sm {cap})")
    click.echo(decision.describe())
    for kind in ("fwd", "bwd"):
        click.echo(f"source ({kind}): {family(decision.config.family).source_path(kind, problem.spec, decision.config)}")
