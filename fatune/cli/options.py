"""Option groups shared by several commands."""

from __future__ import annotations

import math
import os
import re
import sys
from typing import Callable

import click

from fatune.kernel.spec import (
    STRUCTURE_OWNER,
    LaunchConfig,
    dtype_name,
    misplaced_structure,
)
from fatune.settings import INTERPRET_ENV, interpreting

ARGV = "fatune.argv"  # the key of the command line's arguments in click's ctx.meta (FatuneGroup records them)
# a batch, head count, token count or model dim past int32 sizes no call fatune takes (its kernels' grids and
# offsets are int32); larger ones are usage errors, not overflows inside torch
MAX_SIZE = 2**31 - 1


def finite(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """An option's number, NaN and infinities refused (click's FloatRange lets NaN by)."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"expected a finite number, got {value}")
    return value


def check_shapes(shapes: list) -> None:
    """A usage error naming the first shape fatune.attention would refuse (int32 offsets, say) or torch could not
    size, before any trial or timing allocates its inputs."""
    for shape in shapes:
        try:
            shape.problem
        except (ValueError, RuntimeError, TypeError, OverflowError) as error:
            raise click.UsageError(f"shape {shape.label()}: {error}") from None


def reexec_interpreted(ctx: click.Context) -> None:
    """Start this command again with TRITON_INTERPRET=1 unless it is set, for --interpret: triton.language decides
    between interpreted and compiled kernels when first imported, and compiled ones find no driver without a GPU."""
    if interpreting():
        return
    args = ctx.meta.get(ARGV, sys.argv[1:])
    os.execvpe(sys.executable, [sys.executable, "-m", "fatune.cli", *args], {**os.environ, INTERPRET_ENV: "1"})


def parse_dtype(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Parse fp16 / bf16 / fp32 (or a full name) into the canonical dtype name; None stays None."""
    if value is None:
        return None
    try:
        return dtype_name(value)
    except ValueError as error:
        raise click.BadParameter(str(error)) from None


# each code-structure field's part of a launch config's text (LaunchConfig.parse), in the order it takes them
STRUCTURE_FLAGS = {"num_splits": "/kSPLITS", "pack_gqa": "/g", "tma": "/t", "atomic_dq": "/a|/a2", "split_d": "/d2",
                   "concurrent": "/c|/c2"}
CONFIG_EXAMPLES = {"fwd": "128x64/w4/s3", "dkdv": "64x128/w8/s2/a", "dq": "128x64/w8/s3/c"}


def config_form(kernel: str) -> str:
    """The launch-config text `kernel` ('fwd', 'dkdv' or 'dq') takes: the flags of its own structure fields only."""
    flags = "".join(f"[{flag}]" for field, flag in STRUCTURE_FLAGS.items() if kernel in STRUCTURE_OWNER[field])
    return f"BLOCK_MxBLOCK_N[/wWARPS][/sSTAGES]{flags}[/rREGS]"


def _launch_config(ctx: click.Context, param: click.Parameter, value: str | None) -> LaunchConfig | None:
    """Parse --fwd / --dkdv / --dq into a LaunchConfig; a value its kernel cannot take (a bad tile size, another
    kernel's structure flag such as --fwd 64x64/a) is a usage error, not a failure when the configs are combined."""
    if value is None:
        return None
    kernel = param.name.removesuffix("_config")
    expected = f"the {kernel} kernel takes {config_form(kernel)}, e.g. {CONFIG_EXAMPLES[kernel]}"
    try:
        config = LaunchConfig.parse(value)
    except (ValueError, TypeError) as error:
        raise click.BadParameter(f"{error}; {expected}") from None
    misplaced = misplaced_structure(kernel, config)
    if misplaced:
        owners = "; ".join(f"{STRUCTURE_FLAGS[field]} ({field}) belongs to "
                           f"{' or '.join(f'--{owner}' for owner in STRUCTURE_OWNER[field])}" for field in misplaced)
        raise click.BadParameter(f"{owners}, got {value!r}; {expected}")
    return config


def kernel_spec_options(fn: Callable) -> Callable:
    """--head-dim, --head-dim-v, --dtype, --causal: what the kernel computes."""
    fn = click.option("--causal/--no-causal", default=False, show_default=True, help="Causal mask (top-left aligned).")(fn)
    fn = click.option("--dtype", default="bf16", show_default=True, callback=parse_dtype,
                      help="fp16, bf16 or fp32.")(fn)
    fn = click.option("--head-dim-v", type=click.IntRange(0, 256), default=0,
                      help="Head dim of value/output (default, or 0: same as --head-dim).")(fn)
    fn = click.option("--head-dim", type=click.IntRange(1, 256), required=True, help="Head dim of query/key.")(fn)
    return fn


def launch_config_options(fn: Callable) -> Callable:
    """--fwd, --dkdv, --dq: per-kernel launch configs as BLOCK_MxBLOCK_N/wWARPS/sSTAGES."""
    for kernel in ("dq", "dkdv", "fwd"):
        fn = click.option(f"--{kernel}", f"{kernel}_config", callback=_launch_config, metavar="MxN/wW/sS",
                          help=f"Launch config of the {kernel} kernel, e.g. 128x64/w4/s3 (default: heuristic).")(fn)
    return fn


MAX_LENGTH = 2**31 - 1  # sequence lengths are int32 in the kernels


def _ints(value: str, allow_empty: bool) -> list[int]:
    try:
        numbers = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        numbers = []
    if not (numbers or allow_empty and not value.strip()) or any(not 1 <= n <= MAX_LENGTH for n in numbers):
        raise click.BadParameter(f"expected comma-separated positive integers such as 64,128, got {value!r}")
    return numbers


def int_list(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    """Parse '64,128' into [64, 128]: at least one number, each positive."""
    return _ints(value, allow_empty=False)


def optional_int_list(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    """int_list, where '' (the option's default) means none given."""
    return _ints(value, allow_empty=True)


def name_list(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
    """Parse 'a,b' into ['a', 'b']."""
    return [part.strip() for part in value.split(",") if part.strip()]


def parse_capability(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, int] | None:
    """Parse a compute capability 'MAJOR.MINOR' such as 9.0 into (9, 0)."""
    if value is None:
        return None
    match = re.fullmatch(r"\s*(\d{1,3})\.(\d{1,3})\s*", value)
    if not match:
        raise click.BadParameter(f"expected MAJOR.MINOR such as 9.0, got {value!r}")
    return int(match.group(1)), int(match.group(2))


def mask_variant_options(fn: Callable) -> Callable:
    """--window, --valid-keys and --documents: the sizes of the window, padding and packed mask variants (--mask)."""
    fn = click.option("--documents", type=click.IntRange(1), default=5, show_default=True,
                      help="Documents of unequal lengths per shape for --mask packed (query and key lengths "
                           "equal).")(fn)
    fn = click.option("--valid-keys", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.25,
                      callback=finite, show_default=True,
                      help="Fraction of keys kept per sequence for --mask padding (0 < f < 1).")(fn)
    fn = click.option("--window", type=click.IntRange(0), default=256, show_default=True,
                      help="Left window size for --mask window.")(fn)
    return fn


def apply_mask(shapes: list, mask: str, window: int, valid_keys: float, documents: int = 0) -> list:
    """The shapes with --mask window (a causal sliding window of `window` keys), padding (each sequence
    keeps `valid_keys` of its keys) or packed (the tokens packed as `documents` documents) applied;
    shapes that become equal are listed once."""
    if mask == "window":
        shapes = [s.with_(causal=True, window=window) for s in shapes]
    elif mask == "padding":
        shapes = [s.with_(valid_keys=valid_keys) for s in shapes]
    elif mask == "packed":
        try:
            shapes = [s.with_(documents=documents) for s in shapes]
        except ValueError as error:
            raise click.BadParameter(str(error), param_hint="--documents") from None
        shapes = _distinct_packs(shapes)
    return list(dict.fromkeys(shapes))


def _distinct_packs(shapes: list) -> list:
    """Packed shapes whose batch x length gives the same tokens pack the same documents (and get the same
    DB key, the longest document): the first of each is kept, and the user is told."""
    kept: dict = {}
    for shape in shapes:
        key = (shape.tokens, *(getattr(shape, field) for field in ("heads", "kv_heads", "head_dim", "head_dim_v",
                                                                   "dtype", "causal", "documents")))
        if key in kept and kept[key] != shape:
            click.echo(f"--mask packed: L={shape.seqlen_q} packs the same {shape.tokens} tokens into the same "
                       f"documents as L={kept[key].seqlen_q}: run once (search's --batch, bench's --tokens set the "
                       "tokens)", err=True)
        kept.setdefault(key, shape)
    return list(kept.values())
