"""What the resumable search benchmarks share (search_quality.py, tuning_gain.py): their command line,
the JSON results file each run extends, and a search of one shape in a fresh Optuna storage.

They run as `python benchmarks/NAME.py` from the repository root (this folder is on sys.path then).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import optuna

from fatune import search
from fatune.measure import Shape
from fatune.precompile import CompilePool


def arguments(doc: str, parts: tuple[str, ...], trials: int, extra=None) -> argparse.Namespace:
    """OUT.json, --part (one of `parts`, or 'table'), --shapes, --trials, --interpret, --compile-workers."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--part", choices=(*parts, "table"), required=True)
    parser.add_argument("--shapes", default="", help="indices into the part's shape list (default: all)")
    parser.add_argument("--trials", type=int, default=trials, help="per kernel")
    parser.add_argument("--interpret", action="store_true", help="Triton's interpreter, tiny shapes (a smoke run)")
    parser.add_argument("--compile-workers", type=int, default=max(1, min(15, (os.cpu_count() or 2) - 1)))
    if extra:
        extra(parser)
    return parser.parse_args()


def load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def save(path: Path, results: dict) -> None:
    path.write_text(json.dumps(results, indent=1))


def pick(cases: list, indices: str) -> list:
    """The cases at the comma-separated `indices` (all when empty)."""
    return [cases[int(i)] for i in indices.split(",")] if indices else cases


def compile_pool(args: argparse.Namespace, target: search.Target) -> CompilePool:
    """The compile pool for searches and grids (none in the interpreter, which compiles nothing)."""
    return CompilePool(0 if args.interpret else args.compile_workers, target.device.type)


@contextlib.contextmanager
def fresh_search(shape: Shape, target: search.Target, trials: int, seed: int, pool: CompilePool | None
                 ) -> Iterator[tuple[search.ShapeResult, optuna.storages.RDBStorage]]:
    """`fatune.search.search_shape` of `shape` in a new storage (no earlier trials), and that storage."""
    space = search.INTERPRETER_SPACE if target.interpret else search.GPU_SPACE
    with tempfile.TemporaryDirectory() as scratch:
        storage = search.open_storage(f"sqlite:///{scratch}/study.sqlite")
        result = search.search_shape(shape, target, trials=trials, seconds=math.inf, storage=storage, seed=seed,
                                     space=space, pool=pool if pool and pool.processes else None)
        yield result, storage
