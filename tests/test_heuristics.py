"""The built-in heuristic: a config for every head dim and dtype, decode tiles for few queries."""

from __future__ import annotations

import pytest

from fatune.kernel.spec import KernelSpec
from fatune.kernel.triton.heuristics import decode_shares, default_config
from fatune.tuning.shape import Shape


@pytest.mark.parametrize("arch", [(9, 0), (8, 0), None], ids=["hopper", "ampere", "interpreter"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("head_dim", [1, 16, 40, 50, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_every_head_dim_and_dtype_has_a_config(head_dim, dtype, arch, causal):
    spec = KernelSpec(dtype, head_dim, causal=causal)
    for decode, shares_sms, group in ((False, False, 1), (True, False, 1), (True, True, 1), (False, False, 8)):
        config = default_config(spec, arch, decode, shares_sms, group)
        assert config.fwd.num_splits == 0 and config.fwd.pack_gqa == 1  # chosen at launch from the grid
        assert set(config.dkdv.structure) <= {"tma", "atomic_dq", "split_d"}  # measured kinds
        assert set(config.dq.structure) <= {"concurrent"} and not (config.dq.concurrent and config.dkdv.atomic_dq)
        if arch == (9, 0):  # fits an H100/H200's 227 KiB of shared memory per block, by the search's estimate
            from fatune.tuning.space import infeasible

            for kernel in ("fwd", "dkdv", "dq"):
                assert infeasible(kernel, spec, getattr(config, kernel), 227 * 1024) is None


def test_decode_calls_get_small_query_tiles_on_gpus():
    spec = KernelSpec("bfloat16", 128)
    assert default_config(spec, (9, 0), decode=True).fwd.block_m == 16
    assert default_config(spec, (9, 0), decode=False).fwd.block_m >= 64
    assert default_config(spec, (9, 0), decode=True).dkdv == default_config(spec, (9, 0)).dkdv


@pytest.mark.parametrize("head_dim, split, filled", [(64, 4, 2), (128, 4, 2), (256, 2, 2)])
def test_decode_tiles_stream_deeper_with_one_program_per_multiprocessor(head_dim, split, filled):
    """One program per multiprocessor (keys split): 4 stages deep (2 at d256, for shared memory); 2 when the
    tiles give every multiprocessor several programs."""
    spec = KernelSpec("bfloat16", head_dim)
    assert default_config(spec, (9, 0), decode=True).fwd.num_stages == split
    assert default_config(spec, (9, 0), decode=True, shares_sms=True).fwd.num_stages == filled


@pytest.mark.parametrize("shape, packed, sms, shares", [
    (Shape(64, 32, 1, 2048, 128, "bfloat16", kv_heads=8), True, 132, True),  # 512 programs
    (Shape(8, 32, 1, 8192, 128, "bfloat16", kv_heads=8), True, 132, False),  # 64: the keys are split
    (Shape(8, 32, 1, 8192, 128, "bfloat16", kv_heads=8), False, 132, False),  # unpacked: 256 < 264
    (Shape(9, 32, 1, 8192, 128, "bfloat16", kv_heads=8), False, 132, True),  # 288
    (Shape(1, 4, 16, 16, 16, "float16", documents=16), True, 4, True),  # 16 packed one-token documents
])
def test_a_shape_counts_its_decode_programs_as_a_call_does(shape, packed, sms, shares):
    assert decode_shares(shape.problem, sms, packed) is shares


@pytest.mark.parametrize("arch, dtype, head_dim, spec, group, concurrent", [
    ((9, 0), "bfloat16", 128, {"causal": True}, 8, 1),  # GQA causal d128: 1.19x less backward time (H200)
    ((9, 0), "float16", 96, {"causal": True, "bottom_right": True}, 2, 1),
    ((9, 0), "bfloat16", 128, {"causal": True}, 1, 0),  # no GQA: within +-3%
    ((9, 0), "bfloat16", 128, {}, 8, 0),  # not causal: within +-3%
    ((9, 0), "bfloat16", 64, {"causal": True}, 8, 0),  # d64 causal adds dQ atomically: no dQ kernel to run beside
    ((9, 0), "bfloat16", 256, {"causal": True}, 8, 0),  # unmeasured
    ((9, 0), "float32", 128, {"causal": True}, 8, 0),  # unmeasured
    ((9, 0), "bfloat16", 128, {"window_left": True, "window_right": True}, 4, 0),  # a local window: unmeasured
    ((9, 0), "bfloat16", 128, {"causal": True, "window_left": True}, 4, 0),  # a causal sliding window: unmeasured
    ((9, 0), "bfloat16", 128, {"causal": True, "seqlens": "varlen"}, 4, 0),  # packed sequences: unmeasured
    ((9, 0), "bfloat16", 128, {"causal": True, "dropout": True}, 4, 0),  # unmeasured
    ((10, 0), "bfloat16", 128, {"causal": True}, 8, 0),  # Hopper's measurement only
    ((8, 0), "bfloat16", 128, {"causal": True}, 8, 0),
    (None, "float16", 128, {"causal": True}, 8, 0),  # the interpreter runs kernels in order
])
def test_the_dq_kernel_runs_beside_dkdv_for_causal_gqa(arch, dtype, head_dim, spec, group, concurrent):
    config = default_config(KernelSpec(dtype, head_dim, **spec), arch, group=group)
    assert config.dq.concurrent == concurrent and not (concurrent and config.dkdv.atomic_dq)
