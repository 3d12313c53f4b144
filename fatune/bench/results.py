"""What every suite of `fatune bench` writes, in one schema, and the one plot style they share.

A run writes into its output folder (`-o/--output DIR`):

- `results.json`: `{"suite": NAME, "environment": {...}, "summary": {...}, "rows": [{...}, ...]}`. The
  environment names the GPU (or Triton's interpreter), its compute capability, the torch, Triton, CUDA,
  cuDNN, Python and fatune versions, the date (UTC) and the command line; the rows are flat dicts of
  numbers and strings (one per measured case and implementation; the keys are the suite's).
- `results.csv`: the same rows, one column per key (the union of the rows' keys, in first-seen order).
- `bench.md`: the environment line and the suite's markdown tables.
- `bench.png`: where the suite plots (`plot`), when matplotlib is installed (`pip install 'fatune[plot]'`);
  without it the plot is skipped without an error.
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import platform
import shlex
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import triton

import fatune
from fatune.hardware import device_identity

SCHEMA_FILES = ("results.json", "results.csv", "bench.md")
PLOT_FILE = "bench.png"


@dataclass
class PlotSpec:
    """How a suite's rows become one figure: a panel per value of `panel` (row keys), a line per value of `line`,
    `y` against `x` (rows missing either, or with an error, are left out)."""

    x: str
    y: str
    panel: tuple[str, ...] = ()
    line: str = "impl"
    xlabel: str = ""
    ylabel: str = ""
    xlog: bool = True


@dataclass
class Report:
    """A suite's result: rows in the common schema, its markdown, a short text for the terminal, a plot."""

    suite: str
    rows: list[dict]
    markdown: str
    summary: dict = field(default_factory=dict)
    echo: str = ""  # printed after the run (default: the markdown)
    plot: PlotSpec | None = None


def command_line(argv: Sequence[str] | None = None) -> str:
    """`fatune bench ...` as it was typed (the arguments click parsed, or sys.argv)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join(["fatune", *args])


def environment(argv: Sequence[str] | None = None, device: torch.device | str | None = None) -> dict:
    """GPU, versions, date and command line for the record (`device`: where the suite ran; default the
    current CUDA device if any, else Triton's interpreter)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu, capability = device_identity(device)
    return {
        "gpu": gpu,
        "capability": capability,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": platform.python_version(),
        "fatune": fatune.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command_line(argv),
    }


def environment_line(env: dict) -> str:
    """One line of markdown naming where and when the numbers were taken."""
    where = f"GPU {env['gpu']} (sm {env['capability']})" if env["capability"] != "cpu" else \
        "Triton's interpreter on the CPU (wall-clock timings: not meaningful)"
    return (f"{where}, torch {env['torch']}, Triton {env['triton']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}, "
            f"{env['date']}; `{env['command']}`")


def _plain(value: Any) -> Any:
    """A JSON-safe scalar: NaN and infinities become None (JSON has no such numbers); tuples become lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def columns(rows: Iterable[dict]) -> list[str]:
    """Every key of the rows, in the order they first appear."""
    return list(dict.fromkeys(key for row in rows for key in row))


def write_json(path: Path, report: Report, env: dict) -> None:
    data = {"suite": report.suite, "environment": env, "summary": _plain(report.summary),
            "rows": [_plain(row) for row in report.rows]}
    path.write_text(json.dumps(data, indent=1) + "\n")


def write_csv(path: Path, rows: list[dict]) -> None:
    """The rows as CSV; a nested value (a list or a dict) as its JSON text, None and NaN as empty cells."""
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns(rows))
        writer.writeheader()
        for row in rows:
            plain = _plain(row)
            writer.writerow({key: json.dumps(value) if isinstance(value, (list, dict)) else
                             "" if value is None else value for key, value in plain.items()})


def read_results(folder: Path) -> dict:
    """A run's results.json."""
    return json.loads((Path(folder) / "results.json").read_text())


def write(folder: Path, report: Report, env: dict) -> list[Path]:
    """results.json, results.csv, bench.md (and bench.png where the suite plots and matplotlib is there)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "results.json", report, env)
    write_csv(folder / "results.csv", report.rows)
    (folder / "bench.md").write_text(f"{environment_line(env)}\n\n{report.markdown}\n")
    written = [folder / name for name in SCHEMA_FILES]
    if report.plot is not None and plot(report.rows, folder / PLOT_FILE, report.plot, title=report.suite):
        written.append(folder / PLOT_FILE)
    return written


Cell = Callable[[dict], str]


def fmt(key: str, spec: str = ".3f", missing: str = "n/a") -> Cell:
    """A cell that formats row[key] with `spec` ('n/a' when absent, None or NaN)."""
    def cell(row: dict) -> str:
        value = row.get(key)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return missing
        return format(value, spec)
    return cell


def markdown_table(rows: Iterable[dict], cells: Sequence[tuple[str, Cell | str]]) -> str:
    """A markdown table: one line per row, one column per (header, cell); a cell is a function of the row or
    a key whose value is shown as it is."""
    header = [name for name, _ in cells]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        values = [cell(row) if callable(cell) else str(row.get(cell, "")) for _, cell in cells]
        lines.append("| " + " | ".join(values) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, spec: PlotSpec, title: str = "") -> bool:
    """The one plot style of every suite: `spec.y` against `spec.x`, a line per implementation (markers on
    the measured points), a panel per `spec.panel` value, a log2 x axis. False (nothing written) when
    matplotlib is not installed or no row has both numbers."""
    usable = [row for row in rows if not row.get("error") and isinstance(row.get(spec.x), (int, float))
              and isinstance(row.get(spec.y), (int, float)) and math.isfinite(row[spec.y])]
    if not usable:
        return False
    # a panel per value of the panel keys that vary; those the same in every row go into the figure's title
    varying = [name for name in spec.panel if len({str(row.get(name)) for row in usable}) > 1]
    constant = [f"{name}={usable[0].get(name)}" for name in spec.panel if name not in varying]
    panels: dict[tuple, dict[str, list[tuple[float, float]]]] = {}
    for row in usable:
        key = tuple(row.get(name) for name in varying)
        panels.setdefault(key, {}).setdefault(str(row.get(spec.line, "")), []).append((row[spec.x], row[spec.y]))
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    count = len(panels)
    width = min(count, 4)
    height = math.ceil(count / width)
    fig, axes = plt.subplots(height, width, figsize=(5 * width, 4 * height), squeeze=False)
    for axis, (key, lines) in zip(axes.flat, sorted(panels.items(), key=lambda item: str(item[0]))):
        for name, points in sorted(lines.items()):
            points.sort()
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        if spec.xlog:
            axis.set_xscale("log", base=2)
        axis.set_title(" ".join(f"{name}={value}" for name, value in zip(varying, key)), fontsize=9)
        axis.set_xlabel(spec.xlabel or spec.x)
        axis.set_ylabel(spec.ylabel or spec.y)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    for axis in list(axes.flat)[count:]:
        axis.set_visible(False)
    if title or constant:
        fig.suptitle(" ".join([title, *constant]).strip(), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
