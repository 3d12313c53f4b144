"""The `fatune` command group; each subcommand lives in its own module."""

from __future__ import annotations

import click

from fatune import __version__
from fatune.cli.bench import bench
from fatune.cli.codegen import codegen
from fatune.cli.db import db
from fatune.cli.search import search


@click.group()
@click.version_option(__version__, prog_name="fatune")
def cli() -> None:
    """fatune: generated, autotuned FlashAttention kernels for PyTorch on NVIDIA GPUs."""


cli.add_command(codegen)
cli.add_command(bench)
cli.add_command(search)
cli.add_command(db)


if __name__ == "__main__":
    cli()
