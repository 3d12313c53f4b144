"""What a launch config asks of a GPU before it is compiled: shared memory per block.

The search rejects configs that cannot fit without compiling them, and the heuristic lowers its
pipeline depth where a variant's extra tiles (a mask's) would not fit. The estimates are fitted to
what Triton 3.6 reports for sm_90 (fatune.offline.compile_kernel), rounded up.
"""

from __future__ import annotations

import dataclasses

from fatune.spec import KERNELS, AttentionConfig, KernelSpec, LaunchConfig, lanes

ELEMENT_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
# a mask tile's element as staged in shared memory, at its widest: an additive mask's allowed float32, and 4 bytes
# for a bool mask too (Triton 3.6 stages its bytes as 32-bit words in some kernels: d192 causal with ALiBi)
MASK_ELEMENT_BYTES = {"none": 0, "bool": 4, "additive": 4}
PIPELINE_BARRIERS = 1024  # what a pipelined loop keeps beside its buffers (Triton 3.6, sm_90)

# Shared memory one block may opt in to, by compute capability; others: SHARED_MEMORY_DEFAULT
HOPPER_SHARED_MEMORY = 227 * 1024
SHARED_MEMORY_PER_BLOCK = {(8, 0): 163 * 1024, (8, 7): 163 * 1024, (9, 0): HOPPER_SHARED_MEMORY,
                           (10, 0): HOPPER_SHARED_MEMORY, (10, 3): HOPPER_SHARED_MEMORY}
SHARED_MEMORY_DEFAULT = 99 * 1024  # sm_86, sm_89, sm_120: the smallest of the GPUs Triton targets


def shared_memory_limit(arch: tuple[int, int]) -> int:
    """Bytes of shared memory a block can have on a GPU of compute capability `arch`."""
    return SHARED_MEMORY_PER_BLOCK.get(tuple(arch), SHARED_MEMORY_DEFAULT)


def shared_memory_bytes(kernel: str, spec: KernelSpec, config: LaunchConfig) -> int:
    """Estimate of a kernel's shared memory: resident tiles plus num_stages copies of streamed tiles.

    A mask's tile streams beside them at its widest element type: num_stages - 1 buffers when pipelined;
    unpipelined, the forward's and dQ's still pass one through shared memory to the tensor-core layout
    (dK/dV's at most half of one).
    """
    element = ELEMENT_BYTES[spec.dtype]
    d, dv = lanes(spec.head_dim), lanes(spec.head_dim_v)
    m, n, stages = config.block_m, config.block_n, config.num_stages
    mask_tile = MASK_ELEMENT_BYTES[spec.attn_mask] * m * n
    barriers = PIPELINE_BARRIERS if stages > 1 else 0
    if kernel == "dkdv":  # K and V tiles resident, Q and dO tiles streamed; atomic dQ stages its float32 dS K tile
        # (and TMA reductions more): a rough fit to fatune.offline's reports, the compile decides near the limit;
        # a pipelined head-dim split streams its own halves of Q and dO as well
        streamed = m * (d + dv) * (3 if config.split_d == 2 and stages > 1 else 2) // 2
        mask = mask_tile * (stages - 1) if stages > 1 else mask_tile // 2
        transposed = 4 * m * n if spec.dtype == "float32" else 0  # its P and dS staged for mma's transposed dots
        return element * (n * (d + dv) + stages * streamed) + {0: 0, 1: 4, 2: 6}[config.atomic_dq] * m * d \
            + mask + barriers + transposed
    mask = mask_tile * max(stages - 1, 1)
    if kernel == "fwd":  # Q tile resident, K and V tiles streamed
        return element * (m * d + stages * n * (d + dv)) + mask + barriers
    return element * (m * (d + dv) + stages * n * (d + dv)) + mask + barriers  # dq: Q, dO resident, K, V streamed


def fit_shared_memory(config: AttentionConfig, spec: KernelSpec, limit: int) -> AttentionConfig:
    """`config` with each kernel's shared-memory estimate brought within `limit` bytes: its pipeline made
    shallower first (down to one stage), then its streamed tile halved (down to 16 rows), as a config chosen
    for another variant or GPU needs (a mask's tiles on Hopper, float32 at d256 on a 99 KiB GPU)."""
    changes = {}
    for kernel in KERNELS:
        launch = getattr(config, kernel)
        streamed = "block_m" if kernel == "dkdv" else "block_n"  # dK/dV streams query tiles, the others key tiles
        while shared_memory_bytes(kernel, spec, launch) > limit:
            if launch.num_stages > 1:
                launch = dataclasses.replace(launch, num_stages=launch.num_stages - 1)
            elif max(launch.block_m, launch.block_n) > 16:
                side = streamed if getattr(launch, streamed) > 16 else ({"block_m", "block_n"} - {streamed}).pop()
                launch = dataclasses.replace(launch, **{side: getattr(launch, side) // 2})
            else:
                break  # nothing left to shrink: the compile decides
        changes[kernel] = launch
    return config.replace(**changes)
