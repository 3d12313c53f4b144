"""What a launch config asks of a GPU before it is compiled: shared memory per block.

The search rejects configs that cannot fit without compiling them, and the heuristic lowers its
pipeline depth where a variant's extra tiles (a mask's) would not fit. The estimates are fitted to
what Triton 3.6 reports for sm_90 and sm_86 (fatune.kernel.triton.offline.compile_kernel), rounded up.
"""

from __future__ import annotations

import dataclasses

import triton

from fatune.hardware import Arch
from fatune.kernel.spec import KERNELS, AttentionConfig, KernelSpec, LaunchConfig, lanes

ELEMENT_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
# a mask tile's element as staged in shared memory, at its widest: an additive mask's allowed float32, and 4 bytes
# for a bool mask too (Triton 3.6 stages its bytes as 32-bit words in some kernels: d192 causal with ALiBi)
MASK_ELEMENT_BYTES = {"none": 0, "bool": 4, "additive": 4}
PIPELINE_BARRIERS = 1024  # what a pipelined loop (or atomic dQ's staging) keeps beside its buffers
MIN_ELEMENTS_PER_THREAD = 8  # a tile under this many elements per thread leaves its warps idle (fatune.tuning.search)

# Shared memory one block may opt in to, by compute capability
HOPPER_SHARED_MEMORY = 227 * 1024
SHARED_MEMORY_PER_BLOCK = {(7, 0): 96 * 1024, (7, 2): 96 * 1024, (7, 5): 64 * 1024, (8, 0): 163 * 1024,
                           (8, 7): 163 * 1024, (9, 0): HOPPER_SHARED_MEMORY, (10, 0): HOPPER_SHARED_MEMORY,
                           (10, 3): HOPPER_SHARED_MEMORY}
SHARED_MEMORY_DEFAULT = 99 * 1024  # sm_86, sm_89, sm_120 and others from sm_80 on; older ones: 64 KiB


def uncompilable(kernel: str, spec: KernelSpec, config: LaunchConfig, arch: Arch) -> str | None:
    """Why Triton cannot compile `config` of `kernel` for `spec` on `arch` (None: not known to fail). Triton 3.6's
    layout-conversion pass fails on a 16-bit dQ kernel of 128-row tiles on 4 warps for sm_90, at every head dim
    and mask (it compiles for sm_80, and on 2 or 8 warps)."""
    if (kernel == "dq" and arch == (9, 0) and spec.dtype != "float32" and config.block_m == 128
            and config.num_warps == 4 and triton.__version__.startswith("3.6.")):
        return "Triton 3.6 cannot compile a 16-bit dQ kernel of 128-row tiles on 4 warps for sm_90"
    return None


def shared_memory_limit(arch: Arch) -> int:
    """Bytes of shared memory a block can have on a GPU of compute capability `arch`."""
    arch = tuple(arch)
    return SHARED_MEMORY_PER_BLOCK.get(arch, SHARED_MEMORY_DEFAULT if arch >= (8, 0) else 64 * 1024)


def shared_memory_bytes(kernel: str, spec: KernelSpec, config: LaunchConfig, arch: Arch = (9, 0)) -> int:
    """Estimate of a kernel's shared memory on a GPU of compute capability `arch`: resident tiles plus
    num_stages copies of streamed tiles.

    A mask's tile streams beside them at its widest element type: num_stages - 1 buffers when pipelined,
    one when not (on its way to the tensor-core layout). Where the products are not wgmma's (float32, or GPUs
    other than sm_90) dK/dV stages its float32 P and dS tiles for the transposed products too. Near the limits
    it is at or above Triton 3.6's reports on sm_90 and sm_86; far below them it can undercount by up to 16 KiB
    (an unpipelined dK/dV tile of pointer loads on sm_90; forward and dQ tiles of float32, or of small head
    dims off sm_90, by up to 7 KiB: tests/test_resources.py compiles every kernel config a heuristic launch can make).
    """
    element = ELEMENT_BYTES[spec.dtype]
    d, dv = lanes(spec.head_dim), lanes(spec.head_dim_v)
    m, n, stages = config.block_m, config.block_n, config.num_stages
    mask = MASK_ELEMENT_BYTES[spec.attn_mask] * m * n * max(stages - 1, 1)
    barriers = PIPELINE_BARRIERS if stages > 1 else 0
    if kernel == "dkdv":  # K and V tiles resident, Q and dO tiles streamed; atomic dQ stages its float32 dS K tile
        # (and TMA reductions more): a rough fit to fatune.kernel.triton.offline's reports, the compile decides near the limit;
        # a pipelined head-dim split streams its own halves of Q and dO as well
        streamed = m * (d + dv) * (3 if config.split_d == 2 and stages > 1 else 2) // 2
        atomic = {0: 0, 1: 4, 2: 6}[config.atomic_dq] * m * d + (PIPELINE_BARRIERS if config.atomic_dq else 0)
        # float32 P and dS tiles staged for mma's transposed products (not wgmma's: sm_90's 16-bit kernels)
        staged = 4 * m * n if spec.dtype == "float32" else 8 * m * n if tuple(arch)[0] != 9 else 0
        return element * (n * (d + dv) + stages * streamed) + atomic + staged + mask + barriers
    if kernel == "fwd":  # Q tile resident, K and V tiles streamed
        return element * (m * d + stages * n * (d + dv)) + mask + barriers
    return element * (m * (d + dv) + stages * n * (d + dv)) + mask + barriers  # dq: Q, dO resident, K, V streamed


def fit_shared_memory(config: AttentionConfig, spec: KernelSpec, limit: int, arch: Arch = (9, 0)) -> AttentionConfig:
    """`config` with each kernel's shared-memory estimate brought within `limit` bytes: its pipeline made
    shallower first (down to one stage), then its streamed tile halved (down to 16 rows) with its warps kept
    at MIN_ELEMENTS_PER_THREAD elements each or more, as a config chosen for another variant or GPU needs (a
    mask's tiles on Hopper, float32 at d256 on a 99 KiB GPU)."""
    changes = {}
    for kernel in KERNELS:
        launch = getattr(config, kernel)
        streamed = "block_m" if kernel == "dkdv" else "block_n"  # dK/dV streams query tiles, the others key tiles
        while shared_memory_bytes(kernel, spec, launch, arch) > limit:
            if launch.num_stages > 1:
                launch = dataclasses.replace(launch, num_stages=launch.num_stages - 1)
            elif max(launch.block_m, launch.block_n) > 16:
                side = streamed if getattr(launch, streamed) > 16 else ({"block_m", "block_n"} - {streamed}).pop()
                launch = dataclasses.replace(launch, **{side: getattr(launch, side) // 2})
                warps = launch.num_warps
                while warps > 1 and launch.block_m * launch.block_n < warps * 32 * MIN_ELEMENTS_PER_THREAD:
                    warps //= 2
                launch = dataclasses.replace(launch, num_warps=warps)
            else:
                break  # nothing left to shrink: the compile decides
        changes[kernel] = launch
    return config.replace(**changes)
