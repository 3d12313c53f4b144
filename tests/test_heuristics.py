"""The built-in heuristic: a config for every head dim and dtype, decode tiles for few queries."""

from __future__ import annotations

import pytest

from fatune.heuristics import default_config
from fatune.spec import KernelSpec


@pytest.mark.parametrize("arch", [(9, 0), (8, 0), None], ids=["hopper", "ampere", "interpreter"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("head_dim", [1, 16, 40, 50, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_every_head_dim_and_dtype_has_a_config(head_dim, dtype, arch, causal):
    spec = KernelSpec(dtype, head_dim, causal=causal)
    for decode, fills_gpu in ((False, False), (True, False), (True, True)):
        config = default_config(spec, arch, decode, fills_gpu)
        assert config.fwd.num_splits == 0 and config.fwd.pack_gqa == 1  # chosen at launch from the grid
        assert set(config.dkdv.structure) <= {"tma", "atomic_dq", "split_d"} and not config.dq.structure  # measured kinds
        if arch == (9, 0):  # fits an H100/H200's 227 KiB of shared memory per block, by the search's estimate
            from fatune.search import infeasible

            for kernel in ("fwd", "dkdv", "dq"):
                assert infeasible(kernel, spec, getattr(config, kernel), 227 * 1024) is None


def test_decode_calls_get_small_query_tiles_on_gpus():
    spec = KernelSpec("bfloat16", 128)
    assert default_config(spec, (9, 0), decode=True).fwd.block_m == 16
    assert default_config(spec, (9, 0), decode=False).fwd.block_m >= 64
    assert default_config(spec, (9, 0), decode=True).dkdv == default_config(spec, (9, 0)).dkdv


@pytest.mark.parametrize("head_dim, split, filled", [(64, 4, 2), (128, 4, 2), (256, 2, 2)])
def test_decode_tiles_stream_deeper_when_the_keys_are_split(head_dim, split, filled):
    """One program per multiprocessor when the keys are split: 4 stages deep (2 at d256, for shared memory);
    2 when the tiles fill the GPU and programs share multiprocessors."""
    spec = KernelSpec("bfloat16", head_dim)
    assert default_config(spec, (9, 0), decode=True).fwd.num_stages == split
    assert default_config(spec, (9, 0), decode=True, fills_gpu=True).fwd.num_stages == filled
