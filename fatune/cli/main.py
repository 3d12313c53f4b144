"""The `fatune` command group; each subcommand lives in its own module.

User errors never end in a traceback: bad values are click usage errors (exit 2), failures
such as an unusable tuned DB are one line on stderr (exit 1), Ctrl-C is one line (exit 130).
"""

from __future__ import annotations

import click

from fatune import __version__
from fatune.cli.bench import bench
from fatune.cli.codegen import codegen
from fatune.cli.db import db
from fatune.cli.options import ARGV
from fatune.cli.search import search


class FatuneGroup(click.Group):
    """A click group that turns a tuned-DB or file-system error escaping a command into one line, and keeps the
    command line's arguments for a command that starts itself again (options.reexec_interpreted)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta[ARGV] = list(args)
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context):
        from fatune.db import DBError

        try:
            return super().invoke(ctx)
        except DBError as error:
            raise click.ClickException(str(error)) from None
        except OSError as error:
            where = f"{error.filename}: " if error.filename else ""
            raise click.ClickException(f"{where}{error.strerror or error}") from None


@click.group(cls=FatuneGroup)
@click.version_option(__version__, prog_name="fatune")
def cli() -> None:
    """fatune: generated, autotuned FlashAttention kernels for PyTorch on NVIDIA GPUs."""


cli.add_command(codegen)
cli.add_command(bench)
cli.add_command(search)
cli.add_command(db)
