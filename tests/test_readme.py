"""README.md's two commands are the ones CI runs."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _ci_commands() -> list[str]:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    return [line for line in lines if line and not line.startswith(("#", "set ", "cd "))]


def test_ci_runs_exactly_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    commands = _ci_commands()
    assert len(commands) == 2, commands
    for command in commands:
        assert command in readme, f"README.md does not give the command CI runs: {command}"
