"""Shared-memory estimates against what Triton compiles for sm_90, and the heuristic's configs fitting them."""

from __future__ import annotations

import pytest

from fatune.kernel.spec import KERNELS, KernelSpec, LaunchConfig
from fatune.kernel.triton.heuristics import default_config
from fatune.kernel.triton.resources import fit_shared_memory, shared_memory_bytes, shared_memory_limit, uncompilable
from fatune.tuning.space import infeasible
from tests.test_codegen import _compile_in_subprocess

HOPPER = 227 * 1024

# (spec, an additive mask's Triton type, GPU): the variants whose streamed mask tiles press a config chosen
# without them (a 64x64 forward three stages deep at d256 needs 246784 bytes with a bf16 mask, over an H200's),
# and tiles shrunk for a 99 KiB GPU
MASKED_CASES = [
    (KernelSpec("bfloat16", 256, attn_mask="additive"), "fp32", (9, 0)),
    (KernelSpec("float16", 192, causal=True, attn_mask="bool", alibi=True), None, (9, 0)),
    (KernelSpec("bfloat16", 256, attn_mask="additive"), "fp32", (8, 6)),
    (KernelSpec("float32", 128, causal=True), None, (8, 6)),
]


@pytest.mark.parametrize("spec, mask_dtype, arch", MASKED_CASES,
                         ids=["bf16-d256-additive-fp32-sm90", "fp16-d192-causal-bool-alibi-sm90",
                              "bf16-d256-additive-fp32-sm86", "fp32-d128-causal-sm86"])
def test_heuristic_kernels_compile_within_their_estimate_and_their_gpus_shared_memory(spec, mask_dtype, arch, tmp_path):
    """Compiled for their GPU with a contiguous mask (its key stride specialised to 1, as launches do): each
    kernel's shared memory is at most the estimate, and the estimate at most the GPU's per block. One case per
    test: their compiles (10-25 s each) then spread over the test workers."""
    script = (
        "from fatune.kernel.triton import offline\n"
        "from fatune.kernel.triton.heuristics import default_config\n"
        "from fatune.kernel.triton.resources import shared_memory_bytes\n"
        "from fatune.kernel.spec import KernelSpec\n"
        f"spec, mask_dtype, arch, limit = KernelSpec(**{spec.to_dict()!r}), {mask_dtype!r}, {arch!r}, "
        f"{shared_memory_limit(arch)!r}\n"
        "config = default_config(spec, arch)\n"
        "for kernel in ('fwd', 'dkdv', 'dq'):\n"
        "    info = offline.compile_kernel(kernel, spec, config, arch=arch, mask_dtype=mask_dtype)\n"
        "    estimate = shared_memory_bytes(kernel, spec, getattr(config, kernel), arch)\n"
        "    assert info.shared_bytes <= estimate <= limit, (kernel, spec, mask_dtype, arch, info, estimate)\n"
        "    print(kernel, spec.head_dim, mask_dtype, arch, info.shared_bytes, estimate)\n"
    )
    assert len(_compile_in_subprocess(script, tmp_path).splitlines()) == 3


@pytest.mark.parametrize("arch", [(9, 0), (8, 0), (8, 6), (12, 0), (7, 5)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("head_dim", [16, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("variant", [{}, {"causal": True}, {"attn_mask": "bool"}, {"attn_mask": "additive"},
                                     {"causal": True, "attn_mask": "additive", "alibi": True, "dropout": True}],
                         ids=["plain", "causal", "bool", "additive", "additive-causal-alibi-dropout"])
def test_every_heuristic_config_is_feasible_on_its_gpu(variant, head_dim, dtype, arch):
    spec = KernelSpec(dtype, head_dim, **variant)
    limit = shared_memory_limit(arch)
    for decode, shares_sms, group in ((False, False, 1), (True, False, 1), (True, True, 1), (False, False, 8)):
        config = default_config(spec, arch, decode, shares_sms, group)
        for kernel in KERNELS:  # the search's own check: fits, and enough elements per thread for its warps
            launch = getattr(config, kernel)
            if arch == (7, 5) and dtype == "float32" and head_dim > 128 and kernel != "fwd":
                # 64 KiB cannot hold float32 d256 K and V tiles of 16 rows: the smallest tiles, the compile decides
                assert (launch.block_m, launch.block_n, launch.num_stages) == (16, 16, 1), launch
                continue
            assert infeasible(kernel, spec, launch, limit, arch) is None, (kernel, config)


def test_only_the_stages_that_do_not_fit_are_dropped():
    spec = KernelSpec("bfloat16", 256, attn_mask="additive")
    config = default_config(KernelSpec("bfloat16", 256), (9, 0))  # chosen without the mask
    fitted = fit_shared_memory(config, spec, HOPPER)
    assert config.fwd.num_stages == 3 and fitted.fwd.num_stages == 2
    assert (fitted.fwd.block_m, fitted.fwd.block_n, fitted.fwd.tma) == (config.fwd.block_m, config.fwd.block_n, 1)
    assert (fitted.dkdv, fitted.dq) == (config.dkdv, config.dq)
    assert fit_shared_memory(config, KernelSpec("bfloat16", 256), HOPPER) == config
    tiny = fit_shared_memory(config, spec, 1024)  # nothing fits: one stage of 16x16 tiles each, the compile decides
    assert all(getattr(tiny, kernel).num_stages == 1 and getattr(tiny, kernel).block_m == getattr(tiny, kernel).block_n
               == 16 for kernel in KERNELS)


def test_a_tile_too_big_at_one_stage_is_halved_on_its_streamed_side():
    spec = KernelSpec("float32", 256)
    config = default_config(spec, (8, 6))  # float32 at d256 on a 99 KiB GPU
    assert (config.fwd.block_m, config.fwd.block_n) == (64, 16) and config.fwd.num_stages == 1
    assert (config.dkdv.block_m, config.dkdv.block_n) == (16, 32) and (config.dq.block_m, config.dq.block_n) == (32, 16)
    assert config.dkdv.num_warps == config.dq.num_warps == 2  # 512 elements: 8 per thread of two warps


def test_a_mask_tile_counts_at_its_widest_type_per_buffer():
    plain, bool_mask, additive = (KernelSpec("bfloat16", 128, attn_mask=kind) for kind in ("none", "bool", "additive"))
    tile = LaunchConfig(128, 64, num_warps=8, num_stages=3)
    assert shared_memory_bytes("fwd", bool_mask, tile) - shared_memory_bytes("fwd", plain, tile) == 2 * 128 * 64 * 4
    assert shared_memory_bytes("fwd", additive, tile) - shared_memory_bytes("fwd", plain, tile) == 2 * 128 * 64 * 4
    one = LaunchConfig(128, 64, num_warps=8, num_stages=1)  # unpipelined: one buffer on its way to the MMA layout
    assert shared_memory_bytes("dq", additive, one) - shared_memory_bytes("dq", plain, one) == 128 * 64 * 4


def test_unknown_gpus_get_the_smallest_limit_of_their_generation():
    assert shared_memory_limit((9, 0)) == HOPPER and shared_memory_limit((8, 6)) == 99 * 1024
    assert shared_memory_limit((12, 1)) == 99 * 1024 and shared_memory_limit((7, 5)) == 64 * 1024
    assert shared_memory_limit((6, 1)) == 64 * 1024




# (spec, dQ tiles, GPU): configs Triton 3.6 cannot compile and their nearest neighbours that it can
DQ_COMPILES = [
    (KernelSpec("bfloat16", 128, causal=True), LaunchConfig(128, 64, num_warps=4, num_stages=2), (9, 0)),
    (KernelSpec("float16", 64, seqlens="varlen"), LaunchConfig(128, 32, num_warps=4, num_stages=1), (9, 0)),
    (KernelSpec("bfloat16", 128, causal=True), LaunchConfig(128, 64, num_warps=8, num_stages=1), (9, 0)),
    (KernelSpec("bfloat16", 128, causal=True), LaunchConfig(64, 64, num_warps=4, num_stages=2), (9, 0)),
    (KernelSpec("bfloat16", 128), LaunchConfig(128, 64, num_warps=4, num_stages=2), (8, 0)),
]


def test_the_dq_tiles_triton_cannot_compile_are_known_before_compiling(tmp_path):
    """A search rejects a config its compiler would fail on before spending a trial (a GPU search of d128
    causal lost 4 of 30 dQ trials to them): uncompilable names exactly the cases whose compile fails. One process
    compiles them all."""
    script = "\n".join([
        "import os",
        "from fatune.kernel.triton import offline",
        "from fatune.kernel.triton.heuristics import default_config",
        "from fatune.kernel.spec import KernelSpec, LaunchConfig",
        "cases = [" + ", ".join(f"(KernelSpec.from_dict({spec.to_dict()!r}), "
                               f"LaunchConfig.from_dict({config.to_dict()!r}), {arch!r})"
                               for spec, config, arch in DQ_COMPILES) + "]",
        "quiet = os.open(os.devnull, os.O_WRONLY)",
        "for spec, config, arch in cases:",
        "    stderr = os.dup(2); os.dup2(quiet, 2)  # the compiler's failure prints its pass pipeline",
        "    try:",
        "        offline.compile_kernel('dq', spec, default_config(spec, arch).replace(dq=config), arch=arch, group=1)",
        "        print('compiles')",
        "    except Exception as error:",
        "        print('fails', type(error).__name__)",
        "    finally:",
        "        os.dup2(stderr, 2)",
    ])
    outcomes = _compile_in_subprocess(script, tmp_path).splitlines()
    expected = ["fails" if uncompilable("dq", spec, config, arch) else "compiles"
                for spec, config, arch in DQ_COMPILES]
    assert [outcome.split()[0] for outcome in outcomes] == expected
    assert expected.count("fails") == 2
    assert all(infeasible("dq", spec, config, 227 * 1024, arch) for spec, config, arch in DQ_COMPILES
               if uncompilable("dq", spec, config, arch))
