"""Collects the worst error ratio of each GPU accuracy case, for the record in TESTING.md.

Set FATUNE_GPU_REPORT=path.json to have the session write it (see conftest.py).
"""

from __future__ import annotations

import json
import os

_cases: dict[str, dict[str, float]] = {}


def record(nodeid: str, results) -> None:
    _cases[nodeid] = {f"{r.name} vs {r.baseline}": round(r.ratio, 4) for r in results}


def write() -> None:
    path = os.environ.get("FATUNE_GPU_REPORT")
    if not path or not _cases:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:  # pytest -n: one file per worker process
        path = f"{path}.{worker}"
    worst = max((ratio, nodeid, name) for nodeid, ratios in _cases.items() for name, ratio in ratios.items())
    with open(path, "w") as handle:
        json.dump({"cases": _cases, "worst": {"ratio": worst[0], "case": worst[1], "tensor": worst[2]}}, handle, indent=1)
