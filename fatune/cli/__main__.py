"""`python -m fatune.cli`: the `fatune` command (what `fatune search --interpret` re-executes)."""

from fatune.cli import cli

cli(prog_name="fatune")
