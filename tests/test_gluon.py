"""The Gluon family's Hopper forward and backward: compiled for sm_90 on the CPU (no spills, the softmax under the
tensor-core products), where the built-in config takes them, and on a GPU against the float64 golden with the
accuracy rule."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import fatune
from fatune.call import check_inputs
from fatune.kernel.family import builtin_config, family
from fatune.kernel.gluon import resources
from fatune.kernel.gluon import family as gluon_family
from fatune.kernel.gluon import launch as gluon_launch
from fatune.kernel.gluon.family import default_backward, default_forward
from fatune.kernel.codegen import code_hash
from fatune.kernel.problem import AttentionProblem
from fatune.kernel.spec import AttentionConfig, GluonBackwardConfig, GluonConfig, KernelSpec
from fatune.kernel.triton.heuristics import default_config
from fatune.kernel.triton.launch import KernelBuildError
from fatune.runtime import dispatch
from fatune.runtime.dispatch import Dispatcher
from tests.conftest import DEVICE, use_dispatcher
from tests.reference import random_qkv, run_and_compare, stable_seed
from tests.test_codegen import _compile_in_subprocess as compile_in_subprocess

# (spec, config, spilled bytes allowed): the structural variants CI compiles (each ~10 s of ptxas on one core).
# Three consumer warpgroups get 160 registers each, short of two 64x128 score tiles in flight: ptxas spills a
# little (an H100 still ran it at 0.96-0.98x cuDNN's forward, two warpgroups without spills at 0.92x)
COMPILED = [
    (KernelSpec("bfloat16", 128), GluonConfig(block_n=128, num_stages=2), 0),
    (KernelSpec("float16", 64, causal=True), GluonConfig(block_n=128, num_stages=3), 0),
    (KernelSpec("bfloat16", 256, causal=True, bottom_right=True), GluonConfig(block_n=64, num_stages=2), 0),
    (KernelSpec("bfloat16", 64), GluonConfig(block_n=128, num_stages=2, consumers=3, consumer_regs=160, maxnreg=128),
     256),
    # the smallest register split the search draws for two warpgroups, with a one-deep ring of 64-key tiles
    (KernelSpec("float16", 128, causal=True), GluonConfig(block_n=64, num_stages=1, consumer_regs=160), 0),
    (KernelSpec("bfloat16", 96, causal=True), GluonConfig(block_n=128, num_stages=2), 0),  # runs at width 128
    # sliding windows: causal with a left edge, and a band with both edges
    (KernelSpec("bfloat16", 128, causal=True, window_left=True, bottom_right=True), GluonConfig(128, 2), 0),
    (KernelSpec("float16", 64, window_left=True, window_right=True, bottom_right=True), GluonConfig(64, 3), 0),
    # one step after the other: no overlap to check, and no spills even with three consumer warpgroups
    (KernelSpec("bfloat16", 64), GluonConfig(128, 2, consumers=3, consumer_regs=160, overlap=0), 0),
    (KernelSpec("bfloat16", 256, causal=True), GluonConfig(64, 2, overlap=0), 0),
    # ping-pong: the consumers take turns issuing their products, each still overlapping its own softmax
    (KernelSpec("bfloat16", 128, causal=True), GluonConfig(128, 2, pingpong=1), 0),
    # key lengths: each program makes its sequence's K and V descriptors, ending at its length
    (KernelSpec("float16", 96, causal=True, window_left=True, bottom_right=True, seqlens="seqlens_k"),
     GluonConfig(128, 2), 0),
    (KernelSpec("float16", 64, causal=True, seqlens="seqlens_k"),
     GluonConfig(64, 2, consumers=3, consumer_regs=160, pingpong=1), 64),
    # packed sequences: each program makes its sequence's Q, K, V and O descriptors
    (KernelSpec("bfloat16", 128, causal=True, window_left=True, bottom_right=True, seqlens="varlen"),
     GluonConfig(128, 2), 0),
    # ALiBi: every score carries its bias
    (KernelSpec("bfloat16", 128, causal=True, alibi=True), GluonConfig(128, 2), 0),
    # persistent: one program per multiprocessor takes query tiles in turn (with ping-pong's turns counted over them)
    (KernelSpec("bfloat16", 128, causal=True), GluonConfig(128, 2, persistent=1), 0),
    (KernelSpec("bfloat16", 128), GluonConfig(128, 3, pingpong=1, persistent=1), 0),
    # the built-in configs without a mask (persistent): 64-key tiles at d256, three deep at d96 (near 227 KiB)
    (KernelSpec("bfloat16", 256), default_forward(KernelSpec("bfloat16", 256)), 0),
    (KernelSpec("float16", 96), default_forward(KernelSpec("float16", 96)), 0),
]


@pytest.mark.parametrize("spec, config, spills_allowed", COMPILED,
                         ids=[f"{s.dtype}-d{s.head_dim}-{s.mask_variant}-{c}" for s, c, _ in COMPILED])
def test_forward_compiles_for_sm90_without_spills_and_overlaps_softmax(spec, config, spills_allowed, tmp_path):
    """ptxas and cuobjdump ship in Triton's wheel: the forward compiles for sm_90a here. Its SASS keeps each
    consumer's exponentials (MUFU.EX2) between the wait that retires S_j and the one that retires P_{j-1} V_{j-1}:
    the softmax runs under the tensor cores (a new ptxas that hoisted the waits would fail this)."""
    script = (
        "import json\n"
        "from fatune.kernel.gluon.offline import compile_forward\n"
        "from fatune.kernel.spec import GluonConfig, KernelSpec\n"
        f"c = compile_forward(KernelSpec(**{spec.to_dict()!r}), GluonConfig.from_dict({config.to_dict()!r}))\n"
        "print(json.dumps([c.shared_bytes, c.spill_bytes, c.softmax_under_products, c.sass]))\n"
    )
    shared, spills, overlapped, sass = json.loads(compile_in_subprocess(script, tmp_path).splitlines()[-1])
    assert spills <= spills_allowed
    assert shared <= 232448  # sm_90's 227 KiB per block
    assert 0 <= resources.shared_memory_bytes(spec, config) - shared <= 1024  # the search's model: an upper bound
    assert overlapped >= config.consumers if config.overlap else overlapped == 0, sass


def test_the_registry_names_both_families_and_a_config_its_own():
    spec = KernelSpec("bfloat16", 128)
    triton_config = default_config(spec, (9, 0))
    gluon_config = triton_config.replace(fwd=GluonConfig())
    assert triton_config.family == "triton" and gluon_config.family == "gluon"
    assert AttentionConfig.from_dict(gluon_config.to_dict()) == gluon_config
    assert family("gluon").serves(spec, torch.device("cpu")) is not None  # Hopper only
    hashes = family("gluon").kernel_hashes(spec, gluon_config, False).split(",")
    assert sum(h.startswith("fwd:") for h in hashes) == 1 and any(h.startswith("bwd:") for h in hashes)
    assert "templates/gluon/attn_fwd.py.jinja" in family("gluon").render("fwd", spec, gluon_config)


# (spec, batch, heads, K/V heads, seqlen_q, seqlen_k, arch, Gluon forward?, Gluon backward?): where the built-in
# config takes the Gluon kernels, as an H100 measured them against the Triton family's heuristic kernels
BUILTIN = [
    # d128: the backward from 4k keys, causal or not
    (KernelSpec("bfloat16", 128), 4, 16, 16, 4096, 4096, (9, 0), True, True),
    (KernelSpec("bfloat16", 128), 16, 16, 16, 1024, 1024, (9, 0), True, False),
    (KernelSpec("bfloat16", 128, causal=True), 4, 16, 16, 4096, 4096, (9, 0), True, True),
    (KernelSpec("float16", 128, causal=True), 16, 16, 16, 1024, 1024, (9, 0), True, False),
    (KernelSpec("bfloat16", 96), 8, 16, 16, 2048, 2048, (9, 0), True, False),
    (KernelSpec("bfloat16", 256, causal=True), 16, 8, 8, 1024, 1024, (9, 0), True, True),
    (KernelSpec("bfloat16", 192), 2, 8, 8, 8192, 8192, (9, 0), True, True),
    (KernelSpec("bfloat16", 64), 4, 32, 32, 4096, 4096, (9, 0), True, False),
    (KernelSpec("bfloat16", 64), 16, 32, 32, 1024, 1024, (9, 0), False, False),
    (KernelSpec("float16", 64, causal=True), 16, 32, 32, 1024, 1024, (9, 0), False, False),
    (KernelSpec("float16", 64, causal=True), 4, 32, 32, 4096, 4096, (9, 0), True, True),
    (KernelSpec("bfloat16", 48, causal=True), 1, 32, 32, 16384, 16384, (9, 0), True, True),
    (KernelSpec("bfloat16", 64, causal=True, bottom_right=True), 16, 32, 32, 512, 16384, (9, 0), True, False),
    # grouped query heads: the forward as without them; the backward sums the group in a program (not measured)
    (KernelSpec("bfloat16", 256, causal=True), 4, 32, 8, 4096, 4096, (9, 0), True, False),
    # too few programs to fill the GPU (a chunked prefill: the Triton forward splits its keys), and decode
    (KernelSpec("bfloat16", 128, causal=True, bottom_right=True), 4, 32, 8, 128, 8192, (9, 0), False, False),
    (KernelSpec("bfloat16", 256), 1, 8, 8, 2048, 2048, (9, 0), False, False),
    (KernelSpec("bfloat16", 128), 8, 32, 8, 1, 8192, (9, 0), False, False),
    (KernelSpec("bfloat16", 256), 16, 16, 16, 4096, 512, (9, 0), False, False),  # few keys: not measured
    # windows, key lengths and packed sequences: the forward above d64, never the backward
    (KernelSpec("bfloat16", 256, causal=True, window_left=True), 2, 8, 8, 8192, 8192, (9, 0), True, False),
    (KernelSpec("bfloat16", 128, seqlens="seqlens_k"), 2, 16, 16, 8192, 8192, (9, 0), True, False),
    (KernelSpec("bfloat16", 128, causal=True, seqlens="varlen"), 2, 16, 16, 8192, 8192, (9, 0), True, False),
    (KernelSpec("bfloat16", 64, causal=True, window_left=True), 2, 32, 32, 8192, 8192, (9, 0), False, False),
    # ALiBi (not measured), tensors, dtypes and GPUs the Gluon kernels do not take, the interpreter
    (KernelSpec("bfloat16", 256, alibi=True), 2, 8, 8, 8192, 8192, (9, 0), False, False),
    (KernelSpec("bfloat16", 256, attn_mask="additive"), 2, 8, 8, 8192, 8192, (9, 0), False, False),
    (KernelSpec("float32", 256), 2, 8, 8, 8192, 8192, (9, 0), False, False),
    (KernelSpec("bfloat16", 256), 2, 8, 8, 8192, 8192, (8, 0), False, False),
    (KernelSpec("bfloat16", 256), 2, 8, 8, 8192, 8192, (10, 0), False, False),
    (KernelSpec("float16", 256), 2, 8, 8, 8192, 8192, None, False, False),
]


@pytest.mark.parametrize("spec, batch, heads, kv_heads, seqlen_q, seqlen_k, arch, forward, backward", BUILTIN)
def test_the_builtin_config_takes_the_gluon_kernels_where_they_measured_faster(spec, batch, heads, kv_heads, seqlen_q,
                                                                                seqlen_k, arch, forward, backward):
    problem = AttentionProblem(spec, batch, heads, kv_heads, seqlen_q, seqlen_k, seqlen_q, seqlen_k, 0.125)
    config = builtin_config(problem, arch, 132)
    triton = family("triton").heuristic(problem, arch, 132)
    assert config.gluon_forward == forward and config.gluon_backward == backward
    assert config.fwd == (default_forward(spec) if forward else triton.fwd)
    assert config.dkdv == (default_backward(spec) if backward else triton.dkdv)
    assert config.dq == triton.dq
    assert config.family == ("gluon" if forward or backward else "triton")


@pytest.mark.parametrize("head_dim, causal, forward, backward", [(128, False, True, False), (256, True, True, True)])
def test_the_builtin_configs_calls_run_where_a_gluon_kernel_cannot_build(monkeypatch, tmp_path, poison_outputs,
                                                                           head_dim, causal, forward, backward):
    """On Hopper the built-in config takes the Gluon kernels alone or mixes the families (a Gluon forward beside
    the Triton backward): its calls run end to end, and where a Gluon kernel cannot be built (here: no GPU) the
    Triton family's kernels take its part with the accuracy rule's result. (The GPU's arch and multiprocessors are
    patched, and the fewest keys lowered, so that a shape the interpreter runs quickly takes the Gluon kernels.)"""
    monkeypatch.setattr(dispatch, "device_arch", lambda device: (9, 0))
    monkeypatch.setattr(dispatch, "sm_count", lambda device: 1)
    monkeypatch.setattr(gluon_family, "MIN_KEYS", 64)
    use_dispatcher(monkeypatch, Dispatcher(user_db=tmp_path / "none.sqlite", shipped=[]))
    q, k, v = random_qkv(2, 2, 2, 200, 200, head_dim, head_dim, dtype=torch.float16, device=DEVICE)
    config = fatune.explain(q, k, v, is_causal=causal).decision.config
    assert (config.gluon_forward, config.gluon_backward) == (forward, backward)
    run_and_compare(q, k, v, is_causal=causal)


@pytest.mark.parametrize("m_tiles, heads", [(8, 256), (32, 64), (32, 128), (16, 128), (128, 16), (8, 1024), (3, 47)])
def test_the_persistent_causal_walk_keeps_few_heads_in_flight_and_the_programs_even(m_tiles, heads):
    """The persistent causal forward's tile order (the template's own tile_of, run as Python): every tile once;
    the tiles in flight together (one per program) span few heads, whose K and V can then stay in L2 (the
    longest-first order over every head spanned one head per program, and the persistent causal forward measured
    8-35% slower at L 1k with it on an H100); and each program's share of key tiles stays within 10% of the mean,
    as with that order."""
    from fatune.kernel.gluon import codegen

    tile_of = codegen.load(KernelSpec("bfloat16", 128, causal=True), GluonConfig(128, 2, persistent=1)).tile_of.fn
    programs = 132
    tiles = [tile_of(t, m_tiles, heads, programs) for t in range(m_tiles * heads)]
    assert sorted(tiles) == [(m, h) for m in range(m_tiles) for h in range(heads)]
    work = [sum(tiles[t][0] + 1 for t in range(p, len(tiles), programs)) for p in range(programs)]
    assert max(work) <= 1.1 * sum(work) / programs or m_tiles * heads < 4 * programs
    in_flight = [len({h for _, h in tiles[start:start + programs]}) for start in range(0, len(tiles), programs)]
    assert max(in_flight) <= max(2 * programs // m_tiles + 2, 1) * 2


def _mixed(spec: KernelSpec) -> AttentionConfig:
    """A built-in config of Hopper that pairs the Gluon forward with the Triton backward."""
    return default_config(spec, (9, 0)).replace(fwd=default_forward(spec))


def test_a_stale_triton_entry_falls_back_to_the_triton_kernels_of_a_mixed_builtin_config(poison_outputs):
    """A tuned Triton entry whose kernels changed since it was measured runs the built-in config instead; where that
    pairs a Gluon forward with the Triton backward, the Triton plan takes the Triton heuristic's forward in the
    Gluon one's place, said in its build_failure, with the right result."""
    torch.manual_seed(3)
    q, k, v = random_qkv(1, 2, 2, 100, 100, 128, 128, dtype=torch.float16, device=DEVICE)
    problem = check_inputs(q, k, v)
    tuned = default_config(problem.spec, None)
    plan = family("triton").plan(problem, tuned, q.device, q, k, v, _mixed(problem.spec), frozenset({"fwd:stale"}))
    out, _ = plan.forward(q, k, v)
    assert "changed since" in plan.build_failure and plan.config.family == "triton"
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=0)


def test_a_gluon_plan_says_why_any_part_of_its_call_runs_other_kernels_and_strict_mode_raises():
    """A Gluon kernel that cannot run here (no GPU) hands its part to the Triton kernels, and the plan's
    build_failure says so; in strict mode the plan raises instead."""
    q, k, v = random_qkv(1, 2, 2, 64, 64, 64, 64, dtype=torch.float16, device=DEVICE)
    problem = check_inputs(q, k, v)
    plan = family("gluon").plan(problem, _mixed(problem.spec), q.device, q, k, v, None, None)
    assert "does not run here" in plan.build_failure
    with pytest.raises(KernelBuildError, match="strict mode") as error:
        family("gluon").plan(problem, _mixed(problem.spec), q.device, q, k, v, None, None, strict=True)
    assert "does not run here" in str(error.value) and "Triton forward runs" not in str(error.value)  # none does


def test_a_group_split_backward_whose_grid_would_exceed_cudas_rows_runs_the_triton_one(monkeypatch):
    """The group split multiplies the backward's grid rows (batch x K/V heads) by its parts: where that passes
    CUDA's limit the Triton backward runs, said in build_failure, never a launch that fails."""
    monkeypatch.setattr(gluon_launch, "backward_unserved", lambda spec, device: None)
    monkeypatch.setattr(gluon_launch, "tma_readable", lambda *args, **kwargs: True)
    q, k, v = random_qkv(4, 8, 2, 1, 1, 64, 64, dtype=torch.float16, device=DEVICE)
    problem = check_inputs(q, k, v, enable_gqa=True)
    monkeypatch.setattr(gluon_launch, "MAX_GRID_Y", problem.batch * problem.kv_heads * 2)
    for parts, fits in ((2, True), (4, False)):
        config = default_config(problem.spec, (9, 0)).replace(dkdv=GluonBackwardConfig(group_split=parts))
        plan = family("gluon").plan(problem, config, q.device, q, k, v, None, None)
        assert ("group parts) programs exceed a grid's" in (plan.build_failure or "")) != fits, plan.build_failure


def test_the_builtin_decision_follows_the_batch_under_one_db_key(tmp_path, monkeypatch):
    """Batch sizes share a DB key, but the built-in config takes the Gluon kernels only on grids that fill the GPU:
    each batch gets its own memoised decision."""
    monkeypatch.setattr(dispatch, "device_arch", lambda device: (9, 0))
    monkeypatch.setattr(dispatch, "sm_count", lambda device: 132)
    chooser = Dispatcher(user_db=tmp_path / "none.sqlite", shipped=[])
    decided = []
    for batch in (1, 64, 1):
        q = torch.empty(batch, 16, 4096, 128, dtype=torch.bfloat16, device="meta")
        decision = chooser.decide(check_inputs(q, q, q), torch.device("cpu"))
        decided.append((decision.config.gluon_forward, decision.config.gluon_backward))
    assert decided == [(False, False), (True, True), (False, False)]


@pytest.mark.parametrize("seqlen_q, forward", [(1, False), (16, False), (17, True), (4096, True)])
def test_the_familys_heuristic_leaves_decode_to_the_triton_forward(seqlen_q, forward):
    """Tuning on first use times each family's heuristic: the Gluon family's takes the Triton forward at decode."""
    q = torch.empty(4, 16, seqlen_q, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(4, 16, 4096, 128, dtype=torch.bfloat16, device="meta")
    config = family("gluon").heuristic(check_inputs(q, k, k), (9, 0), 132)
    assert config.gluon_forward == forward and config.gluon_backward


def test_a_gluon_forward_does_not_change_which_kernels_tuning_gain_compares():
    from fatune.bench.tuning_gain import same_kernels
    from fatune.tuning.shape import Shape

    shape = Shape(4, 16, 4096, 4096, 128, "bfloat16")
    mixed = _mixed(shape.spec)
    assert same_kernels(shape, mixed, mixed) and not same_kernels(shape, mixed, default_config(shape.spec, (9, 0)))


# (batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim): odd lengths, GQA, L_q != L_k; head dims between the
# compiled widths (d96 and d80 run at 128, d192 at 256, d40 at 64); one query per sequence (decode: the family's
# heuristic takes it, which tuning on first use times)
GPU_SHAPES = [(2, 4, 4, 300, 300, 64), (1, 8, 2, 257, 513, 128), (2, 2, 2, 1000, 777, 128), (1, 4, 1, 129, 129, 256),
              (1, 2, 2, 64, 4096, 128), (1, 4, 2, 333, 333, 96), (1, 2, 2, 200, 301, 192), (2, 2, 1, 150, 150, 80),
              (1, 2, 2, 97, 97, 40), (4, 8, 2, 1, 1000, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", ["default", "64-key", "sequential", "pingpong", "persistent"])
@pytest.mark.parametrize("causal, alignment", [(False, None), (True, "top_left"), (True, "bottom_right")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_gluon_forward_matches_reference(shape, dtype, causal, alignment, tiles, poison_outputs, record_gpu_errors):
    """The family's own config, 64-key tiles three deep (d256: two), and its config without the softmax overlap
    and with ping-pong; forward and gradients."""
    batch, heads, kv_heads, lq, lk, d = shape
    torch.manual_seed(stable_seed(shape, dtype, causal, alignment))
    q, k, v = random_qkv(batch, heads, kv_heads, lq, lk, d, d, dtype=dtype, device="cuda")
    spec = KernelSpec(dtype, d, causal=causal, bottom_right=alignment == "bottom_right")
    forward = {"default": default_forward(spec), "sequential": dataclasses.replace(default_forward(spec), overlap=0),
               "pingpong": dataclasses.replace(default_forward(spec), pingpong=1),
               "64-key": GluonConfig(block_n=64, num_stages=2 if d > 128 else 3),
               "persistent": dataclasses.replace(default_forward(spec), persistent=1)}[tiles]
    assert family("gluon").serves(spec, q.device) is None
    config = default_config(spec, (9, 0)).replace(fwd=forward)
    kwargs = {"is_causal": causal, "enable_gqa": kv_heads != heads, "config": config}
    if alignment is not None:
        kwargs["causal_alignment"] = alignment
    explained = fatune.explain(q, k, v, **{key: value for key, value in kwargs.items()})
    assert explained.launched.family == "gluon", explained
    record_gpu_errors(run_and_compare(q, k, v, **kwargs))


# (batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal alignment, window, ALiBi, ping-pong): more query
# tiles than an H100 or H200 has multiprocessors, so each persistent program takes several, heads and tile
# lengths changing between them (causal: the longest tiles first, over every head)
PERSISTENT = [(4, 16, 16, 1000, 1000, 128, None, None, False, 0), (2, 32, 8, 1100, 1100, 64, "top_left", None, False, 1),
              (3, 16, 4, 777, 1200, 128, "bottom_right", None, True, 0), (2, 16, 16, 1500, 1500, 256, "top_left", None, False, 0),
              (4, 8, 8, 1300, 1300, 96, "bottom_right", (200, 0), False, 1), (5, 8, 2, 900, 900, 128, None, (64, 64), True, 0)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", PERSISTENT, ids=lambda c: "x".join(map(str, c[:6])) + f"-{c[6]}-w{c[7]}-a{c[8]}-p{c[9]}")
def test_gpu_persistent_gluon_forward_takes_several_tiles_per_program(case, dtype, poison_outputs, record_gpu_errors):
    batch, heads, kv_heads, lq, lk, d, alignment, window, alibi, pingpong = case
    torch.manual_seed(stable_seed(case, dtype))
    q, k, v = random_qkv(batch, heads, kv_heads, lq, lk, d, d, dtype=dtype, device="cuda")
    kwargs = {"is_causal": alignment is not None, "enable_gqa": kv_heads != heads}
    if alignment is not None:
        kwargs["causal_alignment"] = alignment
    if window is not None:
        kwargs["window_size"] = window
    if alibi:
        kwargs["alibi_slopes"] = torch.rand(heads, device="cuda") * 0.5
    spec = fatune.explain(q, k, v, **kwargs).spec
    forward = dataclasses.replace(default_forward(spec), persistent=1, pingpong=pingpong)
    config = default_config(spec, (9, 0)).replace(fwd=forward)
    tiles = batch * heads * -(-lq // forward.block_m)
    assert tiles > 2 * torch.cuda.get_device_properties(0).multi_processor_count
    assert fatune.explain(q, k, v, config=config, **kwargs).launched.gluon_forward
    record_gpu_errors(run_and_compare(q, k, v, config=config, **kwargs))


# (batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, window_size, is_causal): windows narrower and wider than a
# tile, both edges, L_q != L_k (a window aligns bottom-right)
WINDOWED = [(2, 4, 2, 333, 333, 128, (100, 0), True), (1, 2, 2, 200, 517, 64, (256, 0), True),
            (1, 4, 4, 300, 300, 128, (31, 17), False), (1, 2, 1, 129, 77, 256, (64, 64), False),
            (2, 2, 2, 257, 257, 96, (0, 0), True)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", WINDOWED, ids=lambda c: "x".join(map(str, c[:6])) + f"-w{c[6][0]}.{c[6][1]}")
def test_gpu_gluon_forward_with_a_sliding_window(case, dtype, poison_outputs, record_gpu_errors):
    batch, heads, kv_heads, lq, lk, d, window, causal = case
    torch.manual_seed(stable_seed(case, dtype))
    q, k, v = random_qkv(batch, heads, kv_heads, lq, lk, d, d, dtype=dtype, device="cuda")
    kwargs = {"is_causal": causal, "window_size": window, "enable_gqa": kv_heads != heads}
    problem = fatune.explain(q, k, v, **kwargs)
    config = default_config(problem.spec, (9, 0)).replace(fwd=default_forward(problem.spec))
    explained = fatune.explain(q, k, v, config=config, **kwargs)
    assert explained.launched.family == "gluon", explained
    record_gpu_errors(run_and_compare(q, k, v, config=config, **kwargs))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("slopes", ["per-head", "per-batch"])
@pytest.mark.parametrize("causal, alignment", [(False, None), (True, "top_left"), (True, "bottom_right")])
@pytest.mark.parametrize("shape", [(2, 4, 2, 300, 300, 128), (1, 4, 4, 129, 333, 64), (2, 2, 1, 257, 100, 96)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gpu_gluon_forward_with_alibi(shape, causal, alignment, slopes, dtype, poison_outputs, record_gpu_errors):
    """ALiBi slopes of shape (H,) or (B, H): the Gluon forward adds the bias to every score, the Triton backward
    after it reads the same LSE."""
    batch, heads, kv_heads, lq, lk, d = shape
    torch.manual_seed(stable_seed(shape, causal, alignment, slopes, dtype))
    q, k, v = random_qkv(batch, heads, kv_heads, lq, lk, d, d, dtype=dtype, device="cuda")
    alibi = torch.rand(heads if slopes == "per-head" else (batch, heads), device="cuda") * 0.5
    kwargs = {"is_causal": causal, "enable_gqa": kv_heads != heads, "alibi_slopes": alibi}
    if alignment is not None:
        kwargs["causal_alignment"] = alignment
    spec = fatune.explain(q, k, v, **kwargs).spec
    config = default_config(spec, (9, 0)).replace(fwd=default_forward(spec))
    assert fatune.explain(q, k, v, config=config, **kwargs).launched.family == "gluon"
    record_gpu_errors(run_and_compare(q, k, v, config=config, **kwargs))


def _unwritten_cache(d, causal, window, dtype, seed):
    """(q, k, v, lengths, kwargs) of 4 sequences of 200 queries against up to 333 keys, of lengths 0, 1, ragged and
    full, whose keys and values past each length hold NaN (an unwritten cache)."""
    torch.manual_seed(seed)
    q, k, v = random_qkv(4, 4, 2, 200, 333, d, d, dtype=dtype, device="cuda")
    lengths = torch.tensor([0, 1, 150, 333], dtype=torch.int32, device="cuda")
    for tensor in (k, v):
        with torch.no_grad():
            for b, n in enumerate(lengths.tolist()):
                tensor[b, :, n:] = float("nan")
    kwargs = {"is_causal": causal, "enable_gqa": True, "seqlens_k": lengths}
    if window is not None:
        kwargs["window_size"] = window
    return q, k, v, lengths, kwargs


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, (64, 0))])
@pytest.mark.parametrize("d", [64, 128, 96])
@pytest.mark.parametrize("pingpong", [0, 1])
def test_gpu_gluon_forward_with_key_lengths_never_reads_past_them(d, causal, window, pingpong, dtype, poison_outputs,
                                                                  record_gpu_errors):
    """Keys past each sequence's length hold NaN (an unwritten cache): the forward never reads them (its K and V
    descriptors end there) and meets the accuracy rule; lengths 0, 1, ragged and full."""
    q, k, v, lengths, kwargs = _unwritten_cache(d, causal, window, dtype, stable_seed(d, causal, window, dtype))
    spec = fatune.explain(q, k, v, **kwargs).spec
    config = default_config(spec, (9, 0)).replace(fwd=dataclasses.replace(default_forward(spec), pingpong=pingpong))
    explained = fatune.explain(q, k, v, config=config, **kwargs)
    assert explained.launched.family == "gluon", explained
    out = fatune.attention(q, k, v, config=config, **kwargs)
    assert torch.isfinite(out).all()
    clean = [t.detach().nan_to_num(0.0).requires_grad_() for t in (k, v)]
    record_gpu_errors(run_and_compare(q, *clean, config=config, **kwargs))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, (100, 0))])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_gluon_forward_of_packed_sequences(d, causal, window, dtype, poison_outputs, record_gpu_errors):
    """Packed (tokens, H, D) sequences of unequal lengths (one of a single token, empty ones in the middle and
    last, L_q != L_k): each program reads and writes its sequence's rows alone."""
    from tests.test_variants import _packed

    lengths_q, lengths_k = [1, 0, 300, 129, 64, 777, 0], [5, 3, 300, 333, 64, 700, 7]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 4, 2, d, d, dtype=dtype, seed=stable_seed(d, causal, dtype))
    q, k, v = (t.detach().cuda().requires_grad_() for t in (q, k, v))
    kwargs = {"cu_seqlens_q": cu_q.cuda(), "cu_seqlens_k": cu_k.cuda(), "is_causal": causal, "enable_gqa": True}
    if window is not None:
        kwargs["window_size"] = window
    spec = fatune.explain(q, k, v, **kwargs).spec
    config = default_config(spec, (9, 0)).replace(fwd=default_forward(spec))
    explained = fatune.explain(q, k, v, config=config, **kwargs)
    assert explained.launched.family == "gluon", explained
    record_gpu_errors(run_and_compare(q, k, v, config=config, **kwargs))


# (spec, backward config, spilled bytes allowed): the backward's structural variants CI compiles. Two consumer
# warpgroups of 64 keys hold dK and dV (64 + 64 registers each at d128) beside S^T and dP^T: ptxas spills a little
# at d128, more under a band (its masks, and a second loop with the two-part dS)
COMPILED_BACKWARD = [
    (KernelSpec("bfloat16", 64), GluonBackwardConfig(), 0),
    (KernelSpec("float16", 64, causal=True, bottom_right=True), GluonBackwardConfig(num_stages=3), 0),
    (KernelSpec("bfloat16", 128), GluonBackwardConfig(), 128),
    (KernelSpec("bfloat16", 128, causal=True), GluonBackwardConfig(), 384),
    (KernelSpec("float16", 96, window_left=True, window_right=True, bottom_right=True),
     GluonBackwardConfig(dq_slice=128), 512),
    (KernelSpec("bfloat16", 128, causal=True, alibi=True), GluonBackwardConfig(), 384),
    # key lengths: the producer makes its sequence's K and V descriptors
    (KernelSpec("bfloat16", 128, causal=True, bottom_right=True, seqlens="seqlens_k"), GluonBackwardConfig(), 384),
    # packed sequences: descriptors over each sequence's rows (the family's default under a left window)
    (KernelSpec("bfloat16", 128, causal=True, seqlens="varlen"), GluonBackwardConfig(), 384),
    (KernelSpec("float16", 128, causal=True, window_left=True, bottom_right=True, seqlens="varlen"),
     default_backward(KernelSpec("float16", 128, causal=True, window_left=True, seqlens="varlen")), 512),
    # a head-dim split at 256 lanes: two consumers share each key tile, each owning 128 lanes of dK, dV and dQ
    (KernelSpec("bfloat16", 256), default_backward(KernelSpec("bfloat16", 256)), 768),
    (KernelSpec("bfloat16", 256, causal=True), default_backward(KernelSpec("bfloat16", 256)), 1024),
    # two stages deep at 256 lanes: dQ in 32-lane slices leaves the second Q and dO buffers room
    (KernelSpec("bfloat16", 256), GluonBackwardConfig(num_stages=2, dq_slice=32), 768),
    # shared dQ: both consumers' dS in two slots, each consumer adding up half of dQ's lanes over all 128 keys
    (KernelSpec("bfloat16", 128, causal=True), GluonBackwardConfig(shared_dq=1), 384),
    (KernelSpec("bfloat16", 128), default_backward(KernelSpec("bfloat16", 128)), 384),  # the built-in d128 backward
    # the group split: four programs per key tile sum parts of the group, dK and dV added up by float32 atomics
    (KernelSpec("bfloat16", 128, causal=True), GluonBackwardConfig(group_split=4), 384),
    (KernelSpec("float16", 256, causal=True), GluonBackwardConfig(num_stages=1, dq_slice=128, group_split=2), 1024),
]


@pytest.mark.parametrize("spec, config, spills_allowed", COMPILED_BACKWARD,
                         ids=[f"{s.dtype}-d{s.head_dim}-{s.mask_variant}-{c}" for s, c, _ in COMPILED_BACKWARD])
def test_backward_compiles_for_sm90_within_its_budgets(spec, config, spills_allowed, tmp_path):
    """The Gluon backward compiles for sm_90a here; it fits shared memory (the search's model an upper bound),
    spills at most a little, and ptxas serializes none of its products (no C751x warnings)."""
    script = (
        "import json\n"
        "from fatune.kernel.gluon.offline import compile_backward\n"
        "from fatune.kernel.spec import GluonBackwardConfig, KernelSpec\n"
        f"c = compile_backward(KernelSpec(**{spec.to_dict()!r}), GluonBackwardConfig.from_dict({config.to_dict()!r}))\n"
        "print(json.dumps([c.shared_bytes, c.spill_bytes, c.ptxas_warnings]))\n"
    )
    shared, spills, warnings = json.loads(compile_in_subprocess(script, tmp_path).splitlines()[-1])
    assert spills <= spills_allowed
    assert shared <= 232448
    assert 0 <= resources.backward_shared_memory_bytes(spec, config) - shared <= 1024
    assert not warnings


# (spec, backward config): backwards Triton 3.6's ptxas crashed on (exit -11) while every program ran one loop with
# the two-part dS in its registers (causal d96/d128, three stages, 64-lane dQ, 232+ registers; at 256 lanes under a
# band while each consumer of a key tile stored its own dS), and neighbours: all compile now, but under ALiBi,
# whose kernel keeps one loop (backward_uncompilable names those)
PTXAS_CRASH = [
    (KernelSpec("bfloat16", 128, causal=True, bottom_right=True, alibi=True), GluonBackwardConfig(num_stages=3)),
    (KernelSpec("bfloat16", 128, causal=True), GluonBackwardConfig(num_stages=3)),
    (KernelSpec("float16", 96, causal=True, bottom_right=True), GluonBackwardConfig(num_stages=3, consumer_regs=232)),
    (KernelSpec("bfloat16", 128, causal=True), GluonBackwardConfig(num_stages=3, consumer_regs=216)),
    (KernelSpec("bfloat16", 128, causal=True, bottom_right=True, alibi=True),
     GluonBackwardConfig(num_stages=3, consumer_regs=216)),
    (KernelSpec("bfloat16", 128), GluonBackwardConfig(num_stages=3)),
    (KernelSpec("bfloat16", 256, causal=True), GluonBackwardConfig(num_stages=1, consumer_regs=224)),
    (KernelSpec("bfloat16", 192, causal=True), GluonBackwardConfig(num_stages=1)),
]


def test_the_backwards_ptxas_crashes_on_are_known_before_compiling(tmp_path):
    """A search rejects the Gluon backward configs Triton 3.6's ptxas crashes on (exit -11) before compiling them:
    backward_uncompilable names exactly the cases whose compile fails. One process compiles them all."""
    script = "\n".join([
        "from fatune.kernel.gluon.offline import compile_backward",
        "from fatune.kernel.spec import GluonBackwardConfig, KernelSpec",
        "cases = [" + ", ".join(f"(KernelSpec(**{spec.to_dict()!r}), "
                               f"GluonBackwardConfig.from_dict({config.to_dict()!r}))" for spec, config in PTXAS_CRASH)
        + "]",
        "for spec, config in cases:",
        "    try:",
        "        compile_backward(spec, config)",
        "        print('compiles')",
        "    except Exception as error:",
        "        print('fails', type(error).__name__)",
    ])
    outcomes = [line for line in compile_in_subprocess(script, tmp_path).splitlines()
                if line.startswith(("compiles", "fails"))]
    expected = ["fails PTXASError" if resources.backward_uncompilable(spec, config) else "compiles"
                for spec, config in PTXAS_CRASH]
    assert outcomes == expected == ["fails PTXASError"] + ["compiles"] * (len(PTXAS_CRASH) - 1)
    assert resources.backward_infeasible(*PTXAS_CRASH[0], 227 * 1024)


def test_the_group_split_is_stored_only_where_it_splits_and_renders_only_there():
    """A backward config without the group split stores and renders as before the field existed (the shipped
    entries' kernel hashes stay current); with it, the programs of a key tile sum parts of the group into float32
    sums by atomics."""
    spec = KernelSpec("bfloat16", 128, causal=True)
    plain, split = GluonBackwardConfig(), GluonBackwardConfig(group_split=4)
    assert "group_split" not in plain.to_dict() and split.to_dict()["group_split"] == 4
    assert GluonBackwardConfig.from_dict(split.to_dict()) == split and str(split).endswith("/g4")
    assert GluonBackwardConfig.from_dict(plain.to_dict()) == plain and "/g" not in str(plain)
    with pytest.raises(ValueError, match="group_split: expected one of"):
        GluonBackwardConfig(group_split=3)
    source, parted = (family("gluon").render("bwd", spec, default_config(spec, (9, 0)).replace(dkdv=config))
                      for config in (plain, split))
    assert "GROUP_PARTS" not in source and "atomic_add" not in source
    assert "GROUP_PARTS = gl.constexpr(4)" in parted and parted.count("gl.atomic_add(") == 2
    assert "for i in range(heads * tiles):" in parted and "for i in range(GROUP * tiles):" in source


def test_a_gluon_backward_config_round_trips_and_names_its_kernels():
    spec = KernelSpec("bfloat16", 128, causal=True)
    config = default_config(spec, (9, 0)).replace(dkdv=GluonBackwardConfig(block_m=64, num_stages=3))
    assert config.family == "gluon" and config.gluon_backward and not config.gluon_forward
    assert AttentionConfig.from_dict(config.to_dict()) == config
    hashes = family("gluon").kernel_hashes(spec, config, False).split(",")
    gluon_bwd = f"bwd:{code_hash(family('gluon').render('bwd', spec, config))}"
    assert gluon_bwd in hashes and any(h.startswith("fwd:") for h in hashes)
    assert "templates/gluon/attn_bwd.py.jinja" in family("gluon").render("bwd", spec, config)
    with pytest.raises(ValueError, match="consumer_regs"):
        GluonBackwardConfig(consumers=3, consumer_regs=240)
    with pytest.raises(ValueError, match="fwd: a Gluon config runs the forward"):
        AttentionConfig(fwd=GluonBackwardConfig(), dkdv=config.dkdv, dq=config.dq)
    with pytest.raises(ValueError, match="shared_dq: expected one of"):
        GluonBackwardConfig(shared_dq=2)
    persistent = GluonConfig(persistent=1)
    assert GluonConfig.from_dict(persistent.to_dict()) == persistent and str(persistent).endswith("/persistent")
    # a persistent program would make a sequence's descriptors again while a copy in flight may read them
    packed = KernelSpec("bfloat16", 128, causal=True, seqlens="varlen")
    assert "persistent" in resources.infeasible(packed, persistent, 232448)
    with pytest.raises(ValueError, match="persistent: "):
        family("gluon").render("fwd", packed, default_config(packed, (9, 0)).replace(fwd=persistent))
    shared = GluonBackwardConfig(shared_dq=1)
    assert GluonBackwardConfig.from_dict(shared.to_dict()) == shared and str(shared).endswith("/shared")
    assert resources.backward_infeasible(spec, shared, 232448) is None
    # three consumers cannot split 128 lanes evenly; at 256 lanes the consumers split the head dim already
    for other, config in ((spec, GluonBackwardConfig(consumers=3, consumer_regs=160, shared_dq=1)),
                          (KernelSpec("bfloat16", 256), GluonBackwardConfig(num_stages=1, shared_dq=1))):
        assert "cannot share dQ" in resources.backward_infeasible(other, config, 232448)
        with pytest.raises(ValueError, match="shared_dq"):
            family("gluon").render("bwd", other, default_config(other, (9, 0)).replace(dkdv=config))


# (batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim): odd lengths, GQA summed in-kernel, L_q != L_k, head
# dims between the compiled widths (d96 runs at 128, d40 at 64), key tiles past the sequence
BACKWARD_SHAPES = [(2, 4, 4, 300, 300, 64), (1, 8, 2, 257, 513, 128), (2, 2, 2, 1000, 777, 128),
                   (1, 4, 2, 333, 333, 96), (1, 2, 1, 129, 70, 40), (1, 2, 2, 64, 1500, 128), (1, 4, 2, 300, 257, 256),
                   (1, 2, 2, 200, 301, 192)]


@pytest.mark.gpu
@pytest.mark.parametrize("forward", ["triton", "gluon"])
@pytest.mark.parametrize("tiles", ["default", "128-query", "three-deep", "shared-dq", "narrow-dq", "group-split"])
@pytest.mark.parametrize("causal, alignment", [(False, None), (True, "top_left"), (True, "bottom_right")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", BACKWARD_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_gluon_backward_matches_reference(shape, dtype, causal, alignment, tiles, forward, poison_outputs,
                                              record_gpu_errors):
    batch, heads, kv_heads, lq, lk, d = shape
    torch.manual_seed(stable_seed(shape, dtype, causal, alignment, tiles))
    q, k, v = random_qkv(batch, heads, kv_heads, lq, lk, d, d, dtype=dtype, device="cuda")
    spec = KernelSpec(dtype, d, causal=causal, bottom_right=alignment == "bottom_right")
    backward = {"default": default_backward(spec), "128-query": GluonBackwardConfig(block_m=128, dq_slice=64),
                "three-deep": GluonBackwardConfig(num_stages=3),
                "shared-dq": dataclasses.replace(default_backward(spec), shared_dq=1),
                "narrow-dq": GluonBackwardConfig(num_stages=2, dq_slice=32),
                "group-split": dataclasses.replace(default_backward(spec), group_split=4)}[tiles]
    if resources.backward_infeasible(spec, backward, 232448):
        pytest.skip(resources.backward_infeasible(spec, backward, 232448))
    config = default_config(spec, (9, 0)).replace(dkdv=backward)
    if forward == "gluon":
        config = config.replace(fwd=default_forward(spec))
    kwargs = {"is_causal": causal, "enable_gqa": kv_heads != heads, "config": config}
    if alignment is not None:
        kwargs["causal_alignment"] = alignment
    explained = fatune.explain(q, k, v, **kwargs)
    assert explained.launched.gluon_backward, explained
    record_gpu_errors(run_and_compare(q, k, v, **kwargs))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", WINDOWED, ids=lambda c: "x".join(map(str, c[:6])) + f"-w{c[6][0]}.{c[6][1]}")
def test_gpu_gluon_backward_with_a_sliding_window(case, dtype, poison_outputs, record_gpu_errors):
    batch, heads, kv_heads, lq, lk, d, window, causal = case
    torch.manual_seed(stable_seed(case, dtype, "backward"))
    q, k, v = random_qkv(batch, heads, kv_heads, lq, lk, d, d, dtype=dtype, device="cuda")
    kwargs = {"is_causal": causal, "window_size": window, "enable_gqa": kv_heads != heads}
    spec = fatune.explain(q, k, v, **kwargs).spec
    config = default_config(spec, (9, 0)).replace(dkdv=default_backward(spec))
    assert fatune.explain(q, k, v, config=config, **kwargs).launched.gluon_backward
    record_gpu_errors(run_and_compare(q, k, v, config=config, **kwargs))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal, alignment", [(False, None), (True, "top_left"), (True, "bottom_right")])
@pytest.mark.parametrize("shape", [(2, 4, 2, 300, 300, 128), (1, 4, 4, 129, 333, 64)], ids=lambda s: "x".join(map(str, s)))
def test_gpu_gluon_backward_with_alibi(shape, causal, alignment, dtype, poison_outputs, record_gpu_errors):
    """Per-(batch, head) slopes, each query head of a GQA group its own: both Gluon kernels."""
    batch, heads, kv_heads, lq, lk, d = shape
    torch.manual_seed(stable_seed(shape, causal, alignment, dtype, "alibi-backward"))
    q, k, v = random_qkv(batch, heads, kv_heads, lq, lk, d, d, dtype=dtype, device="cuda")
    kwargs = {"is_causal": causal, "enable_gqa": kv_heads != heads,
              "alibi_slopes": torch.rand(batch, heads, device="cuda") * 0.5}
    if alignment is not None:
        kwargs["causal_alignment"] = alignment
    spec = fatune.explain(q, k, v, **kwargs).spec
    config = default_config(spec, (9, 0)).replace(fwd=default_forward(spec), dkdv=GluonBackwardConfig())
    assert fatune.explain(q, k, v, config=config, **kwargs).launched.gluon_backward
    record_gpu_errors(run_and_compare(q, k, v, config=config, **kwargs))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, (64, 0))])
@pytest.mark.parametrize("d", [64, 128, 96])
def test_gpu_gluon_backward_with_key_lengths_never_reads_past_them(d, causal, window, dtype, poison_outputs,
                                                                   record_gpu_errors):
    """Keys past each sequence's length hold NaN: both Gluon kernels never read them, dK and dV there are 0, and
    the gradients meet the accuracy rule; lengths 0, 1, ragged and full."""
    q, k, v, lengths, kwargs = _unwritten_cache(d, causal, window, dtype,
                                                stable_seed(d, causal, window, dtype, "backward-lengths"))
    spec = fatune.explain(q, k, v, **kwargs).spec
    config = default_config(spec, (9, 0)).replace(fwd=default_forward(spec), dkdv=GluonBackwardConfig())
    assert fatune.explain(q, k, v, config=config, **kwargs).launched.gluon_backward
    out = fatune.attention(q, k, v, config=config, **kwargs)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert all(torch.isfinite(g).all() for g in grads)
    for b, n in enumerate(lengths.tolist()):
        assert not grads[1][b, :, n:].any() and not grads[2][b, :, n:].any()
    clean = [t.detach().nan_to_num(0.0).requires_grad_() for t in (k, v)]
    record_gpu_errors(run_and_compare(q, *clean, config=config, **kwargs))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, (100, 0))])
@pytest.mark.parametrize("d", [64, 128, 96, 256])
def test_gpu_gluon_backward_of_packed_sequences(d, causal, window, dtype, poison_outputs, record_gpu_errors):
    """Packed sequences of unequal lengths (a single token, empty ones in the middle and last, L_q != L_k): each
    program reads, adds into and writes its sequence's rows alone."""
    from tests.test_variants import _packed

    lengths_q, lengths_k = [1, 0, 300, 129, 64, 777, 0], [5, 3, 300, 333, 64, 700, 7]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 4, 2, d, d, dtype=dtype,
                                  seed=stable_seed(d, causal, dtype, "backward"))
    q, k, v = (t.detach().cuda().requires_grad_() for t in (q, k, v))
    kwargs = {"cu_seqlens_q": cu_q.cuda(), "cu_seqlens_k": cu_k.cuda(), "is_causal": causal, "enable_gqa": True}
    if window is not None:
        kwargs["window_size"] = window
    spec = fatune.explain(q, k, v, **kwargs).spec
    config = default_config(spec, (9, 0)).replace(fwd=default_forward(spec), dkdv=default_backward(spec))
    assert fatune.explain(q, k, v, config=config, **kwargs).launched.gluon_backward
    record_gpu_errors(run_and_compare(q, k, v, config=config, **kwargs))


@pytest.mark.gpu
@pytest.mark.parametrize("grad_layout", ["transposed", "every-other-lane"])
def test_gpu_gluon_backward_takes_any_gradient_layout_and_deterministic_mode(grad_layout, poison_outputs,
                                                                            record_gpu_errors):
    """A dO TMA cannot read (head-dim stride 2), and torch's deterministic mode, run the Triton backward; a
    transposed dO runs the Gluon one. Both meet the accuracy rule."""
    torch.manual_seed(stable_seed(grad_layout))
    q, k, v = random_qkv(2, 4, 2, 300, 300, 128, 128, dtype=torch.bfloat16, device="cuda")
    spec = KernelSpec(torch.bfloat16, 128, causal=True)
    config = default_config(spec, (9, 0)).replace(dkdv=GluonBackwardConfig())
    record_gpu_errors(run_and_compare(q, k, v, is_causal=True, enable_gqa=True, config=config,
                                      grad_layout=grad_layout))
    torch.use_deterministic_algorithms(True)
    try:
        explained = fatune.explain(q, k, v, is_causal=True, enable_gqa=True, config=config)
        assert not explained.launched.gluon_backward
        record_gpu_errors(run_and_compare(q, k, v, is_causal=True, enable_gqa=True, config=config))
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.gpu
def test_gpu_a_gluon_backward_that_cannot_be_built_runs_the_triton_backward_without_atomic_dq(
        poison_outputs, record_gpu_errors, monkeypatch):
    """A config over the shared memory of a Hopper GPU runs the Triton backward instead, with its dQ kernel (the
    atomic-dQ passes it would have run around the Gluon kernel are 2x slower alone at d128), within the
    accuracy rule."""
    from fatune.kernel.triton.launch import Plan

    asked = []
    original = Plan.backward

    def recording(self, *args, **kwargs):
        asked.append(kwargs.get("atomic"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Plan, "backward", recording)
    torch.manual_seed(stable_seed("unbuildable"))
    q, k, v = random_qkv(2, 4, 4, 300, 300, 128, 128, dtype=torch.bfloat16, device="cuda")
    spec = KernelSpec(torch.bfloat16, 128)
    config = default_config(spec, (9, 0)).replace(dkdv=GluonBackwardConfig(block_m=128, num_stages=2, dq_slice=128))
    record_gpu_errors(run_and_compare(q, k, v, config=config))
    assert asked and all(atomic is False for atomic in asked), asked
    assert not fatune.explain(q, k, v, config=config).launched.gluon_backward


# (what, head dim, causal, forward config or None, backward config or None, batch, heads, length): a sample of the
# Gluon kernels' structures, run under a sanitizer: Triton's concurrency sanitizer (ConSan: it traps on a
# shared-memory access that races an asynchronous copy or product, and on a barrier misuse) and compute-sanitizer's
# memcheck (an access out of bounds or misaligned). The problems are small (instrumented, the kernels run far
# slower) but take several tiles per program around the ring of stages, and a partial last tile.
SANITIZED_CASES = [
    ("forward-pingpong", 64, True, GluonConfig(128, 2, pingpong=1), None, 2, 4, 700),
    ("forward-persistent", 128, True, GluonConfig(128, 2, persistent=1, pingpong=1), None, 2, 8, 1100),
    ("forward-three-consumers", 64, False, GluonConfig(128, 2, consumers=3, consumer_regs=160), None, 1, 4, 900),
    ("backward-default", 128, True, None, GluonBackwardConfig(), 2, 4, 700),
    ("backward-shared-dq", 64, True, None, GluonBackwardConfig(shared_dq=1), 1, 2, 333),
    # the consumers of a key tile split its query rows and share its P and dS tiles (each stores its rows): causal
    ("backward-head-split", 256, True, None, GluonBackwardConfig(num_stages=1, dq_slice=64), 1, 2, 300),
    ("backward-head-split-unbanded", 256, False, None, GluonBackwardConfig(num_stages=1, dq_slice=128), 1, 2, 300),
    # grouped query heads (4 per K/V head), three stages: a program's ring wraps across the group's heads
    ("backward-gqa-three-stages", 128, False, None, GluonBackwardConfig(num_stages=3), 1, 8, 300, 4),
    # the group split: two programs per key tile, each summing half the group, dK and dV added by atomics
    ("backward-group-split", 128, True, None, GluonBackwardConfig(group_split=2), 1, 8, 300, 4),
]
# ConSan's checks grow a kernel 25- to 50-fold, the shared-dQ backward the most (its dS slots are indexed at run
# time): under a causal mask from 6.4k to 330k lines of PTX, which ptxas compiles in about 170 s on one CPU core,
# the whole budget of a sanitized run (the default d128 causal backward: 180k lines, about 65 s); without a mask
# 160k lines, about 55 s. ConSan takes that kernel without a mask (memcheck, which compiles nothing of its own,
# keeps the causal one).
CONSAN_CASES = [("backward-shared-dq-unbanded", 64, False, None, GluonBackwardConfig(shared_dq=1), 1, 2, 333)
                if case[0] == "backward-shared-dq" else case for case in SANITIZED_CASES]

SANITIZED_SCRIPT = """
import collections, json, sys, torch, triton, fatune
from fatune.kernel.gluon import launch as gluon_launch
from fatune.kernel.spec import AttentionConfig
from fatune.kernel.triton.heuristics import default_config
from fatune.kernel.triton.launch import ensure_triton_allocator
d, causal, forward, backward, b, h, n, group = json.loads(sys.argv[1])
consan = sys.argv[2] == "consan"
sanitized = collections.Counter()

def under_consan(kernel, call):
    # only the Gluon kernels compile with ConSan: Triton 3.6's ConSan also traps in the Triton family's forward, a
    # Triton-language loop whose TMA pipeline Triton's compiler builds (its deadlock check, on an H100)
    def run(*args, **kwargs):
        sanitized[kernel] += 1
        ensure_triton_allocator()  # ConSan's state lives in global scratch (per thread: autograd's too)
        triton.knobs.compilation.instrumentation_mode = "consan"
        try:
            return call(*args, **kwargs)
        finally:
            triton.knobs.compilation.instrumentation_mode = ""
    return run

if consan:
    gluon_launch.GluonForward.__call__ = under_consan("forward", gluon_launch.GluonForward.__call__)
    gluon_launch.GluonBackward.__call__ = under_consan("backward", gluon_launch.GluonBackward.__call__)
torch.manual_seed(0)
q, k, v = (torch.randn(b, heads, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for heads in (h, h // group, h // group))
gqa = group > 1
spec = fatune.explain(q, k, v, is_causal=causal, enable_gqa=gqa).spec
config = default_config(spec, (9, 0)).to_dict()
config = AttentionConfig.from_dict({**config, **({"fwd": forward} if forward else {}),
                                    **({"dkdv": backward} if backward else {})})
launched = fatune.explain(q, k, v, is_causal=causal, config=config, enable_gqa=gqa).launched
assert launched.gluon_forward == bool(forward) and launched.gluon_backward == bool(backward), launched
out = fatune.attention(q, k, v, is_causal=causal, config=config, enable_gqa=gqa)
grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
torch.cuda.synchronize()
reference = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal,
                                                             enable_gqa=gqa)
error = (out.float() - reference).abs().max().item()
assert error < 0.05 and all(bool(torch.isfinite(g).all()) for g in grads), error
if consan:
    ran = {kernel for kernel, config in (("forward", forward), ("backward", backward)) if config}
    assert set(sanitized) == ran, sanitized
print("SANITIZED OK", error)
"""


def _run_sanitized(case, tmp_path, tool: str, prefix: tuple[str, ...] = ()) -> str:
    """The case's forward and backward in a fresh process (its own Triton and fatune caches) under `tool`, behind
    `prefix` (a sanitizer's command line); its stderr, after asserting it ran the Gluon kernels to a close result."""
    import os
    import subprocess
    import sys

    _, d, causal, forward, backward, batch, heads, length, *group = case
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"), "FATUNE_CACHE_DIR": str(tmp_path / "kernels"),
           "FATUNE_DB": str(tmp_path / "none.sqlite")}
    env.pop("TRITON_INSTRUMENTATION_MODE", None)
    arguments = json.dumps([d, causal, forward.to_dict() if forward else None,
                            backward.to_dict() if backward else None, batch, heads, length, *(group or [1])])
    try:  # below pytest's timeout, which would kill the xdist worker
        done = subprocess.run([*prefix, sys.executable, "-c", SANITIZED_SCRIPT, arguments, tool], env=env,
                              capture_output=True, text=True, timeout=170)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{case[0]} under {tool} did not finish within 170 s (a hang, or a sanitizer far slower here)")
    assert done.returncode == 0 and "SANITIZED OK" in done.stdout, (done.stdout + done.stderr)[-3000:]
    assert "cannot be built here" not in done.stderr, done.stderr[-3000:]  # the Gluon kernel ran, not a fallback
    return done.stdout + done.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("case", CONSAN_CASES, ids=[c[0] for c in CONSAN_CASES])
def test_gpu_gluon_kernels_pass_the_concurrency_sanitizer(case, tmp_path):
    """Each sampled Gluon kernel compiled with ConSan runs a forward and backward without a trap, its output close
    to float32 SDPA's."""
    _run_sanitized(case, tmp_path, "consan")


@pytest.mark.gpu
@pytest.mark.parametrize("case", SANITIZED_CASES, ids=[c[0] for c in SANITIZED_CASES])
def test_gpu_gluon_kernels_pass_memcheck(case, tmp_path):
    """Each sampled Gluon kernel under compute-sanitizer's memcheck: no access out of bounds or misaligned (TMA
    boxes past odd lengths, persistent programs' tiles, the backward's bulk dQ reductions)."""
    import glob
    import shutil

    sanitizer = shutil.which("compute-sanitizer") or next(iter(sorted(glob.glob(
        "/usr/local/cuda*/bin/compute-sanitizer"))), None)
    if sanitizer is None:
        pytest.skip("compute-sanitizer is not installed on this machine")
    output = _run_sanitized(case, tmp_path, "memcheck",
                            (sanitizer, "--tool", "memcheck", "--error-exitcode", "3", "--print-limit", "20"))
    assert "ERROR SUMMARY: 0 errors" in output, output[-3000:]
