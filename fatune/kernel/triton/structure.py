"""Which code structures of the Triton family run for a kernel spec: atomic dQ, the head-dim split, dQ beside dK/dV.

A config may ask for a structure that cannot run for a spec (atomic dQ on float32, TMA reductions without
TMA, a head-dim split of halves too narrow to compile right); these rules lower it to what runs, the same
way at launch, in the search and in the tuned DB's hashes.
"""

from __future__ import annotations

import dataclasses

from fatune.kernel.spec import AttentionConfig, KernelSpec, LaunchConfig, lanes


def atomic_dq_kinds(spec: KernelSpec) -> tuple[int, ...]:
    """The atomic_dq values that run as themselves for `spec` (fatune.kernel.triton.resolve.resolve lowers the others):
    only 0 for float32 (its gradients are Kahan-summed, which atomics cannot do) and at head dims up to
    16 (fp16 d16 causal dQ measured 2.06x torch's error on the H200 when atomic dQ's Delta came from the
    16-bit O; it now sums P dP where rows see few keys, as the dQ kernel does, not yet re-measured there);
    2 only where TMA can address dQ's float32 rows (head dim a multiple of 4)."""
    if spec.dtype == "float32" or max(spec.head_dim, spec.head_dim_v) <= 16:
        return (0,)
    return (0, 1, 2) if spec.head_dim % 4 == 0 else (0, 1)


def with_runnable_atomic_dq(config: AttentionConfig, spec: KernelSpec, tma: bool) -> AttentionConfig:
    """`config` with its dK/dV atomic_dq lowered to the next kind that runs for `spec` (atomic_dq_kinds;
    TMA reductions only when `tma`), as a launch runs it."""
    kinds = [kind for kind in atomic_dq_kinds(spec) if tma or kind != 2]
    if config.dkdv.atomic_dq in kinds:
        return config
    lower = max(kind for kind in kinds if kind < config.dkdv.atomic_dq)
    return config.replace(dkdv=dataclasses.replace(config.dkdv, atomic_dq=lower))


# the split runs on head dims of at least this many lanes (halves of 64): Triton 3.6 gave wrong dK on an H200 with
# halves of 32 (d64) and 16 (d20, d32) at 64x64/w4/s1 tiles, every length tried (65-300), and with TMA-reduced dQ
# read shared memory out of bounds (random call seed 1067163355; H200, 2026-12-04). Halves of
# 64 and 128 ran correctly; the search offers the split from SPLIT_D_LANES only, where it can pay
SPLIT_D_MIN_LANES = 128


# the search offers the split from this many lanes (at 128 it lost on every dK/dV tile, L=4096, H200)
SPLIT_D_LANES = 256


def split_d_searched(spec: KernelSpec) -> bool:
    """Whether searches of `spec` offer dK/dV's head-dim split."""
    return min(lanes(spec.head_dim), lanes(spec.head_dim_v)) >= SPLIT_D_LANES


def split_d_runs(spec: KernelSpec) -> bool:
    """Whether dK/dV's head-dim split can run for `spec`: each half of at least 64 lanes (SPLIT_D_MIN_LANES), so
    the two head dims' halves are within 2x of each other as well (Triton 3.6 miscompiled halves of 128 and 32
    under a GQA loop: an illegal address on an H200 at 64x128/w8)."""
    return min(lanes(spec.head_dim), lanes(spec.head_dim_v)) >= SPLIT_D_MIN_LANES


def with_runnable_split_d(config: AttentionConfig, spec: KernelSpec) -> AttentionConfig:
    """`config` with its dK/dV head-dim split dropped where it cannot run (split_d_runs), as a launch runs it."""
    if config.dkdv.split_d == 1 or split_d_runs(spec):
        return config
    return config.replace(dkdv=dataclasses.replace(config.dkdv, split_d=1))


def runnable_backward(config: AttentionConfig, spec: KernelSpec, tma: bool) -> AttentionConfig:
    """`config`'s backward structure as a launch for `spec` runs it: atomic dQ lowered to a kind that runs
    (TMA reductions only when `tma`), the head-dim split dropped where its halves are too narrow, a concurrent
    dQ kernel dropped where atomic dQ leaves no dQ kernel to run."""
    config = with_runnable_split_d(with_runnable_atomic_dq(config, spec, tma), spec)
    if config.dkdv.atomic_dq and config.dq.concurrent:
        config = config.replace(dq=dataclasses.replace(config.dq, concurrent=0))
    return config


def atomic_dq_pass_config(config: AttentionConfig, kernel: str) -> LaunchConfig:
    """The launch config of the passes around the dK/dV kernel, `kernel` 'prep' (Delta, and atomic dQ's zeroed
    accumulator; also before a concurrent dQ kernel) or 'dq_store' (atomic dQ's): dQ's tile and warps without
    its register cap; the prep pass unpipelined, as its
    key loop runs only on query tiles whose rows see few keys, and stages would reserve shared memory (up to
    160 KiB at d128) for every program of an otherwise memory-bound pass."""
    if kernel not in ("prep", "dq_store"):
        raise ValueError(f"kernel: expected 'prep' or 'dq_store', got {kernel!r}")
    return dataclasses.replace(config.dq, maxnreg=0, num_stages=1 if kernel == "prep" else config.dq.num_stages,
                               concurrent=0)
