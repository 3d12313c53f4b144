"""The `fatune` command line: a thin click layer over the library modules."""

from fatune.cli.main import cli

__all__ = ["cli"]
