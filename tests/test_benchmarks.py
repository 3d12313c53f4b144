"""The resumable search suites of `fatune bench` (search-quality, tuning-gain) run end to end in Triton's
interpreter: a smoke run of each part on a tiny shape, its state extended rather than redone, and its table."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from fatune.bench.results import SCHEMA_FILES, read_results
from fatune.cli import cli

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="an interpreter smoke run")


def run(suite: str, out: Path, *args: str) -> str:
    """`fatune bench --suite SUITE -o OUT ARGS --interpret`: its standard output (progress lines and tables)."""
    result = CliRunner().invoke(cli, ["bench", "--suite", suite, "-o", str(out), *args, "--interpret"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert all((out / name).exists() for name in SCHEMA_FILES)
    assert read_results(out)["suite"] == suite
    return result.stdout


def state(out: Path) -> dict:
    return json.loads((out / "state.json").read_text())


# 4 trials per kernel, each study's best re-timed after all 4: what a part stores does not depend on how many
SMOKE_SEARCH = ("--trials", "4", "--checkpoints", "4")


def test_search_quality_grid_then_search(tmp_path):
    out = tmp_path / "quality"
    run("search-quality", out, "--part", "grid", "--shapes", "0")
    grid = state(out)
    (entry,) = grid.values()
    assert set(entry["grid"]) == {"fwd", "dkdv", "dq"}
    for kernel in entry["grid"].values():
        assert kernel["valid"] == kernel["configs"] > 1 and kernel["best"] is not None
    table = run("search-quality", out, "--part", "search", "--shapes", "0", "--seeds", "0", *SMOKE_SEARCH)
    (entry,) = state(out).values()
    assert entry["grid"] == next(iter(grid.values()))["grid"], "a part already in the state is not run again"
    for kernel in ("fwd", "dkdv", "dq"):
        assert entry["search"]["0"][kernel]["4"]["config"] is not None
    assert table.count("| float16 b1 h1 lq24 lk24 d16 |") == 3
    rows = read_results(out)["rows"]
    assert {(row["kernel"], row["sampler"], row["trials"]) for row in rows} == {
        (kernel, "tpe", 4) for kernel in ("fwd", "dkdv", "dq")} and all(0 < row["fraction"] for row in rows)
    table = run("search-quality", out, "--part", "retime", "--shapes", "0")
    (entry,) = state(out).values()
    retimed_entry = entry
    for kernel in ("fwd", "dkdv", "dq"):
        retime = entry["retime"][kernel]
        assert entry["grid"][kernel]["best"] in retime and entry["search"]["0"][kernel]["4"]["config"] in retime
        assert all(len(times) == 3 and all(t > 0 for t in times) for times in retime.values())
    assert table.count(" retimed |") == 3
    table = run("search-quality", out, "--part", "search", "--shapes", "0", "--seeds", "0", *SMOKE_SEARCH,
                "--sampler", "random")
    (entry,) = state(out).values()
    assert entry["search"]["0"] == retimed_entry["search"]["0"], "another sampler's searches are kept apart"
    assert all(entry["search-random"]["0"][kernel]["4"]["config"] for kernel in ("fwd", "dkdv", "dq"))
    for sampler in ("tpe", "random"):
        assert table.count(f"| {sampler} | 1 |") == 3, table
    run("search-quality", out, "--part", "retime", "--shapes", "0")
    (entry,) = state(out).values()
    for kernel in ("fwd", "dkdv", "dq"):  # the random search's picks are re-timed with the others
        assert entry["search-random"]["0"][kernel]["4"]["config"] in entry["retime"][kernel]


def test_search_quality_regrids_a_space_that_changed(tmp_path):
    """A grid records the axes it covered: --regrid times again only the grids of a space that changed since
    (here: one whose stored hash differs, as a grid from before an added axis would)."""
    out = tmp_path / "quality"
    run("search-quality", out, "--part", "grid", "--shapes", "0", "--kernels", "fwd,dq")
    results = state(out)
    (entry,) = results.values()
    fwd, dq = entry["grid"]["fwd"], entry["grid"]["dq"]
    assert len(fwd["space"]) == 8
    dq["space"], dq["best_ms"] = "00000000", -1.0  # as if timed over another space
    (out / "state.json").write_text(json.dumps(results))
    run("search-quality", out, "--part", "grid", "--shapes", "0", "--kernels", "fwd,dq", "--regrid")
    (entry,) = state(out).values()
    assert entry["grid"]["fwd"] == fwd, "a grid of the current space is kept"
    assert entry["grid"]["dq"]["best_ms"] > 0 and entry["grid"]["dq"]["space"] != "00000000"


def test_search_quality_table_mixes_no_timing_rounds(tmp_path):
    """A retime that misses a compared config (the grid timed again since) is not used: all first timings; a
    seed with no complete trial by a checkpoint (config None) counts as infinitely slow either way."""
    out = tmp_path / "quality"
    out.mkdir()
    grid = {"configs": 2, "valid": 2, "best": "16x16/w4/s1", "best_ms": 1.0, "heuristic": "32x16/w4/s1",
            "heuristic_ms": 2.0}
    entry = {"grid": {"fwd": grid}, "search": {"0": {"fwd": {"10": {"config": "32x16/w4/s1", "ms": 2.0}}},
                                                 "1": {"fwd": {"10": {"config": None, "ms": float("inf")}}}},
             "retime": {"fwd": {"32x16/w4/s1": [0.5, 0.5, 0.5], "16x32/w4/s1": [0.4, 0.4, 0.4]}}}
    (out / "state.json").write_text(json.dumps({"float16 b1 h2 lq40 lk40 d16": entry}))
    row = next(line for line in run("search-quality", out, "--part", "table").splitlines() if "| fwd |" in line)
    assert row.endswith("| 1.000 (16x16/w4/s1) | 0.500 | 0.250 | – | – | – | first timing |"), row
    entry["retime"]["fwd"]["16x16/w4/s1"] = [1.0, 1.0, 1.0]
    (out / "state.json").write_text(json.dumps({"float16 b1 h2 lq40 lk40 d16": entry}))
    row = next(line for line in run("search-quality", out, "--part", "table").splitlines() if "| fwd |" in line)
    assert row.endswith("| 0.500 (32x16/w4/s1) | 1.000 | 0.500 | – | – | – | retimed |"), row


def test_resumable_runs_merge_into_one_state(tmp_path):
    """--merge unites another run's state (one per GPU, say): nested parts joined, this folder's values kept."""
    first, second = tmp_path / "a", tmp_path / "b"
    for folder, stored in ((first, {"shape": {"search": {"0": 1}}}),
                           (second, {"shape": {"search": {"0": 9, "1": 2}}, "other": {"grid": {}}})):
        folder.mkdir()
        (folder / "state.json").write_text(json.dumps(stored))
    result = CliRunner().invoke(cli, ["bench", "--suite", "search-quality", "--part", "table", "-o", str(first),
                                      "--merge", str(second)])
    assert result.exit_code == 0, result.output
    assert state(first) == {"shape": {"search": {"0": 1, "1": 2}}, "other": {"grid": {}}}


def test_tuning_gain_gain(tmp_path):
    out = tmp_path / "gain"
    table = run("tuning-gain", out, "--part", "gain", "--shapes", "1", "--trials", "3")
    ((label, row),) = state(out)["gain"].items()
    assert row["tuned_ms"] > 0 and row["heuristic_ms"] > 0 and row["tuned"].startswith("fwd ")
    assert f"| gain | {label} |" in table
    rows = read_results(out)["rows"]
    assert [(r["part"], r["shape"], r["config_name"]) for r in rows] == [("gain", label, "heuristic"),
                                                                        ("gain", label, "tuned")]


def test_tuning_gain_nearest(tmp_path):
    out = tmp_path / "nearest"
    table = run("tuning-gain", out, "--part", "nearest", "--trials", "3")
    ((label, row),) = state(out)["nearest"].items()
    assert row["representative_length"] == 64 and row["exact_ms"] > 0 and row["representative_ms"] > 0
    if row["exact"] == row["representative"]:  # one timing for both: the loss is exactly 0
        assert row["exact_ms"] == row["representative_ms"]
    assert f"| nearest | {label} |" in table


def test_tuning_gain_tie_times_both_tied_entries_and_the_heuristic(tmp_path):
    """L = 64 is one octave from a DB's L = 32 entry and from its L = 128 entry: both and the heuristic are timed."""
    from dataclasses import replace

    import triton

    from fatune.db import Entry, TunedDB

    base = Entry(gpu="triton-interpreter", capability="cpu", triton_version=triton.__version__, torch_version="2.13.0",
                 template_hash="0123456789abcdef", dtype="float16", head_dim=16, head_dim_v=16, mask_variant="none",
                 group_size=1, seqlen_q_bucket=32, seqlen_k_bucket=32,
                 fwd_config={"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1},
                 bwd_config={"dkdv": {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1},
                             "dq": {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1}},
                 fwd_ms=1.0, bwd_ms=2.0, fwd_bwd_ms=3.0, tflops=1.0, trials=3)
    upper = replace(base, seqlen_q_bucket=128, seqlen_k_bucket=128, fwd_config={**base.fwd_config, "block_n": 32})
    far = replace(base, seqlen_q_bucket=512, seqlen_k_bucket=512)
    db_path = tmp_path / "tuned.sqlite"
    with TunedDB(db_path) as db:
        for entry in (base, upper, far):
            db.upsert(replace(entry, template_hash=entry.check().kernel_hashes()))
    out = tmp_path / "tie"
    table = run("tuning-gain", out, "--part", "tie", "--db", str(db_path))
    ((label, row),) = state(out)["tie"].items()
    lower, upper = "Lq=32 Lk=32 entry", "Lq=128 Lk=128 entry"
    assert set(row) == {lower, upper, "heuristic"}, "the two nearest entries, not the far one"
    assert row[upper]["config"].startswith("fwd 16x32/") and all(timed["ms"] > 0 for timed in row.values())
    assert row[lower].get("served") and not row[upper].get("served"), "the dispatcher's pick: the faster stored time"
    assert table.count(f"| tie | {label} |") == 3 and table.count("| 1.000x |") >= 1 and f"{lower} (served)" in table
    alone = tmp_path / "alone.sqlite"
    with TunedDB(alone) as db:
        db.upsert(replace(base, template_hash=base.check().kernel_hashes()))
    out = tmp_path / "tie-alone"
    printed = run("tuning-gain", out, "--part", "tie", "--db", str(alone))
    assert "no tie to time" in printed and not (out / "state.json").exists(), \
        "one nearest entry: nothing stored, so nothing skipped later"
