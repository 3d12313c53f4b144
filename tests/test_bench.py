"""`fatune bench`: its tables say which configs fatune ran, from which dispatch layer; every suite writes one result
schema and plots in one style; the problem type the suites share (Shape) expresses a chunk of queries at the end
of a longer cache."""

from __future__ import annotations

import csv
import json
import math
import sys

import pytest
import torch
from click.testing import CliRunner

from fatune.bench import dense as bench
from fatune.bench import inference, masked, results
from fatune.cli import cli
from fatune.runtime.dispatch import Dispatcher
from fatune.tuning.shape import Shape, bottom_right_causal_pairs, make_inputs
from tests.conftest import use_dispatcher

SHAPE = Shape(1, 2, 40, 40, 32, "float16", causal=True)


def test_the_note_names_the_layer_and_the_launched_configs(tmp_path, monkeypatch):
    use_dispatcher(monkeypatch, Dispatcher(user_db=tmp_path / "none.sqlite", shipped=[]))
    inputs = make_inputs(SHAPE, "cpu")
    note = bench.fatune_note("fatune", SHAPE, inputs)
    assert note.startswith("heuristic: fwd ") and ", dkdv " in note and ", dq " in note and "|" not in note, note
    forced = bench.fatune_note("fatune-plain", SHAPE, inputs)
    assert forced.startswith("argument: fwd ") and "/k" not in forced, forced  # one key split: no /k


def test_the_detail_table_carries_the_note():
    row = bench.BenchRow(SHAPE, "fatune", 1.0, 2.0, 3.0, 0.5, 2**20, 0.0, note="shipped-db: fwd a, dkdv b")
    header, _, line = bench.detail_table([row]).splitlines()
    assert line.endswith("| shipped-db: fwd a, dkdv b |") and line.count("|") == header.count("|")


def test_flex_compiles_afresh_per_shape(monkeypatch):
    """Past dynamo's recompile limit Flex would silently run unfused: each shape starts a fresh compile."""
    from fatune.tuning import competitors

    resets = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    competitors.flex(SHAPE, "cpu")
    competitors.flex(Shape(1, 2, 24, 24, 32, "float16"), "cpu")
    assert len(resets) == 2


def test_a_compiled_run_times_each_implementation_through_torch_compile(tmp_path, monkeypatch):
    """--compile: every implementation runs through torch.compile with its sizes fixed, traced afresh per shape;
    fatune-kernels' configs are looked up before (explain is not traced)."""
    use_dispatcher(monkeypatch, Dispatcher(user_db=tmp_path / "none.sqlite", shipped=[]))
    compiled, resets = [], []
    real_compile, real_reset = torch.compile, torch._dynamo.reset
    monkeypatch.setattr(torch, "compile", lambda fn, **options: compiled.append(options) or real_compile(fn, **options))
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1) or real_reset())
    rows = bench.bench_shape(SHAPE, ["fatune", "fatune-kernels", "sdpa-math"], warmup_ms=1, rep_ms=1,
                             device=torch.device("cpu"), compile="aot_eager")
    assert [row.error for row in rows] == ["", "", ""] and all(row.fwd_bwd_ms > 0 for row in rows)
    assert compiled == [{"fullgraph": True, "dynamic": False, "backend": "aot_eager"}] * 3 and resets == [1]
    assert rows[1].max_abs_diff < 2e-3


def rows_of_two_impls() -> list[bench.BenchRow]:
    shapes = [SHAPE, SHAPE.with_(seqlen_q=80, seqlen_k=80)]
    return [bench.BenchRow(shape, impl, 1.0, 2.0, ms, 0.5, 2**20, 0.0) for shape in shapes
            for impl, ms in (("fatune", 3.0), ("sdpa-flash", 4.0))] + [bench.BenchRow(SHAPE, "flex", error="boom")]


def test_every_suite_writes_one_schema(tmp_path, monkeypatch):
    """results.json (rows, environment, summary), results.csv (the same rows) and bench.md; NaN is null in JSON
    and an empty CSV cell; without matplotlib the plot is skipped and nothing fails."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    report = bench.report(rows_of_two_impls())
    env = results.environment(["bench", "--lengths", "40,80"], "cpu")
    written = results.write(tmp_path, report, env)
    assert [path.name for path in written] == ["results.json", "results.csv", "bench.md"]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["suite"] == "dense" and env["command"] == "fatune bench --lengths 40,80" == data["environment"]["command"]
    assert data["environment"]["gpu"] == "triton-interpreter" and data["environment"]["torch"] == torch.__version__
    assert data["summary"]["fatune_over"]["sdpa-flash"] == {"geomean": 4 / 3, "worst": 4 / 3, "best": 4 / 3,
                                                            "shapes": 2}
    flex = data["rows"][-1]
    assert flex["impl"] == "flex" and flex["error"] == "boom" and flex["fwd_ms"] is None
    with (tmp_path / "results.csv").open() as handle:
        table = list(csv.DictReader(handle))
    assert len(table) == len(data["rows"]) == 5 and list(table[0]) == list(data["rows"][0])
    assert table[-1]["fwd_ms"] == "" and float(table[0]["fwd_bwd_ms"]) == 3.0 and table[0]["causal"] == "True"
    markdown = (tmp_path / "bench.md").read_text()
    assert markdown.startswith("Triton's interpreter on the CPU") and "geometric mean 1.333" in markdown


def test_one_plot_style_draws_a_panel_per_group(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [row.to_dict() for row in rows_of_two_impls()]
    assert results.plot(rows, tmp_path / "bench.png", bench.PLOT, title="dense")
    assert (tmp_path / "bench.png").read_bytes().startswith(b"\x89PNG")
    assert not results.plot([{"impl": "x", "error": "failed"}], tmp_path / "none.png", bench.PLOT)


def test_the_inference_and_masked_tables_compare_fatune_with_the_best_other():
    decode = Shape(8, 32, 1, 8192, 128, "bfloat16", kv_heads=8)
    rows = [{"shape": decode.label(), "kind": "decode", "impl": impl, "us": us, "kv_tb_s": rate}
            for impl, us, rate in (("fatune", 40.0, 3.2), ("sdpa-flash", 50.0, 2.6), ("sdpa-cudnn", 60.0, 2.1))]
    rows.append({"shape": decode.label(), "kind": "decode", "impl": "sdpa-efficient", "error": "no"})
    line = inference.table(rows, 4.0).splitlines()[2]
    assert line == f"| {decode.label()} | decode | 40.0 | 50.0 | 60.0 | n/a | 1.25 | 3.20 | 80% |"
    assert inference.table(rows[:1], math.nan).splitlines()[2].endswith("| decode | 40.0 | n/a | 3.20 | n/a |")
    case = {"case": "bool mask tensor: causal", "seqlen_q": 64, "batch": 1, "heads": 2, "kv_heads": 2}
    rows = [{**case, "impl": impl, "fwd_ms": 1.0, "fwd_bwd_ms": ms, "max_abs_diff": diff}
            for impl, ms, diff in (("sdpa-efficient", 4.0, 0.0), ("fatune", 2.0, 0.001), ("fatune-prepared", 1.0, 0.5))]
    line = masked.table(rows).splitlines()[2]
    assert line.startswith("| bool mask tensor: causal | 64 | 1 | 2 | 2 | 1.000 / 2.000 | 1.000 / 1.000 | 1.000 / 4.000")
    assert line.endswith("| 2.00x | 4.00x | fatune-prepared by 0.500 |")


def test_the_masked_cases_cover_each_variant_with_its_mask():
    cases = {case.name: case for case in masked.cases(64, head_dim=16, model_dim=32, tokens=128)}
    assert cases["causal window 256"].shape.window == 256 and cases["GQA 2:1 causal"].shape.kv_heads == 1
    assert cases["key padding 50%"].shape.kept_keys == 32 and cases["5 packed documents, causal"].shape.documents == 5
    assert "64 packed documents, causal" not in cases, "as many documents as tokens is no packing"
    prefix = masked.mask_tensor("prefix LM", 2, 64, torch.device("cpu"))
    assert prefix.shape == (2, 1, 64, 64) and prefix[0, 0, 0, :16].all() and not prefix[0, 0, 0, 16:].any()
    assert prefix[1, 0, 0, :8].all() and not prefix[1, 0, 0, 8:].any(), "a prefix per batch element"
    assert [case.name for case in masked.cases(64, only="tensor: random,GQA")] == ["GQA 8:1 causal",
                                                                                   "bool mask tensor: random 90%"]


def test_a_chunk_at_the_end_of_a_cache_is_a_shape():
    """bottom_right: the queries attend causally aligned to the end of the keys (causal_alignment="bottom_right");
    shapes without it are the same keys as before (a frozen dataclass used as a cache key)."""
    old = Shape(4, 32, 128, 8192, 128, "bfloat16", causal=True, kv_heads=8)
    assert old == Shape(4, 32, 128, 8192, 128, "bfloat16", True, 8) and hash(old) == hash(old.with_())
    assert old.with_(bottom_right=False) == old and {old: 1}[Shape(4, 32, 128, 8192, 128, "bfloat16", True, 8)] == 1
    chunk = old.with_(bottom_right=True)
    assert chunk != old and "causal_alignment" not in old.attention_kwargs("cpu")
    assert chunk.attention_kwargs("cpu")["causal_alignment"] == "bottom_right" and chunk.problem is not None
    assert chunk.label() == "bfloat16 b4 h32 hkv8 lq128 lk8192 d128 causal bottom-right" and old.label() in chunk.label()
    for lq, lk in ((1, 9), (5, 9), (9, 9), (12, 9)):
        assert bottom_right_causal_pairs(lq, lk) == sum(max(0, min(i + lk - lq, lk - 1) + 1) for i in range(lq))
    assert chunk.flops("fwd") == 4.0 * 4 * 32 * 128 * bottom_right_causal_pairs(128, 8192) \
        == 4.0 * 4 * 32 * 128 * (128 * 8064 + 128 * 129 // 2)
    assert old.flops("fwd") == 4.0 * 4 * 32 * 128 * 128 * 8192 / 2, "top-left keeps its half"
    assert chunk.cache_bytes() == 2 * 4 * 8 * 8192 * 128 * 2 == old.cache_bytes()


def test_the_cli_keeps_its_aliases_and_checks_each_suites_options():
    def invoke(*args):
        return CliRunner().invoke(cli, ["bench", *args])

    alias = invoke("--inference", "--dry-run")
    assert alias.exit_code == 0 and "use --suite inference" in alias.stderr
    assert alias.stdout == invoke("--suite", "inference", "--dry-run").stdout != ""
    assert invoke("--overhead", "--suite", "dense", "--dry-run").exit_code == 2
    assert invoke("--inference", "--overhead", "--dry-run").exit_code == 2
    assert invoke("--part", "grid", "--dry-run").exit_code == 2, "--part belongs to the resumable suites"
    assert invoke("--suite", "masked", "--compile", "inductor", "--dry-run").exit_code == 2
    assert invoke("--compile", "inductor", "--dry-run").exit_code == 0
    assert invoke("--suite", "tuning-gain", "--part", "grid", "--dry-run").exit_code == 2
    listed = invoke("--suite", "tuning-gain", "--part", "gain", "--shapes", "1", "--dry-run")
    assert listed.exit_code == 0 and len(listed.stdout.splitlines()) == 1 and listed.stdout.startswith("gain ")
    assert invoke("--suite", "search-quality", "--part", "grid", "--shapes", "9", "--dry-run").exit_code == 2
    cases = invoke("--suite", "masked", "--lengths", "4096", "--only", "window", "--dry-run").stdout.splitlines()
    assert cases == [f"causal window {w}: bfloat16 b4 h16 lq4096 lk4096 d128 causal window{w}" for w in (256, 1024, 4096)]
    assert len(invoke("--suite", "overhead", "--dry-run").stdout.splitlines()) == 10
