"""The kernel family as a search axis: the Gluon forward's study beside the Triton forward's, its axes and
resource model, the faster family's forward stored, and the entry the dispatcher serves from it."""

from __future__ import annotations

import dataclasses
import time

import optuna
import pytest
import torch

from fatune.db import TunedDB
from fatune.kernel.gluon import codegen as gluon_codegen
from fatune.kernel.gluon import launch as gluon_launch
from fatune.kernel.gluon import resources
from fatune.kernel.gluon.family import default_backward, default_forward
from fatune.kernel.spec import (AttentionConfig, GluonBackwardConfig, GluonConfig, KernelSpec, LaunchConfig,
                                gluon_register_cap)
from fatune.kernel.triton.heuristics import default_config
from fatune.kernel.triton.resolve import source_hash
from fatune.kernel.family import family
from fatune.tuning import search, study, trials
from fatune.tuning.shape import Shape
from fatune.tuning.space import GLUON_BACKWARD, GLUON_FORWARD, GPU_SPACE, INTERPRETER_SPACE, infeasible, make_config
from fatune.tuning.storage import Heartbeat, open_storage
from fatune.tuning.target import Target

H100_SHARED = 227 * 1024
# a Hopper GPU as a search sees it; its device is "cuda" so that the family's serves() decides (the test patches
# the compute capability it reads, as the GPU would answer it)
HOPPER = Target(torch.device("cuda"), False, "NVIDIA H100 80GB HBM3", "9.0", H100_SHARED, 132)
SHAPE = Shape(4, 16, 4096, 4096, 128, "bfloat16")


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(gluon_launch, "device_arch", lambda device: (9, 0))
    return HOPPER


BOTH = ("fwd", GLUON_FORWARD, "dkdv", GLUON_BACKWARD, "dq")


@pytest.mark.parametrize("shape, families, expected", [
    (SHAPE, ("triton", "gluon"), BOTH),
    (dataclasses.replace(SHAPE, causal=True, kv_heads=4), ("triton", "gluon"), BOTH),
    (SHAPE, ("triton",), ("fwd", "dkdv", "dq")),  # fatune search --family triton
    (dataclasses.replace(SHAPE, dtype="float32"), ("triton", "gluon"), ("fwd", "dkdv", "dq")),  # 16-bit only
    (dataclasses.replace(SHAPE, head_dim=96, head_dim_v=96), ("triton", "gluon"), BOTH),  # d96 runs 128 lanes wide
    (dataclasses.replace(SHAPE, head_dim=64), ("triton", "gluon"), ("fwd", "dkdv", "dq")),  # D_v 128 != D 64
    (dataclasses.replace(SHAPE, window=256, causal=True), ("triton", "gluon"), BOTH),
    (dataclasses.replace(SHAPE, valid_keys=0.5), ("triton", "gluon"), BOTH),  # key lengths
    (dataclasses.replace(SHAPE, documents=4), ("triton", "gluon"), BOTH),  # packed
    (dataclasses.replace(SHAPE, head_dim=256, head_dim_v=256), ("triton", "gluon"), BOTH),
    (Shape(64, 16, 1, 8192, 128, "bfloat16"), ("triton", "gluon"), ("fwd", GLUON_FORWARD)),  # decode: forward only
])
def test_a_shape_the_gluon_family_serves_gets_gluon_studies(hopper, shape, families, expected):
    space = dataclasses.replace(GPU_SPACE, families=families)
    assert study.shape_kernels(shape, hopper, space) == expected


def test_no_gluon_study_off_hopper_or_in_the_interpreter(monkeypatch):
    monkeypatch.setattr(gluon_launch, "device_arch", lambda device: (8, 0))
    ampere = dataclasses.replace(HOPPER, capability="8.0", gpu="NVIDIA A100")
    assert study.shape_kernels(SHAPE, ampere, GPU_SPACE) == ("fwd", "dkdv", "dq")
    interpreter = Target(torch.device("cpu"), True, "triton-interpreter", "cpu", None)
    assert study.shape_kernels(SHAPE, interpreter, INTERPRETER_SPACE) == ("fwd", "dkdv", "dq")
    assert study.shape_kernels(SHAPE) == ("fwd", "dkdv", "dq")


def test_the_gluon_axes_hold_only_register_splits_the_sm_can_give():
    """Three consumer warpgroups get at most 160 registers each (with the producer's 24, an SM's 64K over 512
    threads); every config's launch cap leaves room for its split, and the cap follows the consumers."""
    grid = GPU_SPACE.grid(GLUON_FORWARD, SHAPE, 132)
    assert set(GPU_SPACE.axes(GLUON_FORWARD, SHAPE, 132)) == {"block_n", "num_stages", "consumers", "consumer_regs",
                                                              "overlap", "pingpong", "persistent"}
    assert not any(c.pingpong and not c.overlap for c in grid)
    assert grid and all(isinstance(config, GluonConfig) for config in grid)
    assert {c.consumer_regs for c in grid if c.consumers == 3} == {160}
    assert {c.consumer_regs for c in grid if c.consumers == 2} == set(GPU_SPACE.consumer_regs)
    assert {(c.consumers, c.maxnreg) for c in grid} == {(2, 168), (3, 128)}
    assert gluon_register_cap(2) == 168 and gluon_register_cap(3) == 128


@pytest.mark.parametrize("fields, argument", [
    ({"consumers": 3, "consumer_regs": 240}, "consumer_regs"),  # 3 x 240 + 24 registers per lane: over 64K
    ({"consumers": 2, "consumer_regs": 240, "maxnreg": 128}, "consumer_regs"),  # a cap too low for the split
    ({"consumers": 2, "consumer_regs": 240, "maxnreg": 255}, "consumer_regs"),  # a pool over the SM's registers
    ({"consumers": 4}, "consumers"),
    ({"block_n": 96}, "block_n"),
    ({"consumer_regs": 100}, "consumer_regs"),
    ({"maxnreg": 300}, "maxnreg"),
    ({"pingpong": 1, "overlap": 0}, "pingpong"),  # turns are taken in the overlapped loop
    ({"pingpong": 2}, "pingpong"),
])
def test_a_gluon_config_that_would_hang_or_cannot_launch_is_refused_by_name(fields, argument):
    """setmaxnreg waits for registers the launch never gave: a tuned DB naming such a split must be refused,
    never launched."""
    with pytest.raises(ValueError, match=f"^{argument}:"):
        GluonConfig(**fields)
    with pytest.raises(ValueError, match=f"^{argument}:"):
        AttentionConfig.from_dict({"fwd": {"family": "gluon", **fields}, "dkdv": LaunchConfig(64, 64).to_dict(),
                                   "dq": LaunchConfig(64, 64).to_dict()})


@pytest.mark.parametrize("head_dim, config, fits", [
    (256, GluonConfig(block_n=128, num_stages=2), False),
    (256, GluonConfig(block_n=64, num_stages=2), True),
    (256, GluonConfig(block_n=64, num_stages=3), False),
    (128, GluonConfig(block_n=128, num_stages=3), True),
    (128, GluonConfig(block_n=128, num_stages=4), False),
    (64, GluonConfig(block_n=128, num_stages=4, consumers=3, consumer_regs=160), True),
    (128, GluonConfig(block_n=64, num_stages=2, consumers=3, consumer_regs=160), False),  # spills: no overlap left
])
def test_the_resource_model_rejects_rings_that_cannot_fit_before_compiling(head_dim, config, fits):
    spec = KernelSpec("bfloat16", head_dim)
    assert (infeasible(GLUON_FORWARD, spec, config, H100_SHARED) is None) == fits
    assert infeasible(GLUON_FORWARD, spec, config, None) is None


def test_naming_a_gluon_study_again_renders_nothing(hopper, monkeypatch):
    """A search's progress names its studies again and again: the Gluon sources its name hashes are rendered once
    per process and template folder (rendering them all takes a few hundred ms), and the name stays the same."""
    from fatune.kernel.gluon import family as gluon_family

    gluon_family._search_hash.cache_clear()
    renders = []
    for name in ("render", "render_backward"):
        original = getattr(gluon_codegen, name)
        monkeypatch.setattr(gluon_codegen, name,
                            lambda *args, _original=original: renders.append(1) or _original(*args))
    first = study.study_name(hopper, SHAPE, GLUON_FORWARD)
    rendered = len(renders)
    assert rendered > 1
    assert [study.study_name(hopper, SHAPE, kernel) for kernel in (GLUON_FORWARD, GLUON_BACKWARD)] == \
        [first, study.study_name(hopper, SHAPE, GLUON_BACKWARD)]
    assert len(renders) == rendered


def test_the_gluon_study_is_its_own_and_starts_from_the_familys_default(hopper, tmp_path):
    storage = open_storage(f"sqlite:///{tmp_path / 's.sqlite'}")
    heuristic = default_config(SHAPE.spec, (9, 0))
    assert study.study_name(hopper, SHAPE, GLUON_FORWARD) != study.study_name(hopper, SHAPE, "fwd")
    assert study.study_name(hopper, SHAPE, GLUON_FORWARD).endswith(":fwd-gluon")
    gluon = study.KernelSearch(hopper, SHAPE, GLUON_FORWARD, heuristic, GPU_SPACE, storage, seed=0, trials=30,
                               deadline=time.time() + 600)
    assert gluon.slot == "fwd"
    assert make_config(GLUON_FORWARD, gluon.start) == default_forward(SHAPE.spec)
    (queued,) = gluon.study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert queued.system_attrs["fixed_params"] == gluon.start
    # its draws are Gluon configs the GPU can hold, each tried once
    seen = set()
    with Heartbeat(storage) as heartbeat:
        for _ in range(12):
            candidate = gluon.ask(heuristic, heartbeat, None)
            assert isinstance(candidate.config, GluonConfig) and candidate.config not in seen
            assert resources.shared_memory_bytes(SHAPE.spec, candidate.config) <= H100_SHARED
            seen.add(candidate.config)
            gluon._tell(candidate.trial, heartbeat, lambda: 1.0)
    assert all(trial.user_attrs.get("rejected") in (None, "infeasible", "repeated") for trial in gluon.study.trials)


def test_warm_starts_of_the_other_family_are_not_queued_in_a_study(hopper, tmp_path):
    storage = open_storage(f"sqlite:///{tmp_path / 's.sqlite'}")
    heuristic = default_config(SHAPE.spec, (9, 0))
    tuned_gluon = heuristic.replace(fwd=GluonConfig(block_n=64, num_stages=3))
    tuned_triton = heuristic.replace(fwd=LaunchConfig(64, 128, num_warps=4, num_stages=3, num_splits=0))
    gluon = study.KernelSearch(hopper, SHAPE, GLUON_FORWARD, heuristic, GPU_SPACE, storage, seed=0, trials=30,
                               deadline=time.time() + 600, warm=(tuned_triton, tuned_gluon))
    triton = study.KernelSearch(hopper, SHAPE, "fwd", heuristic, GPU_SPACE, storage, seed=0, trials=30,
                                deadline=time.time() + 600, warm=(tuned_triton, tuned_gluon))
    warm = lambda search: [t.system_attrs["fixed_params"] for t in search.study.trials  # noqa: E731
                           if t.user_attrs.get("warm_start")]
    assert [make_config(GLUON_FORWARD, params) for params in warm(gluon)] == [tuned_gluon.fwd]
    assert [make_config("fwd", params) for params in warm(triton)] == [tuned_triton.fwd]


@pytest.mark.parametrize("shape, forward, backward", [
    (SHAPE, True, True),
    (dataclasses.replace(SHAPE, heads=32, head_dim=64, head_dim_v=64), True, False),
    (dataclasses.replace(SHAPE, head_dim=256, head_dim_v=256, causal=True), True, True),
])
def test_each_familys_studies_start_from_its_own_config_beside_a_mixed_builtin(hopper, tmp_path, shape, forward,
                                                                               backward):
    """On Hopper the built-in config runs Gluon kernels where they measured faster: the Gluon studies start from
    it, the Triton studies from the Triton family's heuristic (queued, so the search always times it), and a dQ
    trial runs beside a Triton dK/dV without atomic dQ."""
    storage = open_storage(f"sqlite:///{tmp_path / 's.sqlite'}")
    builtin, searches = trials.kernel_searches(shape, hopper, trials=30, seconds=600, storage=storage, seed=0,
                                               space=GPU_SPACE)
    assert (builtin.gluon_forward, builtin.gluon_backward) == (forward, backward)
    triton = family("triton").heuristic(shape.problem, (9, 0), hopper.sms)
    by_kernel = {s.kernel: s for s in searches}
    for kernel in ("fwd", "dkdv", "dq"):
        search_ = by_kernel[kernel]
        assert search_.start and search_.start == study.heuristic_params(triton, kernel, shape.spec, search_.axes)
        assert [t.system_attrs["fixed_params"] for t in search_.study.get_trials(
            states=(optuna.trial.TrialState.WAITING,))] == [search_.start]
    assert make_config(GLUON_FORWARD, by_kernel[GLUON_FORWARD].start) == builtin.fwd
    if backward:
        assert make_config(GLUON_BACKWARD, by_kernel[GLUON_BACKWARD].start) == builtin.dkdv
    base = trials.base_config(searches, builtin, "dq")
    assert isinstance(base.dkdv, LaunchConfig) and not base.dkdv.atomic_dq


def _finished(search_: study.KernelSearch, configs_ms: list[tuple[object, float]]) -> None:
    """Trials of `search_` that finished with these times, as a GPU's would have (the selection reads only
    the studies)."""
    distributions = {axis: optuna.distributions.CategoricalDistribution(list(values))
                     for axis, values in search_.axes.items()}
    for config, ms in configs_ms:
        params = {axis: getattr(config, axis) for axis in search_.axes}
        search_.study.add_trial(optuna.trial.create_trial(params=params, distributions=distributions, value=ms))


@pytest.mark.parametrize("triton_ms, gluon_ms, family", [(1.0, 0.8, "gluon"), (0.8, 1.0, "triton"), (1.0, None, "triton"),
                                                         (None, 0.8, "gluon"), (None, None, None)])
def test_the_faster_familys_forward_wins_and_its_entry_is_served(hopper, tmp_path, triton_ms, gluon_ms, family):
    """The forward studies time their kernels on the same inputs: the faster family's best is the shape's
    forward; a family's study none of whose configs ran leaves it to the other, and neither is an error. The stored entry holds the
    winner's family and the code hashes of the kernels it measured, and the DB gives the config back."""
    storage = open_storage(f"sqlite:///{tmp_path / 's.sqlite'}")
    heuristic = default_config(SHAPE.spec, (9, 0))
    searches = [study.KernelSearch(hopper, SHAPE, kernel, heuristic, GPU_SPACE, storage, seed=0, trials=30,
                                   deadline=time.time() + 600) for kernel in study.shape_kernels(SHAPE, hopper)]
    by_kernel = {s.kernel: s for s in searches}
    triton_forward = make_config("fwd", by_kernel["fwd"].start)  # the heuristic's forward, as its study holds it
    if triton_ms is not None:
        _finished(by_kernel["fwd"], [(triton_forward, triton_ms), (dataclasses.replace(triton_forward, num_stages=2),
                                                                   3.0)])
    gluon_forward = GluonConfig(block_n=128, num_stages=3)
    if gluon_ms is not None:
        _finished(by_kernel[GLUON_FORWARD], [(gluon_forward, gluon_ms), (GluonConfig(64, 2), 2.0)])
    _finished(by_kernel["dkdv"], [(heuristic.dkdv, 2.0)])
    _finished(by_kernel["dq"], [(heuristic.dq, 2.5)])

    if family is None:
        with pytest.raises(RuntimeError, match="no fwd config passed the checks"):
            search.choose_winners(SHAPE, searches)
        return
    chosen, kernel_ms, _ = search.choose_winners(SHAPE, searches)
    assert chosen["fwd"] == (gluon_forward if family == "gluon" else triton_forward)
    assert kernel_ms.get("fwd") == triton_ms and kernel_ms.get(GLUON_FORWARD) == gluon_ms

    config = heuristic.replace(**chosen)
    result = search.ShapeResult(SHAPE, config, kernel_ms, 1.0, 2.0, 3.0, trials=4)
    entry = search.to_entry(result, hopper)
    fwd_hash = source_hash("fwd", gluon_codegen.render(SHAPE.spec, gluon_forward))
    assert (fwd_hash in entry.template_hash.split(",")) == (family == "gluon")
    with TunedDB(tmp_path / "tuned.sqlite") as db:
        assert db.upsert(entry)
        (stored,) = db.entries()
    assert stored.attention_config() == config and stored.attention_config().family == family


@pytest.mark.parametrize("dkdv_ms, dq_ms, gluon_ms, winner", [
    (2.0, 3.0, 1.5, "gluon"),  # the Gluon backward beat the atomic Triton one
    (2.0, 3.0, 2.5, "atomic"),
    (2.0, 1.8, 1.5, "gluon"),  # the separate backward beat the atomic one, not the Gluon one
    (2.0, 1.4, 1.5, "separate"),
    (2.0, 3.0, None, "atomic"),  # no Gluon trial ran
])
def test_the_fastest_backward_of_either_family_wins(hopper, tmp_path, dkdv_ms, dq_ms, gluon_ms, winner):
    """The dK/dV slot goes to the fastest backward: the Triton family's atomic dK/dV, its dK/dV beside the dQ
    kernel (the dQ study's time), or the Gluon backward; the entry stores it and the DB gives it back."""
    storage = open_storage(f"sqlite:///{tmp_path / 's.sqlite'}")
    heuristic = default_config(SHAPE.spec, (9, 0))
    searches = [study.KernelSearch(hopper, SHAPE, kernel, heuristic, GPU_SPACE, storage, seed=0, trials=30,
                                   deadline=time.time() + 600) for kernel in study.shape_kernels(SHAPE, hopper)]
    by_kernel = {s.kernel: s for s in searches}
    _finished(by_kernel["fwd"], [(make_config("fwd", by_kernel["fwd"].start), 1.0)])
    atomic = dataclasses.replace(heuristic.dkdv, atomic_dq=1)
    separate = dataclasses.replace(heuristic.dkdv, atomic_dq=0, num_stages=1)
    _finished(by_kernel["dkdv"], [(atomic, dkdv_ms), (separate, dkdv_ms + 1.0)])
    _finished(by_kernel["dq"], [(heuristic.dq, dq_ms)])
    backward = GluonBackwardConfig(num_stages=3)
    assert make_config(GLUON_BACKWARD, by_kernel[GLUON_BACKWARD].start) == default_backward(SHAPE.spec)
    if gluon_ms is not None:
        _finished(by_kernel[GLUON_BACKWARD], [(backward, gluon_ms), (GluonBackwardConfig(block_m=128), 9.0)])
    chosen, kernel_ms, _ = search.choose_winners(SHAPE, searches)
    assert chosen["dkdv"] == {"gluon": backward, "atomic": atomic, "separate": separate}[winner]
    config = heuristic.replace(**chosen)
    entry = search.to_entry(search.ShapeResult(SHAPE, config, kernel_ms, 1.0, 2.0, 3.0, trials=4), hopper)
    with TunedDB(tmp_path / "tuned.sqlite") as db:
        assert db.upsert(entry)
        (stored,) = db.entries()
    assert stored.attention_config() == config
    assert stored.attention_config().gluon_backward == (winner == "gluon")


def test_the_gluon_backward_axes_fit_the_gpu():
    grid = GPU_SPACE.feasible(GLUON_BACKWARD, SHAPE, HOPPER)
    assert set(GPU_SPACE.axes(GLUON_BACKWARD, SHAPE, 132)) == {"block_m", "num_stages", "consumers", "consumer_regs",
                                                               "dq_slice", "shared_dq"}
    assert grid and all(isinstance(config, GluonBackwardConfig) for config in grid)
    assert all(resources.backward_shared_memory_bytes(SHAPE.spec, config) <= H100_SHARED for config in grid)
    assert GluonBackwardConfig(block_m=128, num_stages=2) not in grid  # 128-row Q and dO tiles two deep at d128
    # grouped query heads: programs that share a key tile's group, at most one per head of the group
    grouped = dataclasses.replace(SHAPE, kv_heads=SHAPE.heads // 4)
    assert GPU_SPACE.axes(GLUON_BACKWARD, grouped, 132)["group_split"] == (1, 2, 4)
    assert GluonBackwardConfig(group_split=4) in GPU_SPACE.feasible(GLUON_BACKWARD, grouped, HOPPER)
    small = dataclasses.replace(SHAPE, head_dim=64, head_dim_v=64)
    assert {config.dq_slice for config in GPU_SPACE.grid(GLUON_BACKWARD, small, 132)} == {64}
    # 32-lane slices only at 256 lanes, where they let two Q/dO stages fit
    assert {config.dq_slice for config in GPU_SPACE.grid(GLUON_BACKWARD, SHAPE, 132)} == {64, 128}
    wide = dataclasses.replace(SHAPE, head_dim=256, head_dim_v=256)
    assert {config.dq_slice for config in GPU_SPACE.grid(GLUON_BACKWARD, wide, 132)} == {32, 64, 128}
    assert GluonBackwardConfig(num_stages=2, dq_slice=32) in GPU_SPACE.feasible(GLUON_BACKWARD, wide, HOPPER)


@pytest.mark.gpu
def test_gpu_a_search_over_both_families_stores_and_serves_its_winner(tmp_path, monkeypatch):
    """On a Hopper GPU one shape's search runs the Gluon forward's study beside the Triton forward's; some
    Gluon config compiles, passes the check and is timed; the stored entry is what the dispatcher serves, and
    fatune.explain names the family that runs."""
    import fatune
    from fatune.tuning.target import Target as GpuTarget

    target = GpuTarget.detect(interpret=False)
    if target.arch != (9, 0):
        pytest.skip("the Gluon family runs on Hopper")
    shape = Shape(4, 16, 2048, 2048, 128, "bfloat16", causal=True)
    storage = f"sqlite:///{tmp_path / 'studies.sqlite'}"
    started = time.perf_counter()
    result = search.search_shape(shape, target, trials=8, seconds=300, storage=storage, seed=0, space=GPU_SPACE)
    seconds = time.perf_counter() - started
    assert result.kernel_ms.get(GLUON_FORWARD, float("inf")) < float("inf"), result.kernel_ms
    assert result.kernel_ms.get(GLUON_BACKWARD, float("inf")) < float("inf"), result.kernel_ms
    faster = "gluon" if result.kernel_ms[GLUON_FORWARD] < result.kernel_ms["fwd"] else "triton"
    assert result.config.gluon_forward == (faster == "gluon")
    assert result.config.gluon_backward == (result.kernel_ms[GLUON_BACKWARD] <= min(result.kernel_ms["dkdv"],
                                                                                    result.kernel_ms["dq"]))
    family = "gluon" if result.config.gluon_forward or result.config.gluon_backward else "triton"
    monkeypatch.setenv("FATUNE_DB", str(tmp_path / "tuned.sqlite"))
    with TunedDB(tmp_path / "tuned.sqlite") as db:
        search.store(db, result, target)
    from fatune.runtime.plans import clear

    clear()  # the dispatcher reads the DB again
    try:
        q = torch.randn(4, 16, 2048, 128, device="cuda", dtype=torch.bfloat16)
        explanation = fatune.explain(q, q, q, is_causal=True)
        # where torch SDPA measured faster than both families the entry routes the call there
        routed = f"sdpa-{explanation.decision.route}" if explanation.decision.route else family
        assert explanation.backend in (family, routed), str(explanation)
        assert explanation.decision.config == result.config, str(explanation)
    finally:
        clear()
    print(f"search of {shape.label()} over both families, 8 trials per study: {seconds:.1f} s; "
          f"forward {result.kernel_ms}")


@pytest.mark.parametrize("head_dim, served, width", [(64, True, 64), (40, True, 64), (96, True, 128), (80, True, 128),
                                                     (192, True, 256), (256, True, 256), (50, False, None),
                                                     (8, True, 64)])
def test_head_dims_between_the_compiled_widths_run_at_the_next_one(hopper, head_dim, served, width):
    """Tiles are powers of two: d96 runs 128 lanes wide (TMA reads zeros past the tensor's last lane); a head dim
    whose rows are not 16-byte multiples cannot be read by TMA at all."""
    spec = KernelSpec("bfloat16", head_dim)
    assert (gluon_launch.unserved(spec, torch.device("cuda")) is None) == served
    if served:
        assert gluon_codegen.width(head_dim) == width
        assert f"HEAD_DIM = gl.constexpr({width})" in gluon_codegen.render(spec, default_forward(spec))


@pytest.mark.parametrize("spec, forward, backward", [
    (KernelSpec("bfloat16", 128, causal=True, window_left=True, bottom_right=True), True, True),
    (KernelSpec("bfloat16", 128, window_left=True, window_right=True, bottom_right=True), True, True),
    (KernelSpec("bfloat16", 128, causal=True, seqlens="seqlens_k"), True, True),  # in-kernel descriptors end there
    (KernelSpec("bfloat16", 128, seqlens="varlen"), True, True),  # each program makes its sequence's descriptors
    (KernelSpec("bfloat16", 128, causal=True, attn_mask="bool"), False, False),
    (KernelSpec("bfloat16", 128, alibi=True), True, True),
    (KernelSpec("bfloat16", 128, dropout=True), False, False),
    (KernelSpec("float32", 128), False, False),
    (KernelSpec("bfloat16", 256), True, True),  # two consumer warpgroups share each key tile
    (KernelSpec("float16", 32), True, False),  # dS split everywhere at d32 (the Triton backward's rule)
])
def test_the_variants_the_gluon_kernels_serve(hopper, spec, forward, backward):
    assert (gluon_launch.unserved(spec, torch.device("cuda")) is None) == forward
    assert (gluon_launch.backward_unserved(spec, torch.device("cuda")) is None) == backward
