"""How many trials a search needed: from finished searches' Optuna storage, no GPU (issue 14).

    python benchmarks/trial_budget.py [STORAGE] [--trials 1,2,3,4,8,16] [--since 2026-12-01] [--json OUT.json]

For every study of `fatune search` in STORAGE (default: the shipped H200 DB's,
benchmarks/results/ship-db-h200-optuna.sqlite) with at least 10 finished trials, the best time
among its first k trials (trial numbers 0 .. k-1: the heuristic's config, then the warm starts
from related tuned shapes, then TPE) as a fraction of the study's best; per dtype and kernel,
the median, mean and worst fraction and the share of studies within 1% and 2%. Pruned trials
count as trials (their quick timing was too far behind to win) but carry no time. A study counts
at budget k only if it ran more than k trials (at its own total the fraction is 1 by definition).
--since keeps the studies whose first trial started on or after that day (today's search, not
older studies of since-changed search code that share the storage).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from collections import defaultdict
from pathlib import Path

import optuna

DEFAULT_STORAGE = Path(__file__).parent / "results" / "ship-db-h200-optuna.sqlite"
MIN_FINISHED = 10


def fractions(study: optuna.Study, budgets: list[int], since: datetime.datetime | None = None
              ) -> dict[int, float] | None:
    """Best-of-first-k over the study's best, per budget k below its trial count; None if it has too few."""
    finished = [t for t in study.trials if t.state in (optuna.trial.TrialState.COMPLETE,
                                                        optuna.trial.TrialState.PRUNED)]
    timed = [t for t in finished if t.state == optuna.trial.TrialState.COMPLETE and t.value is not None]
    if len(finished) < MIN_FINISHED or not timed:
        return None
    first = min(t.datetime_start for t in finished if t.datetime_start is not None)
    if since is not None and first < since:
        return None
    best = min(t.value for t in timed)
    out = {}
    for k in budgets:
        if k < len(finished):
            early = [t.value for t in timed if t.number < k]
            out[k] = best / min(early) if early else 0.0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("storage", nargs="?", default=str(DEFAULT_STORAGE))
    parser.add_argument("--trials", default="1,2,3,4,6,8,12,16,20")
    parser.add_argument("--since", type=datetime.datetime.fromisoformat, help="YYYY-MM-DD: studies begun from then")
    parser.add_argument("--json", help="write the per-study fractions here")
    args = parser.parse_args()
    budgets = [int(x) for x in args.trials.split(",")]
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = args.storage if "://" in args.storage else f"sqlite:///{Path(args.storage).resolve()}"
    storage = optuna.storages.RDBStorage(url)
    per_study: dict[str, dict[int, float]] = {}
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        found = fractions(study, budgets, args.since)
        if found is not None:
            per_study[summary.study_name] = found
    groups: dict[tuple[str, str], list[dict[int, float]]] = defaultdict(list)
    for name, found in per_study.items():
        fields = name.split(":")
        dtype = next((f for f in fields if f in ("bfloat16", "float16", "float32")), "?")
        groups[(dtype, "all")].append(found)
        groups[(dtype, fields[-1])].append(found)
    print("| dtype | kernel | k trials | studies | median | mean | worst | within 1% | within 2% |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (dtype, kernel), rows in sorted(groups.items()):
        for k in budgets:
            values = [row[k] for row in rows if k in row]
            if not values:
                continue
            print(f"| {dtype} | {kernel} | {k} | {len(values)} | {statistics.median(values):.4f} | "
                  f"{statistics.fmean(values):.4f} | {min(values):.4f} | "
                  f"{sum(v >= 0.99 for v in values) / len(values):.0%} | {sum(v >= 0.98 for v in values) / len(values):.0%} |")
    if args.json:
        Path(args.json).write_text(json.dumps(per_study, indent=1))


if __name__ == "__main__":
    main()
