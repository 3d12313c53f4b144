"""The resumable search benchmarks (issue 14's figures) run end to end in Triton's interpreter: a
smoke run of each part on a tiny shape, its JSON extended rather than redone, and its table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import UNCHECKED_PRELUDE

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="an interpreter smoke run")


# `python SCRIPT ARGS`, with the overflow check off as in conftest.OVERFLOW_CHECKED's policy (it costs about half
# of these smoke runs' interpreted time)
UNCHECKED = UNCHECKED_PRELUDE + """
import runpy, sys
sys.argv = sys.argv[1:]
sys.path.insert(0, sys.argv[0].rsplit("/", 1)[0])
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run(script: str, out: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", UNCHECKED, str(ROOT / "benchmarks" / script), str(out), *args,
                             "--interpret"], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


# 4 trials per kernel, each study's best re-timed after all 4: what a part stores does not depend on how many
SMOKE_SEARCH = ("--trials", "4", "--checkpoints", "4")


def test_search_quality_grid_then_search(tmp_path):
    out = tmp_path / "quality.json"
    run("search_quality.py", out, "--part", "grid", "--shapes", "0")
    grid = json.loads(out.read_text())
    (entry,) = grid.values()
    assert set(entry["grid"]) == {"fwd", "dkdv", "dq"}
    for kernel in entry["grid"].values():
        assert kernel["valid"] == kernel["configs"] > 1 and kernel["best"] is not None
    table = run("search_quality.py", out, "--part", "search", "--shapes", "0", "--seeds", "0", *SMOKE_SEARCH)
    (entry,) = json.loads(out.read_text()).values()
    assert entry["grid"] == next(iter(grid.values()))["grid"], "a part already in the file is not run again"
    for kernel in ("fwd", "dkdv", "dq"):
        assert entry["search"]["0"][kernel]["4"]["config"] is not None
    assert table.count("| float16 b1 h1 lq24 lk24 d16 |") == 3
    table = run("search_quality.py", out, "--part", "retime", "--shapes", "0")
    (entry,) = json.loads(out.read_text()).values()
    retimed_entry = entry
    for kernel in ("fwd", "dkdv", "dq"):
        retime = entry["retime"][kernel]
        assert entry["grid"][kernel]["best"] in retime and entry["search"]["0"][kernel]["4"]["config"] in retime
        assert all(len(times) == 3 and all(t > 0 for t in times) for times in retime.values())
    assert table.count(" retimed |") == 3
    table = run("search_quality.py", out, "--part", "search", "--shapes", "0", "--seeds", "0", *SMOKE_SEARCH,
                "--sampler", "random")
    (entry,) = json.loads(out.read_text()).values()
    assert entry["search"]["0"] == retimed_entry["search"]["0"], "another sampler's searches are kept apart"
    assert all(entry["search-random"]["0"][kernel]["4"]["config"] for kernel in ("fwd", "dkdv", "dq"))
    for sampler in ("tpe", "random"):
        assert table.count(f"| {sampler} | 1 |") == 3, table
    run("search_quality.py", out, "--part", "retime", "--shapes", "0")
    (entry,) = json.loads(out.read_text()).values()
    for kernel in ("fwd", "dkdv", "dq"):  # the random search's picks are re-timed with the others
        assert entry["search-random"]["0"][kernel]["4"]["config"] in entry["retime"][kernel]



def test_search_quality_regrids_a_space_that_changed(tmp_path):
    """A grid records the axes it covered: --regrid times again only the grids of a space that changed since
    (here: one whose stored hash differs, as a grid from before an added axis would)."""
    out = tmp_path / "quality.json"
    run("search_quality.py", out, "--part", "grid", "--shapes", "0", "--kernels", "fwd,dq")
    results = json.loads(out.read_text())
    (entry,) = results.values()
    fwd, dq = entry["grid"]["fwd"], entry["grid"]["dq"]
    assert len(fwd["space"]) == 8
    dq["space"], dq["best_ms"] = "00000000", -1.0  # as if timed over another space
    out.write_text(json.dumps(results))
    run("search_quality.py", out, "--part", "grid", "--shapes", "0", "--kernels", "fwd,dq", "--regrid")
    (entry,) = json.loads(out.read_text()).values()
    assert entry["grid"]["fwd"] == fwd, "a grid of the current space is kept"
    assert entry["grid"]["dq"]["best_ms"] > 0 and entry["grid"]["dq"]["space"] != "00000000"


def test_search_quality_table_mixes_no_timing_rounds(tmp_path):
    """A retime that misses a compared config (the grid timed again since) is not used: all first timings; a
    seed with no complete trial by a checkpoint (config None) counts as infinitely slow either way."""
    out = tmp_path / "quality.json"
    grid = {"configs": 2, "valid": 2, "best": "16x16/w4/s1", "best_ms": 1.0, "heuristic": "32x16/w4/s1",
            "heuristic_ms": 2.0}
    entry = {"grid": {"fwd": grid}, "search": {"0": {"fwd": {"10": {"config": "32x16/w4/s1", "ms": 2.0}}},
                                                 "1": {"fwd": {"10": {"config": None, "ms": float("inf")}}}},
             "retime": {"fwd": {"32x16/w4/s1": [0.5, 0.5, 0.5], "16x32/w4/s1": [0.4, 0.4, 0.4]}}}
    out.write_text(json.dumps({"float16 b1 h2 lq40 lk40 d16": entry}))
    row = next(line for line in run("search_quality.py", out, "--part", "table").splitlines() if "| fwd |" in line)
    assert row.endswith("| 1.000 (16x16/w4/s1) | 0.500 | 0.250 | – | – | – | first timing |"), row
    entry["retime"]["fwd"]["16x16/w4/s1"] = [1.0, 1.0, 1.0]
    out.write_text(json.dumps({"float16 b1 h2 lq40 lk40 d16": entry}))
    row = next(line for line in run("search_quality.py", out, "--part", "table").splitlines() if "| fwd |" in line)
    assert row.endswith("| 0.500 (32x16/w4/s1) | 1.000 | 0.500 | – | – | – | retimed |"), row


def test_tuning_gain_gain(tmp_path):
    out = tmp_path / "gain.json"
    table = run("tuning_gain.py", out, "--part", "gain", "--shapes", "1", "--trials", "3")
    ((label, row),) = json.loads(out.read_text())["gain"].items()
    assert row["tuned_ms"] > 0 and row["heuristic_ms"] > 0 and row["tuned"].startswith("fwd ")
    assert f"| gain | {label} |" in table


def test_tuning_gain_nearest(tmp_path):
    out = tmp_path / "nearest.json"
    table = run("tuning_gain.py", out, "--part", "nearest", "--trials", "3")
    ((label, row),) = json.loads(out.read_text())["nearest"].items()
    assert row["representative_length"] == 64 and row["exact_ms"] > 0 and row["representative_ms"] > 0
    if row["exact"] == row["representative"]:  # one timing for both: the loss is exactly 0
        assert row["exact_ms"] == row["representative_ms"]
    assert f"| nearest | {label} |" in table


def test_tuning_gain_tie_times_both_tied_entries_and_the_heuristic(tmp_path):
    """L = 64 is one octave from a DB's L = 32 entry and from its L = 128 entry: both and the heuristic are timed."""
    from dataclasses import replace

    import triton

    from fatune import codegen
    from fatune.db import Entry, TunedDB

    base = Entry(gpu="triton-interpreter", capability="cpu", triton_version=triton.__version__, torch_version="2.13.0",
                 template_hash=codegen.template_hash(), dtype="float16", head_dim=16, head_dim_v=16, mask_variant="none",
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
            db.upsert(replace(entry, template_hash=entry.check().kernel_hash()))
    out = tmp_path / "tie.json"
    table = run("tuning_gain.py", out, "--part", "tie", "--db", str(db_path))
    ((label, row),) = json.loads(out.read_text())["tie"].items()
    lower, upper = "Lq=32 Lk=32 entry", "Lq=128 Lk=128 entry"
    assert set(row) == {lower, upper, "heuristic"}, "the two nearest entries, not the far one"
    assert row[upper]["config"].startswith("fwd 16x32/") and all(timed["ms"] > 0 for timed in row.values())
    assert row[lower].get("served") and not row[upper].get("served"), "the dispatcher's pick: the faster stored time"
    assert table.count(f"| tie | {label} |") == 3 and table.count("| 1.000x |") >= 1 and f"{lower} (served)" in table
    alone = tmp_path / "alone.sqlite"
    with TunedDB(alone) as db:
        db.upsert(replace(base, template_hash=base.check().kernel_hash()))
    out.unlink()
    printed = run("tuning_gain.py", out, "--part", "tie", "--db", str(alone))
    assert "no tie to time" in printed and not out.exists(), "one nearest entry: nothing stored, so nothing skipped later"


def test_stream_probe_times_every_schedule_with_the_same_gradients(tmp_path):
    """The concurrent-dQ probe (issues 11, 12) times the backward under each schedule (in order in the
    interpreter), whose gradients equal the sequential ones: GQA with a window, key padding, packed documents."""
    out = tmp_path / "stream.json"
    table = run("stream_probe.py", out, "--masked")
    rows = json.loads(out.read_text())
    assert len(rows) == 5 and table.count("| float16 b1 h2 lq48 lk48 d16") == 2 and "window20 |" in table
    for row in rows.values():
        assert row["max_grad_difference"] == 0.0  # the Delta pass sums as the dQ kernel does
        assert all(row[name] > 0 for name in ("sequential", "concurrent", "concurrent-dkdv-first", "gain"))


def test_dkdv_split_probe_computes_the_gradients_split_or_not(tmp_path):
    """The d256 head-dim split probe (issue 11): every program owns a part of dK and dV and still matches
    torch's gradients, in the interpreter's float16."""
    out = tmp_path / "probe.json"
    run("dkdv_split_probe.py", out)
    rows = json.loads(out.read_text())
    assert {row["split"] for row in rows} == {1, 2}
    assert all("error" not in row and row["max_err"] < 5e-3 for row in rows), rows


def test_persistent_probe_walks_every_tile_in_each_order(tmp_path):
    """The persistent-forward probe (issue 11): per-tile and persistent launches, both tile orders, one or two
    programs per multiprocessor, all equal torch's causal attention in the interpreter's float16."""
    out = tmp_path / "probe.json"
    run("persistent_probe.py", out)
    rows = json.loads(out.read_text())
    assert {row["kind"] for row in rows} == {"per-tile", "persistent-longest-first", "persistent-head-major"}
    assert all("error" not in row and row["max_err"] < 5e-3 for row in rows), rows


def test_maxnreg_sweep_caps_one_kernel_at_a_time(tmp_path):
    """The register-cap sweep (issue 11): the heuristic config, then each kernel with each cap (the others as
    they are), every output and gradient checked against torch (the interpreter ignores the cap itself)."""
    out = tmp_path / "sweep.json"
    run("maxnreg_sweep.py", out, "--caps", "128,168")
    (row,) = json.loads(out.read_text())
    assert [(c["kernel"], c["maxnreg"]) for c in row["configs"]] == \
        [("none", 0)] + [(kernel, cap) for kernel in ("fwd", "dkdv", "dq") for cap in (128, 168)]
    assert all("error" not in c and c["fwd_error"] < 2e-2 and c["bwd_error"] < 2e-2 for c in row["configs"]), row
    assert all(c["config"].count(f"/r{c['maxnreg']}") == 1 for c in row["configs"][1:])
