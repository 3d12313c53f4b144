"""Tiny interpreter searches: DB rows, resuming, pruning, rejecting wrong kernels, reproducibility."""

from __future__ import annotations

import json

import optuna
import pytest
import torch
from click.testing import CliRunner

from fatune import codegen, search
from fatune.cli import cli
from fatune.db import TunedDB
from fatune.measure import Shape
from fatune.search import INTERPRETER_SPACE, SearchSpace, Target, infeasible, search_shape
from fatune.spec import KernelSpec, LaunchConfig

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter searches: CPU only")
TINY = Shape(batch=2, heads=2, seqlen_q=48, seqlen_k=48, head_dim=16, dtype="float16", causal=True)


def interpreter_target(shared_limit=None) -> Target:
    return Target(torch.device("cpu"), True, "triton-interpreter", "cpu", shared_limit)


def test_cli_search_writes_db_rows_with_the_right_keys(tmp_path):
    db_path = tmp_path / "tuned.sqlite"
    result = CliRunner().invoke(cli, ["search", "--head-dim", "16", "--dtype", "fp16", "--interpret", "--lengths",
                                      "40", "--mask", "causal", "--trials", "3", "--db", str(db_path), "--json"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.output[result.output.index("["):])
    assert row["interpreted"] and row["fwd_bwd_ms"] > 0 and set(row["config"]) == {"fwd", "dkdv", "dq"}
    with TunedDB(db_path, readonly=True) as db:
        (entry,) = db.entries()
    assert (entry.gpu, entry.dtype, entry.head_dim, entry.mask_variant, entry.seqlen_q_bucket) == \
        ("triton-interpreter", "float16", 16, "causal", 64)
    assert entry.template_hash == codegen.template_hash() and entry.interpreted and entry.trials == 9
    assert entry.attention_config().to_dict() == row["config"]


def test_search_resumes_from_its_storage(tmp_path):
    storage = f"sqlite:///{tmp_path / 'studies.sqlite'}"
    search_shape(TINY, interpreter_target(), trials=2, seconds=600, storage=storage, seed=0, space=INTERPRETER_SPACE)
    result = search_shape(TINY, interpreter_target(), trials=3, seconds=600, storage=storage, seed=0,
                          space=INTERPRETER_SPACE)
    assert result.trials == 9  # 3 per kernel in all: the 2 done before were kept, 1 more each
    names = {s.study_name for s in optuna.get_all_study_summaries(storage)}
    assert len(names) == 3 and all(name.endswith((":fwd", ":dkdv", ":dq")) for name in names)


def test_impossible_configs_are_pruned_before_compiling(tmp_path):
    spec = KernelSpec("float16", 128)
    assert infeasible("fwd", spec, LaunchConfig(128, 128, 8, 5), 227 * 1024) is not None
    assert infeasible("fwd", spec, LaunchConfig(16, 16, 8, 1), 227 * 1024) is not None  # too many warps
    assert infeasible("fwd", spec, LaunchConfig(64, 64, 4, 3), 227 * 1024) is None
    space = SearchSpace(block_m=(32, 128), block_n=(32, 128), num_warps=(4,), num_stages=(1, 4))
    result = search_shape(TINY, interpreter_target(shared_limit=24 * 1024), trials=8, seconds=600,
                          storage=f"sqlite:///{tmp_path / 's.sqlite'}", seed=1, space=space)
    assert result.rejected.get("infeasible", 0) > 0
    for kernel in ("fwd", "dkdv", "dq"):
        assert infeasible(kernel, TINY.spec, getattr(result.config, kernel), 24 * 1024) is None


def test_a_wrong_kernel_never_wins(tmp_path, monkeypatch):
    """Configs with BLOCK_N = 16 get a broken softmax; they are fast enough but must be rejected."""
    original = codegen.render

    def render(kind, spec, config):
        source = original(kind, spec, config)
        if kind == "fwd" and config.fwd.block_n == 16:
            source = source.replace("l_i = l_i * alpha + tl.sum(p, 1)", "l_i = l_i * alpha + 2.0 * tl.sum(p, 1)")
        return source

    monkeypatch.setattr(codegen, "render", render)
    monkeypatch.setattr(codegen, "_modules", {})
    monkeypatch.setattr(codegen, "source_key", lambda kind, spec, config: f"wrong-{kind}-{config.to_json()}"
                        .replace('"', "").replace(" ", "").replace(":", "").replace(",", "").replace("{", "")
                        .replace("}", ""))
    space = SearchSpace(block_m=(16, 32), block_n=(16, 32), num_warps=(4,), num_stages=(1,))
    result = search_shape(TINY, interpreter_target(), trials=6, seconds=600,
                          storage=f"sqlite:///{tmp_path / 's.sqlite'}", seed=3, space=space)
    assert result.config.fwd.block_n == 32
    assert result.rejected.get("wrong_result", 0) >= 1


def test_same_seed_same_trial_sequence(tmp_path):
    def params(run: int):
        storage = f"sqlite:///{tmp_path / f'run{run}.sqlite'}"
        space = SearchSpace(block_m=(16, 32), block_n=(16, 32), num_warps=(2, 4), num_stages=(1, 2))
        search_shape(TINY, interpreter_target(), trials=4, seconds=600, storage=storage, seed=7, space=space)
        studies = sorted(optuna.get_all_study_summaries(storage), key=lambda s: s.study_name)
        return [[t.params for t in optuna.load_study(study_name=s.study_name, storage=storage).trials]
                for s in studies]

    assert params(1) == params(2)


def test_search_without_gpu_or_interpreter_says_what_to_do(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="--interpret"):
        search.Target.detect(interpret=False)


def test_the_heuristic_config_is_the_first_trial(tmp_path):
    from fatune.heuristics import default_config

    storage = f"sqlite:///{tmp_path / 's.sqlite'}"
    search_shape(TINY, interpreter_target(), trials=2, seconds=600, storage=storage, seed=0, space=INTERPRETER_SPACE)
    heuristic = default_config(TINY.spec, None)
    for summary in optuna.get_all_study_summaries(storage):
        kernel = summary.study_name.rsplit(":", 1)[1]
        first = optuna.load_study(study_name=summary.study_name, storage=storage).trials[0]
        assert LaunchConfig.from_dict(first.params) == getattr(heuristic, kernel)
