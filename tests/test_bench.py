"""`fatune bench`'s tables say which configs fatune ran, from which dispatch layer."""

from __future__ import annotations

import torch

from fatune import bench
from fatune.dispatch import Dispatcher
from fatune.measure import Shape, make_inputs
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
    from fatune import competitors

    resets = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    competitors.flex(SHAPE, "cpu")
    competitors.flex(Shape(1, 2, 24, 24, 32, "float16"), "cpu")
    assert len(resets) == 2
