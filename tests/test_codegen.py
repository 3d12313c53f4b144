"""Templates render to valid Triton source for every variant, compile for sm_90, and are cached."""

from __future__ import annotations

import ast
import dataclasses
import itertools
import os
import shutil
import subprocess
import sys

import pytest

from fatune import settings
from fatune.kernel import codegen as loader
from fatune.kernel.codegen import Templates
from fatune.kernel.spec import AttentionConfig, KernelSpec, LaunchConfig
from fatune.kernel.triton import codegen, signature
from fatune.kernel.triton.heuristics import default_config

BASE_SPECS = [
    KernelSpec(dtype, head_dim, head_dim_v, causal)
    for dtype, (head_dim, head_dim_v), causal in itertools.product(
        ["float16", "bfloat16", "float32"], [(16, 16), (64, 64), (128, 128), (40, 24), (256, 256)], [False, True]
    )
]
VARIANT_SPECS = [
    KernelSpec("bfloat16", 64, window_left=True, window_right=True, bottom_right=True),
    KernelSpec("bfloat16", 64, causal=True, window_left=True, bottom_right=True),
    KernelSpec("bfloat16", 64, window_left=True),
    KernelSpec("float16", 128, attn_mask="bool"),
    KernelSpec("float16", 128, causal=True, attn_mask="additive"),
    KernelSpec("bfloat16", 64, seqlens="seqlens_k", causal=True, bottom_right=True),
    KernelSpec("bfloat16", 96, seqlens="varlen", causal=True, bottom_right=True),
    KernelSpec("bfloat16", 64, alibi=True, causal=True),
    KernelSpec("float16", 80, dropout=True),
    KernelSpec("bfloat16", 64, causal=True, window_left=True, attn_mask="bool", seqlens="seqlens_k", alibi=True,
               dropout=True, bottom_right=True),
]
SPECS = BASE_SPECS + VARIANT_SPECS

# Code that appears exactly when a switch is on: a kernel without a mask carries no mask code.
SWITCH_MARKERS = [
    (lambda s: s.causal or s.window_right, "keep = keep & (cols <= rows + offset + window_right)"),
    (lambda s: s.window_left, "keep = keep & (cols >= rows + offset - window_left)"),
    (lambda s: s.attn_mask != "none", "tl.load(MASK_base + rows * stride_mq"),
    (lambda s: s.attn_mask != "none", "= within_spans("),
    (lambda s: s.alibi, "(alibi_slope * LOG2E)"),
    (lambda s: s.dropout, "tl.philox("),
    (lambda s: s.seqlens == "varlen", "packed_bounds(CU_Q, off_b, L_Q)"),
    (lambda s: s.seqlens == "seqlens_k", "clamp(tl.load(SEQLENS_K + off_b), 0, L_K)"),
    (lambda s: s.bottom_right, "offset = seqlen_k - seqlen_q"),
    (lambda s: s.head_dim not in (16, 32, 64, 128, 256), "(offs_d[None, :] < HEAD_DIM)"),
]


def _spec_id(spec: KernelSpec) -> str:
    return f"{spec.dtype}-d{spec.head_dim}-dv{spec.head_dim_v}-{spec.mask_variant}"


@pytest.mark.parametrize("kind", ["fwd", "bwd"])
@pytest.mark.parametrize("spec", SPECS, ids=_spec_id)
def test_every_variant_renders_valid_python(kind, spec):
    source = codegen.render(kind, spec, default_config(spec, (9, 0)))
    tree = ast.parse(source)
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    expected = {"fwd": {"attn_fwd"}, "bwd": {"attn_bwd_dkdv", "attn_bwd_dq"}}
    assert expected[kind] <= set(functions)
    for name in expected[kind]:  # the parameter list comes from fatune.kernel.triton.signature, the launch layer's source too
        assert [arg.arg for arg in functions[name].args.args] == list(signature.params(name, spec))
    for switch_on, marker in SWITCH_MARKERS:
        assert (marker in source) == bool(switch_on(spec)), f"{marker!r} present={marker in source} for {spec}"


def test_source_reads_like_the_algorithm():
    spec = KernelSpec("bfloat16", 64, causal=True)
    source = codegen.render("fwd", spec, default_config(spec, (9, 0)))
    for step in ("m_new = tl.maximum(m_i, tl.max(s, 1))", "alpha = tl.math.exp2(m_i - m_ref)",
                 "l_i = l_i * alpha + tl.sum(p, 1)", "acc = acc * alpha[:, None]", "BLOCK_M = tl.constexpr(128)"):
        assert step in source


# Compiling to a cubin needs Triton's compiler (not the interpreter) but no GPU: run it in a
# child process without TRITON_INTERPRET, a few variants per run to keep CI quick.
COMPILE_CASES = [
    ("fwd", KernelSpec("bfloat16", 64, causal=True)),
    ("dkdv", KernelSpec("bfloat16", 128, causal=True)),
    ("dq", KernelSpec("float16", 64, causal=False)),
    ("fwd", KernelSpec("float16", 40, 24, causal=False)),
    ("dkdv", KernelSpec("float32", 32, causal=False)),
    ("fwd", VARIANT_SPECS[-1]),
    ("dkdv", VARIANT_SPECS[-1]),
    ("dq", VARIANT_SPECS[-1]),
    ("dkdv", VARIANT_SPECS[6]),
    ("dq", VARIANT_SPECS[4]),
    # a paged cache's decode forward (key rows gathered from the block table's pages, no TMA)
    ("fwd", KernelSpec("bfloat16", 128, seqlens="seqlens_k", paged=True)),
]


def _compile_in_subprocess(script: str, tmp_path) -> str:
    """Run `script` in a fresh process with compiled (not interpreted) Triton and private caches;
    its stdout, after asserting it succeeded."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["FATUNE_CACHE_DIR"] = str(tmp_path)
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                            check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout.strip()


@pytest.mark.parametrize("ptx, in_flight", [
    ("", 0),
    ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {...};", 0),
    ("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 ...;\n\twgmma.wait_group.sync.aligned 0;", 0),
    ("wgmma.wait_group.sync.aligned 1;\n\twgmma.wait_group.sync.aligned\t0;", 1),
])
def test_the_groups_a_kernel_leaves_in_flight_are_read_from_its_waits(ptx, in_flight):
    """fatune.kernel.triton.offline reports the most wgmma groups any wait leaves running (what a SASS census of the compiled kernels reads)."""
    from fatune.kernel.triton import offline

    assert offline.wgmma_in_flight(ptx) == in_flight


LOOP = "$L__BB0_1:\n{body}\n@%p bra $L__BB0_1;\nwgmma.wait_group.sync.aligned 0;\n"


@pytest.mark.parametrize("ptx, under", [
    ("ex2.approx.f32 a;", 0),
    ("wgmma.commit_group.sync.aligned;\nex2.approx.f32 a;\nwgmma.wait_group.sync.aligned 0;\nex2.approx.f32 b;", 1),
    # a loop that waits before its softmax and commits its last product at the end of the body
    (LOOP.format(body="wgmma.commit_group.sync.aligned;\nwgmma.wait_group.sync.aligned 0;\nex2.approx.f32 a;\n"
                      "wgmma.commit_group.sync.aligned;"), 0),
    # the same product reaches the next iteration's softmax over the back edge
    (LOOP.format(body="ex2.approx.f32 a;\nwgmma.commit_group.sync.aligned;"), 1),
    # FlashAttention-3's order: the softmax between a wait that leaves the newest product running and the next wait
    (LOOP.format(body="wgmma.commit_group.sync.aligned;\nwgmma.commit_group.sync.aligned;\n"
                      "wgmma.wait_group.sync.aligned 1;\nex2.approx.f32 a;\nwgmma.wait_group.sync.aligned 0;"), 1),
])
def test_softmax_instructions_under_a_pending_product_are_counted_over_every_path(ptx, under):
    from fatune.kernel.triton import offline

    assert offline.exp2_under_wgmma(ptx) == under


def test_variants_compile_for_sm90(tmp_path):
    script = (
        "import sys\n"
        "from fatune.kernel.triton import offline\n"
        "from fatune.kernel.triton.heuristics import default_config\n"
        "from fatune.kernel.spec import KernelSpec\n"
        f"for kernel, args in {[(kernel, s.to_dict()) for kernel, s in COMPILE_CASES]!r}:\n"
        "    spec = KernelSpec(**args)\n"
        "    info = offline.compile_kernel(kernel, spec, default_config(spec, (9, 0)))\n"
        "    assert info.shared_bytes > 0, info\n"
        "    assert info.uses_wgmma == (spec.dtype != 'float32'), (kernel, spec, info)\n"
        "    print(kernel, spec.dtype, spec.head_dim, info)\n"
    )
    assert len(_compile_in_subprocess(script, tmp_path).splitlines()) == len(COMPILE_CASES)


# Hopper forward variants: (spec, forward config with TMA loads)
HOPPER_COMPILE_CASES = [
    (KernelSpec("bfloat16", 64, causal=True), "64x64/w4/s3/t"),
    (KernelSpec("float16", 128), "128x64/w8/s2/t"),
    (KernelSpec("bfloat16", 128), "128x64/w8/s3/t"),
    (KernelSpec("bfloat16", 256, causal=True), "64x64/w4/s2/t"),
    (KernelSpec("float16", 40, 24), "64x32/w4/s3/t"),
    (KernelSpec("bfloat16", 64, causal=True, window_left=True, bottom_right=True), "64x64/w4/s3/t"),
    (KernelSpec("bfloat16", 96, seqlens="varlen", causal=True, bottom_right=True), "64x64/w4/s3/t"),
    (KernelSpec("bfloat16", 64, seqlens="seqlens_k", causal=True, bottom_right=True), "64x64/w4/s3/k4/t"),
    (KernelSpec("bfloat16", 128, seqlens="seqlens_k", causal=True, bottom_right=True), "64x64/w4/s3/g/t"),
    (KernelSpec("bfloat16", 64, causal=True, alibi=True, dropout=True), "64x64/w4/s3/t"),
    (KernelSpec("float16", 64, attn_mask="bool"), "64x64/w4/s3/t"),
    (KernelSpec("float32", 64), "64x32/w4/s2/t"),
]


def _structure_config(spec: KernelSpec, tag: str) -> AttentionConfig:
    return default_config(spec, (9, 0)).replace(fwd=LaunchConfig.parse(tag))


@pytest.mark.parametrize("spec, tag", HOPPER_COMPILE_CASES
                         + [(KernelSpec("float16", 64, attn_mask="bool"), "64x64/w8/s3/g/t"),
                            (KernelSpec("bfloat16", 64, causal=True), "64x64/w4/s3")],
                         ids=lambda value: value if isinstance(value, str) else _spec_id(value))
def test_hopper_variants_render(spec, tag):
    """TMA kernels read K/V (and the unpacked query tile) through descriptors; the key loop and the early
    exit of tiles past the sequence are the plain kernel's."""
    config = _structure_config(spec, tag)
    source = codegen.render("fwd", spec, config)
    functions = {node.name: node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)}
    assert [arg.arg for arg in functions["attn_fwd"].args.args] == list(signature.params("attn_fwd", spec))
    fwd = config.fwd
    assert source.count("tl.make_tensor_descriptor(") == (3 - fwd.pack_gqa if fwd.tma else 0)
    assert "        return\n" in source  # the early exit of tiles past the sequence
    # the left-edge loop: a window, or a boolean mask's tiles that some row does not see in full (without a band
    # or pages, in the same loop as those at the right edge: one copy of the masked code)
    two_ranges = spec.attn_mask == "bool" and not (spec.causal or spec.window_left or spec.window_right or spec.paged)
    assert source.count("acc, l_i, m_i = attend_key_tiles(") == (
        2 + bool(spec.window_left or spec.attn_mask == "bool") - two_ranges)
    assert ("for tile in range(0, first_tiles + " in source) == two_ranges


@pytest.mark.parametrize("spec, loops", [
    # (dK/dV's query-tile loops, dQ's key-tile loops)
    (KernelSpec("bfloat16", 128, attn_mask="bool"), (2, 2)),  # masked tiles on both sides of the full ones: one loop
    (KernelSpec("float16", 40, 24, attn_mask="bool", seqlens="varlen", alibi=True, dropout=True), (2, 2)),
    (KernelSpec("bfloat16", 128, attn_mask="bool", causal=True), (3, 3)),  # with a band: a loop per edge
    (KernelSpec("bfloat16", 64, attn_mask="bool", window_left=True, window_right=True), (3, 3)),
    (KernelSpec("bfloat16", 128, attn_mask="additive"), (1, 2)),  # dQ's last loop: the ragged end of K
    (KernelSpec("bfloat16", 128, causal=True), (2, 2)),
], ids=lambda value: "x".join(map(str, value)) if isinstance(value, tuple) else _spec_id(value))
def test_backward_masked_loops(spec, loops):
    """dK/dV's query-tile loops and dQ's key-tile loops: a boolean mask without a band runs its masked tiles, on
    either side of the full ones, in one loop (one copy of the masked code), then the full ones unmasked."""
    source = codegen.render("bwd", spec, default_config(spec, (9, 0)))
    kernels = {name: source.split(f"def {name}(")[-1].split("\n@triton.jit")[0] for name in ("attn_bwd_dkdv", "attn_bwd_dq")}
    assert (kernels["attn_bwd_dkdv"].count("= accumulate_query_tiles("),
            kernels["attn_bwd_dq"].count("= accumulate_key_tiles(")) == loops
    two_ranges = spec.attn_mask == "bool" and loops == (2, 2)
    assert source.count("for tile in range(0, first_tiles + ") == 2 * two_ranges


def _compile_variants_for_sm90(cases: list, kernel: str, checks: str, tmp_path) -> None:
    """Compile `kernel` for each (spec, config tag of that kernel) in a fresh process; `checks`: assert
    lines on `info` (offline.CompiledKernel), `spec`, `tag` and `config`, indented as a loop body."""
    script = (
        "from fatune.kernel.triton import offline\n"
        "from fatune.kernel.triton.heuristics import default_config\n"
        "from fatune.kernel.spec import KernelSpec, LaunchConfig\n"
        f"for args, tag in {[(s.to_dict(), tag) for s, tag in cases]!r}:\n"
        "    spec = KernelSpec(**args)\n"
        f"    config = default_config(spec, (9, 0)).replace({kernel}=LaunchConfig.parse(tag))\n"
        f"    info = offline.compile_kernel({kernel!r}, spec, config)\n"
        f"{checks}"
        "    print(spec.mask_variant, spec.dtype, spec.head_dim, tag, info)\n"
    )
    assert len(_compile_in_subprocess(script, tmp_path).splitlines()) == len(cases)


def test_hopper_variants_compile_for_sm90(tmp_path):
    """Every TMA variant lowers to an sm_90 cubin with TMA copies and the warps it asked for."""
    _compile_variants_for_sm90(HOPPER_COMPILE_CASES, "fwd", (
        "    assert info.uses_tma, (spec, tag, info)\n"
        "    assert info.uses_wgmma == (spec.dtype != 'float32'), (spec, tag, info)\n"
        "    assert spec.dtype == 'float32' or not info.spills, (spec, tag, info)  # float32 spills without TMA too\n"
        "    assert info.num_warps == config.fwd.num_warps, (spec, tag, info)\n"), tmp_path)


def test_one_query_and_one_key_compile_as_launched_for_sm90(tmp_path):
    """A length of 1 is a constant to Triton. ptxas (CUDA 13) crashed compiling the heuristic's dQ kernel at fp16
    d16 with its single-tile key loop pipelined (a random call found it): resolve() launches such a loop
    unpipelined, and that compiles, as do the forward and dK/dV of the same call."""
    script = (
        "import torch\n"
        "from fatune.call import Call\n"
        "from fatune.kernel.triton import offline\n"
        "from fatune.kernel.triton.heuristics import default_config\n"
        "from fatune.kernel.triton.resolve import resolve\n"
        "q = torch.empty(3, 9, 1, 16, dtype=torch.float16)\n"
        "k = torch.empty(3, 3, 1, 16, dtype=torch.float16)\n"
        "problem = Call(seqlens_k=torch.ones(3, dtype=torch.int32), enable_gqa=True).check(q, k, k)\n"
        "config = resolve(default_config(problem.spec, (9, 0)), problem, q.device, (q, k, k))\n"
        "assert config.dq.num_stages == config.dkdv.num_stages == config.fwd.num_stages == 1, config\n"
        "for kernel in ('fwd', 'dkdv', 'dq'):\n"
        "    print(kernel, offline.compile_kernel(kernel, problem.spec, config, lengths_of_one=('L_Q', 'L_K')))\n"
    )
    assert len(_compile_in_subprocess(script, tmp_path).splitlines()) == 3


# backward with dQ added by TMA reductions: (spec, dK/dV config)
TMA_DQ_COMPILE_CASES = [
    (KernelSpec("bfloat16", 128, causal=True), "64x128/w8/s2/a2"),
    (KernelSpec("float16", 40, 24, causal=True), "64x64/w4/s2/a2"),  # padded lanes past the head dim
    (KernelSpec("bfloat16", 96, seqlens="varlen", causal=True, bottom_right=True), "64x64/w4/s2/a2"),
    (KernelSpec("float16", 30, causal=True), "64x64/w4/s2/a2"),  # rows of 120 B: compiled as /a, as launched
]


def test_tma_dq_renders_one_descriptor_per_program_and_compiles_for_sm90(tmp_path):
    """dQ's shares go through bulk reductions (cp.reduce.async.bulk) into one TMA descriptor per program,
    built before the GQA head loop (rebuilding it per head could rewrite it under running reductions)."""
    for spec, tag in (case for case in TMA_DQ_COMPILE_CASES if case[0].head_dim % 4 == 0):
        source = codegen.render("bwd", spec, default_config(spec, (9, 0)).replace(dkdv=LaunchConfig.parse(tag)))
        assert source.count("tl.make_tensor_descriptor(") == 1 and ".atomic_add([head.to(tl.int32), start_m, 0]" in source
        assert source.index("tl.make_tensor_descriptor(") < source.index("for g in range(0, GROUP)")
        assert "tl.atomic_add(" not in source.split("def attn_bwd_dq_store")[0]
    _compile_variants_for_sm90(TMA_DQ_COMPILE_CASES, "dkdv", "    assert info.uses_wgmma and info.uses_tma == (spec.head_dim % 4 == 0), "
                               "(spec, tag, info)\n", tmp_path)


# atomic dQ's passes around the dK/dV kernel: (spec, dK/dV config)
ATOMIC_DQ_PASS_CASES = [
    (KernelSpec("bfloat16", 64, causal=True), "64x128/w8/s2/a"),
    (KernelSpec("float16", 40, 24, seqlens="varlen", causal=True, window_left=True, bottom_right=True, alibi=True,
                dropout=True), "64x64/w4/s2/a2"),
    (KernelSpec("bfloat16", 128, attn_mask="bool"), "64x64/w4/s2/a"),
]


def test_atomic_dq_passes_compile_for_sm90(tmp_path):
    """The pass before the atomic-dQ dK/dV kernel (Delta, summed from recomputed P dP where rows see few keys,
    and the zeroed float32 accumulator) and dQ's final store lower to sm_90 cubins with dQ's warps and no
    spills; the pass recomputes S and dP on tensor cores."""
    script = (
        "from fatune.kernel.triton import offline\n"
        "from fatune.kernel.triton.heuristics import default_config\n"
        "from fatune.kernel.spec import KernelSpec, LaunchConfig\n"
        f"for args, tag in {[(s.to_dict(), tag) for s, tag in ATOMIC_DQ_PASS_CASES]!r}:\n"
        "    spec = KernelSpec(**args)\n"
        "    config = default_config(spec, (9, 0)).replace(dkdv=LaunchConfig.parse(tag))\n"
        "    for kernel in ('prep', 'dq_store'):\n"
        "        info = offline.compile_kernel(kernel, spec, config)\n"
        "        assert info.num_warps == config.dq.num_warps and not info.spills, (kernel, spec, info)\n"
        "        assert info.uses_wgmma == (kernel == 'prep'), (kernel, spec, info)\n"
        "        print(kernel, spec.dtype, spec.head_dim, info)\n"
    )
    assert len(_compile_in_subprocess(script, tmp_path).splitlines()) == 2 * len(ATOMIC_DQ_PASS_CASES)


def test_concurrent_dq_compiles_for_sm90(tmp_path):
    """With `concurrent`, the Delta pass and the dQ kernel that reads its Delta lower to sm_90 cubins (the dQ
    kernel without the Delta code, and so without the O load)."""
    spec = KernelSpec("bfloat16", 128, causal=True, window_left=True, bottom_right=True)
    config = default_config(spec, (9, 0))
    config = config.replace(dkdv=dataclasses.replace(config.dkdv, atomic_dq=0),
                            dq=dataclasses.replace(config.dq, concurrent=1))
    source = codegen.render("bwd", spec, config)
    dq = source.split("def attn_bwd_dq(")[1].split("def attn_bwd_prep(")[0]
    assert "tile_delta(" not in dq and "tl.load(O " not in dq and "load_row_stats(" in dq
    assert "DQ_ACC" not in source.split("def attn_bwd_prep(")[1].split('"""')[2]  # no accumulator to zero
    script = (
        "from fatune.kernel.triton import offline\n"
        "from fatune.kernel.spec import AttentionConfig, KernelSpec\n"
        f"spec, config = KernelSpec(**{spec.to_dict()!r}), AttentionConfig.from_dict({config.to_dict()!r})\n"
        "for kernel in ('prep', 'dq'):\n"
        "    info = offline.compile_kernel(kernel, spec, config)\n"
        "    assert info.uses_wgmma and not info.spills, (kernel, info)\n"
        "    print(kernel, info)\n"
    )
    assert len(_compile_in_subprocess(script, tmp_path).splitlines()) == 2


# band-masked dK/dV kernels as a launch without GQA specialises them (GROUP a constant 1): (spec, dK/dV config)
PIPELINED_DKDV_CASES = [
    (KernelSpec("bfloat16", 128, causal=True), "64x64/w4/s2/t"),  # the Hopper heuristic's
    (KernelSpec("float16", 128, causal=True, window_left=True), "64x64/w4/s2"),  # three loops, pointer loads
]


def test_band_dkdv_kernels_keep_their_tensor_core_products_pipelined(tmp_path):
    """ptxas waited for each wgmma of the causal dK/dV kernel on its own (C7515: accumulator registers defined
    between a product's issue and its wait) while the masked loop ran before the unmasked one: 12-16% of
    dK/dV's time on an H200 (Nsight Compute). With the unmasked loop first it keeps them pipelined."""
    script = (
        "from fatune.kernel.triton import offline\n"
        "from fatune.kernel.triton.heuristics import default_config\n"
        "from fatune.kernel.spec import KernelSpec, LaunchConfig\n"
        f"for args, tag in {[(s.to_dict(), tag) for s, tag in PIPELINED_DKDV_CASES]!r}:\n"
        "    spec = KernelSpec(**args)\n"
        "    config = default_config(spec, (9, 0)).replace(dkdv=LaunchConfig.parse(tag))\n"
        "    note = offline.wgmma_serialization('dkdv', spec, config, group=1)\n"
        "    assert note == '', (args, tag, note)\n"
        "    print(tag, 'pipelined')\n"
    )
    assert len(_compile_in_subprocess(script, tmp_path).splitlines()) == len(PIPELINED_DKDV_CASES)


def test_compiling_for_a_group_of_one_rejects_other_groups():
    from fatune.kernel.triton import offline

    spec = KernelSpec("bfloat16", 64)
    with pytest.raises(ValueError, match="group: expected None"):
        offline.compile_kernel("dkdv", spec, default_config(spec, (9, 0)), group=2)


# backward with the query and dO tiles read by TMA: (spec, dK/dV config)
TMA_DKDV_COMPILE_CASES = [
    (KernelSpec("bfloat16", 128, causal=True), "64x64/w4/s2/t"),
    (KernelSpec("float16", 40, 24, causal=True), "64x64/w4/s2/t"),  # padded lanes past the head dims
    (KernelSpec("bfloat16", 96, seqlens="varlen", causal=True, bottom_right=True), "64x128/w8/s2/t/a2"),
    (KernelSpec("bfloat16", 64, window_left=True, causal=True), "32x64/w4/s3/t"),
]


def test_tma_dkdv_builds_its_descriptors_once_and_compiles_for_sm90(tmp_path):
    """The dK/dV kernel's query and dO tiles come through two TMA descriptors per program, built before the
    GQA head loop and indexed by the head, and the kernel lowers to bulk tensor copies on sm_90."""
    for spec, tag in TMA_DKDV_COMPILE_CASES:
        source = codegen.render("bwd", spec, default_config(spec, (9, 0)).replace(dkdv=LaunchConfig.parse(tag)))
        dkdv = source.split("def attn_bwd_dkdv")[1].split("def key_tile_p_dp")[0]
        assert dkdv.count("tl.make_tensor_descriptor(") == 2 + ("/a2" in tag), tag
        assert dkdv.rindex("tl.make_tensor_descriptor(") < dkdv.index("for g in range(0, GROUP)")
        assert "Q_head.load([head.to(tl.int32), start_m, 0])" in source
    _compile_variants_for_sm90(TMA_DKDV_COMPILE_CASES, "dkdv", "    assert info.uses_wgmma and info.uses_tma, "
                               "(spec, tag, info)\n", tmp_path)


def test_cache_key_and_reuse(tmp_path, monkeypatch):
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(loader, "_modules", {})  # as in a fresh process
    spec = KernelSpec("float16", 32)
    config = default_config(spec, None)
    first = codegen.load("fwd", spec, config)
    assert codegen.load("fwd", spec, config) is first, "same spec in one process must be imported once"
    path = codegen.source_path("fwd", spec, config)
    assert path.parent == tmp_path and path.read_text() == codegen.render("fwd", spec, config)
    other = config.replace(fwd=LaunchConfig(64, 32))
    assert codegen.source_path("fwd", spec, other) != path
    assert codegen.source_path("fwd", KernelSpec("float16", 32, causal=True), config) != path
    # a different backward config leaves the forward source (and its cache file) alone
    assert codegen.source_path("fwd", spec, config.replace(dq=LaunchConfig(16, 16))) == path


def test_cache_key_follows_template_text(tmp_path, monkeypatch):
    spec = KernelSpec("float16", 32)
    config = default_config(spec, None)
    before = codegen.source_key("fwd", spec, config)
    templates = tmp_path / "templates"
    shutil.copytree(codegen.TEMPLATES.path, templates)
    (templates / "attn_fwd.py.jinja").write_text((templates / "attn_fwd.py.jinja").read_text() + "\n# changed\n")
    monkeypatch.setattr(codegen, "TEMPLATES", Templates("triton", templates))
    assert codegen.source_key("fwd", spec, config) != before


def test_config_round_trip():
    config = AttentionConfig(LaunchConfig(128, 64, 8, 3), LaunchConfig(32, 128, 4, 2), LaunchConfig(64, 32, 4, 1))
    assert AttentionConfig.from_dict(config.to_dict()) == config
    assert LaunchConfig.parse(str(config.fwd)) == config.fwd


def test_a_register_cap_is_a_compile_option_not_source():
    """maxnreg (`/rN`) goes to Triton's compiler with warps and stages; the rendered source, its key and older
    configs' dicts (and so the tuned DB's kernel hashes) stay as they were."""
    capped = LaunchConfig.parse("128x64/w8/s3/r128")
    assert (capped.maxnreg, str(capped)) == (128, "128x64/w8/s3/r128")
    assert capped.compile_options == {"num_warps": 8, "num_stages": 3, "maxnreg": 128}
    assert LaunchConfig(128, 64, 8, 3).compile_options == {"num_warps": 8, "num_stages": 3}
    assert "maxnreg" not in LaunchConfig(128, 64, 8, 3).to_dict() and "split_d" not in LaunchConfig(64, 64).to_dict()
    spec = KernelSpec("float16", 64, causal=True)
    plain = default_config(spec, (9, 0))
    assert codegen.render("fwd", spec, plain.replace(fwd=dataclasses.replace(plain.fwd, maxnreg=128))).replace(
        '"maxnreg": 128, ', "") == codegen.render("fwd", spec, plain)


@pytest.mark.parametrize("text, fields", [
    ("128x64/w8/s3", {}),
    ("128x64/w4/s3/t", {"tma": 1}),
    ("64x64/w4/s2/k8/g/t", {"num_splits": 8, "pack_gqa": 1, "tma": 1}),
    ("64x128/w8/s2/a", {"atomic_dq": 1}),
    ("64x128/w8/s2/a2", {"atomic_dq": 2}),
    ("64x128/w8/s1/t/d2", {"tma": 1, "split_d": 2}),
    ("64x64/w4/s1/t/a2/d2", {"tma": 1, "atomic_dq": 2, "split_d": 2}),
    ("128x64/w8/s3/c", {"concurrent": 1}),
    ("128x64/w8/s3/c2/r128", {"concurrent": 2}),
])
def test_structure_suffixes_round_trip(text, fields):
    config = LaunchConfig.parse(text)
    assert str(config) == text and config.structure == fields
    assert LaunchConfig.from_dict(config.to_dict()) == config
    # older configs (dicts without the newer fields) read as the plain kernel
    assert LaunchConfig.from_dict({k: v for k, v in config.to_dict().items() if k not in fields}).structure == {}


@pytest.mark.parametrize("make, message", [
    (lambda: LaunchConfig(64, 64, tma=2), "tma"),
    (lambda: LaunchConfig(64, 64, tma=True), "tma"),
    (lambda: LaunchConfig.parse("64x64/w4/s3/t/g"), "config"),  # suffixes in their order only
    (lambda: LaunchConfig.parse("64x64/w4/s3/t/x"), r"config: expected .*\[/t\]\[/a\|/a2\]"),  # unknown suffix
    (lambda: LaunchConfig(64, 64, atomic_dq=3), "atomic_dq: expected 0, 1 or 2"),
    (lambda: LaunchConfig.parse("64x64/w4/s3/a3"), "config"),
    (lambda: LaunchConfig(64, 64, split_d=4), "split_d: expected 1 or 2"),
    (lambda: LaunchConfig.parse("64x64/w4/s1/d4"), "config"),
    (lambda: AttentionConfig(LaunchConfig(64, 64), LaunchConfig(64, 64), LaunchConfig(64, 64, split_d=2)), "split_d"),
    (lambda: LaunchConfig(64, 64, maxnreg=16), "maxnreg: expected 0"),
    (lambda: LaunchConfig(64, 64, maxnreg=256), "maxnreg: expected 0"),
    (lambda: LaunchConfig(64, 64, maxnreg=128.0), "maxnreg"),
    (lambda: AttentionConfig(LaunchConfig(64, 64), LaunchConfig(64, 64, pack_gqa=1), LaunchConfig(64, 64)), "pack_gqa"),
    (lambda: AttentionConfig(LaunchConfig(64, 64), LaunchConfig(64, 64), LaunchConfig(64, 64, tma=1)), "tma"),
    (lambda: LaunchConfig(64, 64, concurrent=3), "concurrent: expected 0, 1 or 2"),
    (lambda: LaunchConfig.parse("64x64/w4/s3/c3"), "config"),
    (lambda: AttentionConfig(LaunchConfig(64, 64), LaunchConfig(64, 64, concurrent=1), LaunchConfig(64, 64)),
     "concurrent"),
])
def test_bad_structure_fields_name_the_field(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    "bad, field",
    [
        (lambda: LaunchConfig(100, 64), "block_m"),
        (lambda: LaunchConfig(64, 64, num_warps=3), "num_warps"),
        (lambda: LaunchConfig.parse("64by64"), "config"),
        (lambda: KernelSpec("int8", 64), "dtype"),
        (lambda: KernelSpec("float16", 300), "head_dim"),
    ],
)
def test_bad_parameters_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        bad()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter only")
def test_the_interpreter_rounds_and_multiplies_bfloat16_as_a_gpu_does():
    """codegen.patch_interpreter: float32 -> bfloat16 rounds to nearest even (bit for bit as torch rounds),
    tl.dot of bfloat16 operands gives their float32 products (not products of their bit patterns), and tl.fma
    rounds once, as a GPU's fused multiply-add does."""
    import torch
    import triton
    import triton.language as tl

    codegen.patch_interpreter()

    @triton.jit
    def round_and_dot(X, A, B, OUT_X, OUT_AB, OUT_FMA, N: tl.constexpr, M: tl.constexpr):
        x = tl.load(X + tl.arange(0, N))
        tl.store(OUT_X + tl.arange(0, N), x.to(tl.bfloat16))
        tl.store(OUT_FMA + tl.arange(0, N), tl.fma(x, x, -x))
        rows, cols = tl.arange(0, M)[:, None], tl.arange(0, M)[None, :]
        ab = tl.dot(tl.load(A + rows * M + cols), tl.load(B + rows * M + cols))
        tl.store(OUT_AB + rows * M + cols, ab)

    special = torch.tensor([0.0, -0.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 3.3895e38, 3.4e38, float("inf"), -float("inf"),
                            1e-40, -2.5e-39, float("nan")])
    x = torch.cat([special, torch.randn(1024 - len(special)) * 10.0 ** torch.randint(-30, 30, (1024 - len(special),))])
    a, b = (torch.randn(16, 16).to(torch.bfloat16) for _ in range(2))
    x[-1] = 1 + 2**-12  # x * x - x: 2^-12 + 2^-24 rounded once; the product rounded first loses the 2^-24
    out_x, out_ab, out_fma = torch.empty(1024, dtype=torch.bfloat16), torch.empty(16, 16), torch.empty(1024)
    round_and_dot[(1,)](x, a, b, out_x, out_ab, out_fma, N=1024, M=16)
    assert out_fma[-1].item() == 2**-12 + 2**-24
    expected = x.to(torch.bfloat16)
    same = (out_x.view(torch.int16) == expected.view(torch.int16)) | (out_x.isnan() & expected.isnan())
    assert same.all(), f"{x[~same][:4]} -> {out_x[~same][:4]}, torch: {expected[~same][:4]}"
    torch.testing.assert_close(out_ab, a.float() @ b.float())


HASHED_SOURCE = '''"""A module docstring."""
x = 1  # a comment
# a page break\x0c and a line separator\u2028 in comments

y = f"a{x}b{'c'}" + f'{x!r:>{10}}' + rf"\\d{x}"
z = f"""multi
line {x
} end"""
w = f"{f'{x}'}"


def g():
    """A docstring."""
    return f"{x=}" + "{x}"
'''


def test_code_hash_is_the_same_under_every_python():
    """A tuned DB measured under one Python is current under another: token numbers and f-string tokens differ
    between versions (3.12 split f-strings into tokens), the hash does not. 3.11, 3.12 and 3.13 give this value;
    comments and docstrings do not change it, code does."""
    assert loader.code_hash(HASHED_SOURCE) == "1a8a2900309b9215"
    reworded = HASHED_SOURCE.replace("# a comment", "# another").replace('"""A docstring."""', '"""Other."""')
    assert loader.code_hash(reworded) == "1a8a2900309b9215"
    assert loader.code_hash(HASHED_SOURCE.replace("line {x", "line {x + 1")) != "1a8a2900309b9215"


def test_code_hash_takes_python_3_12_f_string_tokens_as_one_string(monkeypatch):
    """Python 3.12+ splits an f-string into FSTRING_START, its parts and FSTRING_END (CI runs an older Python, so
    this feeds that stream by hand): the hash is the one of the single STRING token older versions give."""
    import tokenize

    source = '# a page break\x0c here\ny = f"a{x:>{w}}b"\n'
    expected = loader.code_hash(source)
    numbers = {name: 1000 + i for i, name in enumerate(("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END"))}
    for name, number in numbers.items():
        monkeypatch.setitem(tokenize.tok_name, number, name)

    def token(kind, text, start, end):
        number = numbers.get(kind, getattr(tokenize, kind, None))
        return tokenize.TokenInfo(number, text, (2, start) if isinstance(start, int) else start,
                                  (2, end) if isinstance(end, int) else end, "")

    stream = [token("COMMENT", "# a page break\x0c here", (1, 0), (1, 21)), token("NL", "\n", (1, 21), (1, 22)),
              token("NAME", "y", 0, 1), token("OP", "=", 2, 3), token("FSTRING_START", 'f"', 4, 6),
              token("FSTRING_MIDDLE", "a", 6, 7), token("OP", "{", 7, 8), token("NAME", "x", 8, 9),
              token("OP", ":", 9, 10), token("FSTRING_MIDDLE", ">", 10, 11), token("OP", "{", 11, 12),
              token("NAME", "w", 12, 13), token("OP", "}", 13, 14), token("OP", "}", 14, 15),
              token("FSTRING_MIDDLE", "b", 15, 16), token("FSTRING_END", '"', 16, 17), token("NEWLINE", "\n", 17, 18),
              token("ENDMARKER", "", (3, 0), (3, 0))]
    assert "".join(t.string for t in stream[2:-1]) == 'y=f"a{x:>{w}}b"\n'
    monkeypatch.setattr(tokenize, "generate_tokens", lambda readline: iter(stream))
    assert loader.code_hash(source) == expected  # rows counted as readline does: a form feed breaks none
