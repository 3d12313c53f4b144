"""What the resumable search suites share (search-quality, tuning-gain): a state file each run extends, runs
of other machines merged into it, and a search of one shape in a fresh Optuna storage.

Their measurements take hours on a GPU, so each run does one part (`--part`) for some shapes (`--shapes`) and
adds what it measured to `state.json` in the output folder; a part already stored for a shape is not run again.
Runs made apart (one per GPU, say) are joined with `--merge OTHER_DIR`: nested dicts are united, and a value
present in both keeps this folder's.
"""

from __future__ import annotations

import contextlib
import json
import math
import tempfile
from collections.abc import Iterator
from pathlib import Path

import optuna

from fatune.tuning import search
from fatune.tuning.precompile import CompilePool
from fatune.tuning.shape import Shape
from fatune.tuning.space import default_space
from fatune.tuning.storage import open_storage

STATE = "state.json"


def load(folder: Path) -> dict:
    """The state in `folder` ({} if none); ValueError naming the file where it is not a state file: a JSON object
    of objects (a folder given to --merge may come from another machine)."""
    path = Path(folder) / STATE
    if not path.exists():
        return {}
    if not path.is_file():  # a FIFO would block the read forever
        raise ValueError(f"{path}: not a regular file")
    try:
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"{path}: not a state file ({error})") from None
    if not isinstance(state, dict) or not all(isinstance(value, dict) for value in state.values()):
        raise ValueError(f"{path}: not a state file (expected a JSON object of objects)")
    return state


def save(folder: Path, state: dict) -> None:
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / STATE).write_text(json.dumps(state, indent=1))


def merge(into: dict, other: dict) -> dict:
    """`other` united into `into` (nested dicts merged; a value present in both keeps `into`'s)."""
    for key, value in other.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into.setdefault(key, value)
    return into


def pick(cases: list, indices: list[int] | None) -> list:
    """The cases at `indices` (all when None or empty)."""
    if not indices:
        return list(cases)
    if any(not 0 <= i < len(cases) for i in indices):
        raise ValueError(f"--shapes: expected indices 0..{len(cases) - 1}, got {','.join(map(str, indices))}")
    return [cases[i] for i in indices]


def compile_pool(target: search.Target, workers: int) -> CompilePool:
    """The compile pool for searches and grids (none in the interpreter, which compiles nothing)."""
    return CompilePool(0 if target.interpret else workers, target.device.type)


@contextlib.contextmanager
def fresh_search(shape: Shape, target: search.Target, trials: int, seed: int, pool: CompilePool | None
                 ) -> Iterator[tuple[search.ShapeResult, optuna.storages.RDBStorage]]:
    """`fatune.tuning.search.search_shape` of `shape` in a new storage (no earlier trials), and that storage."""
    with tempfile.TemporaryDirectory() as scratch:
        storage = open_storage(f"sqlite:///{scratch}/study.sqlite")
        result = search.search_shape(shape, target, trials=trials, seconds=math.inf, storage=storage, seed=seed,
                                     space=default_space(target), pool=pool if pool and pool.processes else None)
        yield result, storage
