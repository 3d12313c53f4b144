"""Merge the JSON results files of resumable benchmark runs (search_quality.py, tuning_gain.py) that
ran in parallel, e.g. one per GPU: nested dicts are united, a value present in both keeps the first.

    python benchmarks/merge_results.py OUT.json IN.json [IN.json ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import resumable


def merge(into: dict, other: dict) -> dict:
    for key, value in other.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into.setdefault(key, value)
    return into


def main(out: str, *inputs: str) -> None:
    merged: dict = {}
    for path in inputs:
        merge(merged, resumable.load(Path(path)))
    resumable.save(Path(out), merged)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
