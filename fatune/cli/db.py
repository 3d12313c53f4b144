"""`fatune db`: inspect, export, import and prune tuned databases; ask which entry a call would use."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import click


def db_option(fn: Callable) -> Callable:
    return click.option("--db", "db_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
                        help="Tuned DB file (default: $FATUNE_DB or ~/.cache/fatune/tuned.sqlite).")(fn)


def filter_options(fn: Callable) -> Callable:
    """--gpu, --dtype, --head-dim, --mask: narrow the entries a command works on."""
    fn = click.option("--mask", "mask_variant", default=None, help="Mask variant, e.g. causal.")(fn)
    fn = click.option("--head-dim", type=int, default=None, help="Query/key head dim.")(fn)
    fn = click.option("--dtype", default=None, help="fp16, bf16 or fp32.")(fn)
    fn = click.option("--gpu", default=None, help="GPU name as recorded, e.g. 'NVIDIA H200'.")(fn)
    return fn


def _filters(gpu, dtype, head_dim, mask_variant) -> dict:
    from fatune.spec import dtype_name

    try:
        dtype = dtype_name(dtype) if dtype else None
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--dtype") from None
    return {"gpu": gpu, "dtype": dtype, "head_dim": head_dim, "mask_variant": mask_variant}


def _open(db_path: Path | None, readonly: bool = True):
    from fatune.db import DBError, TunedDB, default_path

    path = db_path or default_path()
    try:
        return TunedDB(path, readonly=readonly)
    except DBError as error:
        raise click.ClickException(str(error)) from None


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
    with _open(db_path) as database:
        entries = list(database.entries(**_filters(gpu, dtype, head_dim, mask_variant)))
    if as_json:
        click.echo(json.dumps([asdict(entry) for entry in entries], indent=1))
        return
    click.echo(f"{'gpu':14} {'dtype':9} {'d':>4} {'mask':18} {'g':>2} {'Lq<=':>6} {'Lk<=':>6} {'f+b ms':>8} "
               f"{'TFLOP/s':>8} {'speedup':>8} {'trials':>6}  stale")
    from fatune.db import is_stale

    for e in entries:
        stale = "; ".join(is_stale(e))
        click.echo(f"{e.gpu[:14]:14} {e.dtype:9} {e.head_dim:4d} {e.mask_variant[:18]:18} {e.group_size:2d} "
                   f"{e.seqlen_q_bucket:6d} {e.seqlen_k_bucket:6d} {e.fwd_bwd_ms:8.3f} {e.tflops:8.1f} "
                   f"{e.speedup:8.2f} {e.trials:6d}  {stale}{' (interpreter)' if e.interpreted else ''}")
    click.echo(f"{len(entries)} entries")


@db.command()
@db_option
@filter_options
def show(db_path, gpu, dtype, head_dim, mask_variant) -> None:
    """Show every field of the matching entries (configs, times, versions) as JSON.

    Example:

        fatune db show --head-dim 64 --mask causal
    """
    with _open(db_path) as database:
        entries = list(database.entries(**_filters(gpu, dtype, head_dim, mask_variant)))
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

    with _open(db_path) as database:
        entries = list(database.entries(**_filters(gpu, dtype, head_dim, mask_variant)))
    try:
        count = export_entries(entries, output)
    except DBError as error:
        raise click.ClickException(str(error)) from None
    click.echo(f"exported {count} entries to {output}")


@db.command("import")
@db_option
@click.argument("source", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Import entries tuned with another Triton version or template hash.")
def import_db(db_path, source, force) -> None:
    """Merge SOURCE (tuned DB or its JSON export) into the DB, keeping the faster entry per key.

    A corrupt, foreign or stale file is refused and the DB is left untouched.

    Example:

        fatune db import h200-bf16.sqlite
    """
    from fatune.db import DBError, import_entries

    with _open(db_path, readonly=False) as database:
        try:
            written, kept = import_entries(database, source, force=force)
        except DBError as error:
            raise click.ClickException(str(error)) from None
    click.echo(f"imported {written} entries from {source}; {kept} were slower than entries already there")


@db.command()
@db_option
@filter_options
@click.option("--stale/--all", default=True, show_default=True,
              help="Drop only entries tuned with another Triton version or template hash, or every match.")
@click.option("--dry-run", is_flag=True, help="Only say what would be dropped.")
def prune(db_path, gpu, dtype, head_dim, mask_variant, stale, dry_run) -> None:
    """Drop stale entries (another Triton version or template hash), or every matching entry.

    Example:

        fatune db prune --dry-run
    """
    from fatune.db import is_stale

    with _open(db_path, readonly=dry_run) as database:
        entries = [e for e in database.entries(**_filters(gpu, dtype, head_dim, mask_variant))
                   if not stale or is_stale(e)]
        count = len(entries) if dry_run else database.delete(entries)
    click.echo(f"{'would drop' if dry_run else 'dropped'} {count} entries")


@db.command()
@db_option
@click.option("--head-dim", type=click.IntRange(1, 256), required=True)
@click.option("--head-dim-v", type=int, default=0)
@click.option("--dtype", default="bf16", show_default=True)
@click.option("--seqlen", type=int, required=True, help="Query length (and key length unless --seqlen-k).")
@click.option("--seqlen-k", type=int, default=0)
@click.option("--heads", type=int, default=16, show_default=True)
@click.option("--kv-heads", type=int, default=0)
@click.option("--causal", is_flag=True)
@click.option("--window", type=int, default=-1, help="Causal sliding window (left size).")
@click.option("--gpu", default=None, help="GPU name (default: this machine's GPU).")
@click.option("--capability", default=None, help="Compute capability of --gpu, e.g. 9.0.")
def which(db_path, head_dim, head_dim_v, dtype, seqlen, seqlen_k, heads, kv_heads, causal, window, gpu,
          capability) -> None:
    """Say which tuned entry (or heuristic) fatune.attention would use for a call, and why.

    Example:

        fatune db which --head-dim 64 --dtype bf16 --seqlen 4096 --causal
    """
    import torch

    from fatune.dispatch import Dispatcher, device_arch, device_identity
    from fatune.measure import Shape
    from fatune.spec import DTYPES, dtype_name

    shape = Shape(batch=1, heads=heads, seqlen_q=seqlen, seqlen_k=seqlen_k or seqlen, head_dim=head_dim,
                  dtype=dtype_name(dtype), causal=causal or window >= 0, kv_heads=kv_heads or heads,
                  head_dim_v=head_dim_v, window=window)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name, cap = device_identity(device)
    if gpu:
        name, cap = gpu, capability or cap
    arch = tuple(int(x) for x in cap.split(".")) if cap != "cpu" else device_arch(device)
    from fatune.inputs import check_inputs

    element = DTYPES[shape.dtype]
    q = torch.empty(1, shape.heads, shape.seqlen_q, head_dim, dtype=element, device="meta")
    k = torch.empty(1, shape.kv_heads, shape.seqlen_k, head_dim, dtype=element, device="meta")
    v = torch.empty(1, shape.kv_heads, shape.seqlen_k, shape.head_dim_v, dtype=element, device="meta")
    problem = check_inputs(q, k, v, **shape.attention_kwargs("meta"))
    dispatcher = Dispatcher(user_db=db_path) if db_path else Dispatcher()
    decision = dispatcher.lookup(problem, name, cap, arch)
    click.echo(f"call: {shape.label()} on {name} (sm {cap})")
    click.echo(decision.describe())
    from fatune import codegen

    for kind in ("fwd", "bwd"):
        click.echo(f"source ({kind}): {codegen.source_path(kind, problem.spec, decision.config)}")
