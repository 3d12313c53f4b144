"""Every timing suite of `fatune bench` runs end to end in Triton's interpreter on tiny problems (one or two heads,
32-64 tokens, head dim 16) and writes the common result files."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from fatune.bench.results import SCHEMA_FILES, read_results
from fatune.cli import cli

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="an interpreter smoke run")

ENVIRONMENT = {"gpu", "capability", "torch", "triton", "cuda", "cudnn", "python", "fatune", "date", "command"}
TINY = ("--head-dims", "16", "--lengths", "32", "--tokens", "32", "--dtypes", "fp16")


def run(out: Path, *args: str) -> tuple[dict, str]:
    """`fatune bench ARGS -o OUT --interpret`: results.json (checked against results.csv and bench.md) and stdout."""
    result = CliRunner().invoke(cli, ["bench", *args, "-o", str(out), "--interpret"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert all((out / name).exists() for name in SCHEMA_FILES)
    data = read_results(out)
    assert set(data) == {"suite", "environment", "summary", "rows"} and set(data["environment"]) == ENVIRONMENT
    assert data["environment"]["gpu"] == "triton-interpreter" and data["environment"]["command"].startswith(
        "fatune bench ")
    with (out / "results.csv").open() as handle:
        table = list(csv.DictReader(handle))
    assert [(row["shape"], row["impl"]) for row in table] == [(row["shape"], row["impl"]) for row in data["rows"]]
    assert (out / "bench.md").read_text().startswith("Triton's interpreter on the CPU")
    return data, result.stdout


def measured(row: dict, *keys: str) -> bool:
    return not row.get("error") and all(isinstance(row[key], float) and row[key] > 0 for key in keys)


def test_dense_times_fatune_and_sdpa_through_a_training_step(tmp_path):
    data, printed = run(tmp_path, *TINY, "--model-dim", "16", "--causal", "yes",
                        "--impls", "fatune,fatune-plain,sdpa-math,flex")
    assert data["suite"] == "dense"
    rows = {row["impl"]: row for row in data["rows"]}
    assert list(rows) == ["fatune", "fatune-plain", "sdpa-math", "flex"]
    for name in ("fatune", "fatune-plain", "sdpa-math"):
        assert measured(rows[name], "fwd_ms", "bwd_ms", "fwd_bwd_ms", "fwd_bwd_tflops", "compile_s"), rows[name]
        assert rows[name]["max_abs_diff"] < 1e-2 and rows[name]["heads"] == 1 and rows[name]["causal"] is True
    assert rows["fatune"]["note"].startswith(("heuristic: fwd ", "shipped-db: fwd ", "user-db: fwd "))
    assert rows["flex"]["error"], "Flex is compiled for the GPU: not run in the interpreter"
    assert set(data["summary"]["fatune_over"]) == {"sdpa-math", "best"}
    assert "- fatune / sdpa-math: geometric mean" in printed and "| float16 | 16 | yes | 32 | 1 | 1 |" in printed


def test_masked_times_a_gqa_a_mask_tensor_and_packed_documents(tmp_path):
    data, printed = run(tmp_path, "--suite", "masked", *TINY, "--model-dim", "32",
                        "--only", "GQA,tensor: prefix,2 packed")
    by = {(row["case"], row["impl"]): row for row in data["rows"]}
    assert set(by) == {("GQA 2:1 causal", "fatune"), ("GQA 2:1 causal", "sdpa-math"),
                       ("bool mask tensor: prefix LM", "fatune"), ("bool mask tensor: prefix LM", "fatune-prepared"),
                       ("bool mask tensor: prefix LM", "sdpa-math"),
                       ("2 packed documents, causal", "fatune"), ("2 packed documents, causal", "sdpa-math")}
    for (case, impl), row in by.items():
        if impl.startswith("fatune") or "packed" not in case:
            assert measured(row, "fwd_ms", "fwd_bwd_ms", "fwd_bwd_tflops"), row
            assert row["max_abs_diff"] < 1e-2, row
    assert by[("GQA 2:1 causal", "fatune")]["kv_heads"] == 1 and by[("2 packed documents, causal", "fatune")][
        "documents"] == 2
    assert by[("2 packed documents, causal", "sdpa-math")]["error"], "SDPA takes no packed documents"
    assert printed.count("| bool mask tensor: prefix LM | 32 |") == 1


def test_inference_times_decode_and_a_bottom_right_chunk_against_sdpa(tmp_path):
    data, printed = run(tmp_path, "--inference")
    assert data["suite"] == "inference"
    kinds = {(row["kind"], row["impl"]): row for row in data["rows"]}
    assert {impl for _, impl in kinds} == {"fatune", "fatune-unsplit", "fatune-paged", "sdpa-math"}
    assert {kind for kind, _ in kinds} == {"decode", "chunked prefill"}
    for (kind, _), row in kinds.items():
        assert measured(row, "us", "kv_tb_s") and row["max_abs_diff"] < 1e-2, row
        assert row["bottom_right"] == (kind == "chunked prefill") and row["seqlen_k"] == 64
    assert "| decode |" in printed and "| chunked prefill |" in printed


def test_overhead_times_the_host_path_with_no_op_launches(tmp_path):
    from fatune.bench import overhead
    from fatune.kernel import mask_spans
    from fatune.kernel.triton import launch
    from fatune.runtime import plans

    before = (plans._plans, launch.KernelLaunch.__call__, mask_spans._jitted)
    data, printed = run(tmp_path, "--suite", "overhead", "--calls", "3", "--rounds", "2")
    rows = {(row["workload"], row["impl"]): row for row in data["rows"]}
    assert set(rows) == set(overhead.WORKLOADS) and ("forward", "fatune kernels") in rows
    assert all(row["us"] > 0 and row["us_min"] <= row["us"] and row["mode"].startswith("host") for row in rows.values())
    assert rows[("step", "sdpa")]["vs_sdpa"] == 1.0
    assert "| step | fatune prepared mask |" in printed
    after = (plans._plans, launch.KernelLaunch.__call__, mask_spans._jitted)
    assert all(now is then for now, then in zip(after, before)), \
        "launches are real again after the suite, and no plan it built (with no-op launches) is kept"


def test_transformers_trains_and_generates_a_tiny_llama_on_both_implementations(tmp_path):
    pytest.importorskip("transformers")
    data, printed = run(tmp_path, "--suite", "transformers")
    losses = {impl: [row["loss"] for row in data["rows"] if row["part"] == "train" and row["impl"] == impl]
              for impl in ("sdpa", "fatune")}
    assert len(losses["fatune"]) == len(losses["sdpa"]) == 3
    assert data["summary"]["loss_gap"] < 1e-3  # float32: the same curve
    assert data["summary"]["token_agreement"] == 1.0
    summary = [row for row in data["rows"] if row["part"] == "summary"]
    assert [row["impl"] for row in summary] == ["sdpa", "fatune"]
    assert all(measured(row, "tokens_per_s", "prefill_ms", "ms_per_token") for row in summary)
    assert "| fatune |" in printed
