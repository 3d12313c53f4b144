"""What a Gluon config needs of a Hopper GPU, decided without compiling: the search rejects a config that cannot
fit before it spends a trial on it."""

from __future__ import annotations

import triton

from fatune.kernel.gluon.codegen import backward_dq_slice, backward_head_split, unpersistent, unshared_dq, width
from fatune.kernel.spec import GLUON_SPLIT_M, GluonBackwardConfig, GluonConfig, KernelSpec

ELEMENT_BYTES = 2  # float16 and bfloat16, the only dtypes the family takes


def shared_memory_bytes(spec: KernelSpec, config: GluonConfig) -> int:
    """Shared memory of one program, an upper bound within 1 KiB of what Triton allocates: the consumers' Q tiles
    (reused for O), the K and V ring, each consumer's pinned row sums (or, one step after the other, the
    scratch of its layout conversions), the mbarriers and, with key lengths, the descriptors made in-kernel."""
    lanes = width(spec.head_dim)
    tiles = (config.consumers * GLUON_SPLIT_M + 2 * config.num_stages * config.block_n) * lanes * ELEMENT_BYTES
    pinned = config.consumers * GLUON_SPLIT_M * 4
    # Q's (ready, persistent: empty too; ping-pong's turns), the ring's
    barriers = 8 * ((1 + config.persistent + config.pingpong) * config.consumers + 4 * config.num_stages)
    # the descriptors made in-kernel: the sequence's K and V, and packed, its Q and each consumer's O
    descriptors = {"fixed": 0, "seqlens_k": 2 * 128, "varlen": (3 + config.consumers) * 128}[spec.seqlens]
    return tiles + pinned + barriers + descriptors + 64  # alignment


def infeasible(spec: KernelSpec, config: GluonConfig, shared_limit: int | None) -> str | None:
    """Why `config` cannot run for `spec` on a GPU with `shared_limit` bytes of shared memory per block (None:
    unknown, anything goes); None if it may."""
    reason = unpersistent(spec, config)
    if reason is not None:
        return reason
    if shared_limit is None:
        return None
    needed = shared_memory_bytes(spec, config)
    if needed > shared_limit:
        return f"needs ~{needed // 1024} KiB shared memory, the GPU has {shared_limit // 1024} KiB per block"
    if config.consumers == 3 and width(spec.head_dim) > 64:  # sm_90 compiles: 248 B spilled at d128, no overlap
        return f"three consumer warpgroups of {config.consumer_regs} registers spill at head dim {spec.head_dim}"
    return None


def backward_shared_memory_bytes(spec: KernelSpec, config: GluonBackwardConfig) -> int:
    """Shared memory of one backward program, an upper bound within 1 KiB of what Triton allocates: each
    key group's K and V tiles, the Q and dO ring, each key group's dS tile (two under a band: dS's low part;
    twice that where the consumers share dQ's reduction: two slots; with a head-dim split, its P tile too), each
    consumer's float32 dQ slice and the mbarriers."""
    lanes, split = width(spec.head_dim), backward_head_split(spec)
    keys = 2 * (config.consumers // split) * GLUON_SPLIT_M * lanes * ELEMENT_BYTES
    ring = 2 * config.num_stages * config.block_m * lanes * ELEMENT_BYTES
    banded = spec.causal or spec.window_left or spec.window_right
    slots = 2 if config.shared_dq else 1
    tiles = slots * (2 if banded else 1) + (split > 1)  # with a head-dim split, P's tile too
    ds = tiles * (config.consumers // split) * GLUON_SPLIT_M * config.block_m * ELEMENT_BYTES
    dq = config.consumers * config.block_m * backward_dq_slice(spec, config) * 4
    ds_barriers = 2 * (config.consumers // split) if split > 1 else 2  # each key group's handover, or dS slots
    barriers = 8 * (config.consumers // split + 3 * config.num_stages + ds_barriers)
    return keys + ring + ds + dq + barriers + 512  # alignment


def backward_uncompilable(spec: KernelSpec, config: GluonBackwardConfig) -> str | None:
    """Why Triton 3.6's ptxas cannot compile the backward `config` for `spec` (None: not known to fail). It crashes
    (exit -11) on the one-loop kernel ALiBi keeps (its two-part dS in every tile) where each of two consumers
    reduces its own dQ in 64-lane slices with 232 or more registers on 128 lanes under a causal mask without a
    window, three 64-row stages deep (d96 and d128; bottom-right measured, top-left taken with it). Without ALiBi
    only programs whose rows see few keys carry the split, and these configs compile."""
    if not (spec.alibi and triton.__version__.startswith("3.6.") and config.block_m == 64 and config.consumers == 2
            and not config.shared_dq and config.consumer_regs >= 232 and backward_dq_slice(spec, config) == 64):
        return None
    windowed = spec.window_left or spec.window_right
    if width(spec.head_dim) == 128 and spec.causal and not windowed and config.num_stages == 3:
        return "Triton 3.6's ptxas crashes on this causal ALiBi d128 backward (3 stages, 64-lane dQ, 232+ registers)"
    return None


def backward_infeasible(spec: KernelSpec, config: GluonBackwardConfig, shared_limit: int | None) -> str | None:
    """Why the backward `config` cannot run for `spec` on a GPU with `shared_limit` bytes of shared memory per
    block (None: unknown); None if it may."""
    reason = backward_uncompilable(spec, config)
    if reason is not None:
        return reason
    split = backward_head_split(spec)
    if config.consumers % split:
        return f"{config.consumers} consumer warpgroups cannot share key tiles {split} to a tile"
    reason = unshared_dq(spec, config)
    if reason is not None:
        return f"the consumers cannot share dQ's reduction: {reason}"
    if shared_limit is None:
        return None
    needed = backward_shared_memory_bytes(spec, config)
    if needed > shared_limit:
        return f"needs ~{needed // 1024} KiB shared memory, the GPU has {shared_limit // 1024} KiB per block"
    return None
