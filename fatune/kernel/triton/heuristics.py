"""Built-in launch configs: the last layer of config choice, used when no tuned entry exists.

Chosen per GPU architecture, head dim and dtype. The Hopper tiles are the fastest of a
sweep on an H200 at L=4096, bf16 (2026-11-29);
other architectures get conservative tiles that fit their shared memory.
"""

from __future__ import annotations

import dataclasses

from fatune.hardware import Arch
from fatune.kernel.problem import AttentionProblem
from fatune.kernel.spec import DECODE_QUERIES, AttentionConfig, KernelSpec, LaunchConfig, lanes
from fatune.kernel.triton.resources import (
    HOPPER_SHARED_MEMORY,
    fit_shared_memory,
    shared_memory_limit,
)
from fatune.kernel.triton.structure import with_runnable_split_d


def _hopper(block_d: int, dtype: str, causal: bool) -> AttentionConfig:
    """Forward and backward tiles and TMA: the fastest of each kernel's variants, timed on an H200 (2026-11-30)."""
    wide = dtype == "float32"  # fp32 tiles take twice the shared memory and registers
    if block_d <= 64 and not wide:
        return AttentionConfig(
            fwd=LaunchConfig(128, 64, num_warps=8, num_stages=3),  # 4% over 64x64/w4; TMA gains nothing here
            # causal: dQ added by TMA reductions from the dK/dV kernel, its query and dO through TMA
            # (backward 2.20 vs 2.51 ms with the separate dQ kernel at L=4096); not causal: 4.00 vs 3.96, kept
            dkdv=LaunchConfig(64, 64, num_warps=4, num_stages=3, tma=1, atomic_dq=2) if causal
            else LaunchConfig(32, 128, num_warps=4, num_stages=3),
            # not causal, the dQ kernel capped at 128 registers runs two programs per SM: the backward takes
            # 6-10% less time at L=1024-16384 (bf16, H200); causal runs atomic dQ (this sizes the Delta pass)
            dq=LaunchConfig(128, 64, num_warps=8, num_stages=3, maxnreg=0 if causal else 128),
        )
    if block_d <= 128 and not wide:
        return AttentionConfig(
            # TMA loads: 3-6% over pointer loads at d128 (causal 0.647 vs 0.675 ms, L=4096)
            fwd=LaunchConfig(64, 64, num_warps=4, num_stages=3, tma=1) if causal
            else LaunchConfig(128, 64, num_warps=8, num_stages=3, tma=1),
            dkdv=LaunchConfig(64, 64, num_warps=4, num_stages=2, tma=1),  # TMA query/dO: 3.20 vs 3.37 ms, L=4096
            dq=LaunchConfig(128, 64, num_warps=8, num_stages=3),
        )
    if not wide:  # head dims 129..256: 64-row tiles (forward 1.109 vs 1.952 ms, backward 7.1 vs 22.3 at d256, L=4096)
        return AttentionConfig(
            fwd=LaunchConfig(64, 64, num_warps=4, num_stages=3, tma=1),
            # TMA query/dO loads: 6.59 vs 7.23 ms (causal 3.57 vs 4.67) over 64x64/w8, d256 L=4096; not causal,
            # the head dim split over two programs: 6.13 vs 6.61 ms (causal: 4.14 vs 3.54, kept; H200)
            dkdv=LaunchConfig(64, 32, num_warps=4, num_stages=1, tma=1) if causal
            else LaunchConfig(64, 128, num_warps=8, num_stages=1, tma=1, split_d=2),
            dq=LaunchConfig(128, 64, num_warps=8, num_stages=1),
        )
    return AttentionConfig(
        fwd=LaunchConfig(64, 32, num_warps=4, num_stages=1),
        dkdv=LaunchConfig(16, 64, num_warps=4, num_stages=1),
        dq=LaunchConfig(64, 16, num_warps=4, num_stages=1),
    )


def _generic(block_d: int) -> AttentionConfig:
    if block_d <= 64:
        return AttentionConfig(
            fwd=LaunchConfig(64, 64, num_warps=4, num_stages=2),
            dkdv=LaunchConfig(32, 64, num_warps=4, num_stages=2),
            dq=LaunchConfig(64, 32, num_warps=4, num_stages=2),
        )
    return AttentionConfig(
        fwd=LaunchConfig(64, 32, num_warps=4, num_stages=1),
        dkdv=LaunchConfig(16, 64, num_warps=4, num_stages=1),
        dq=LaunchConfig(64, 16, num_warps=4, num_stages=1),
    )


# The Triton interpreter runs tiles as numpy arrays: mid-sized, unequal tiles keep it quick
# and still exercise several loop iterations and ragged ends on small test shapes.
INTERPRETER_CONFIG = AttentionConfig(
    fwd=LaunchConfig(32, 16, num_warps=4, num_stages=1),
    dkdv=LaunchConfig(16, 32, num_warps=4, num_stages=1),
    dq=LaunchConfig(32, 16, num_warps=4, num_stages=1),
)




def with_forward_structure(config: AttentionConfig) -> AttentionConfig:
    """The forward's structure choices made at launch: split the keys when the grid leaves
    multiprocessors idle (decode, short batches), pack GQA groups into one tile."""
    return config.replace(fwd=dataclasses.replace(config.fwd, num_splits=0, pack_gqa=1))


DECODE_BLOCK_M = 16  # the decode forward's query tile


def decode_shares_sms(batch: int, kv_heads: int, group: int, seqlen_q: int, sms: int) -> bool:
    """Whether a decode call's forward gives each of `sms` multiprocessors at least two programs before any
    key split: one program per DECODE_BLOCK_M rows of each K/V head's query rows (`group` query heads packed;
    1 when unpacked, `kv_heads` then counting every query head), per sequence."""
    return -(-seqlen_q * group // DECODE_BLOCK_M) * kv_heads * batch >= 2 * sms


def _decode_forward(block_d: int, shares_sms: bool) -> LaunchConfig:
    """Few queries against a long cache: a 16-row tile (packed GQA rows fill it) and long key tiles,
    streamed 4 stages deep while each multiprocessor runs one program (its keys split across the GPU, or
    too few tiles to go round), 2 deep when the tiles give every multiprocessor several programs, which
    then hide each other's loads (B=64, L_k=2048 on an H200, ~4 programs per multiprocessor: 133-137 us with
    2 stages, 138-139 with 4; 2 loses where the keys are split)."""
    return LaunchConfig(DECODE_BLOCK_M, 64, num_warps=4, num_stages=4 if block_d <= 128 and not shares_sms else 2)


def concurrent_dq(spec: KernelSpec, arch: Arch, block_d: int, group: int) -> bool:
    """Whether the backward runs its dQ kernel on a second stream beside the dK/dV kernel (after a Delta pass):
    on Hopper, for causal GQA at head dims 65..128 in 16-bit types, where each dK/dV program sums a group of
    query heads and the grid's long causal programs leave multiprocessors idle that the dQ kernel fills. On an
    H200 (bf16) the backward took 1.00-1.19x less time there
    over groups 2/4/8 and L = 1024..16384, and 0.97-1.03x without a causal mask or without GQA; at d64 causal
    atomic dQ stays faster. Only the measured kind of call: a plain causal mask on fixed-length sequences (no
    window, mask tensor, ALiBi, dropout or packing)."""
    plain_causal = spec.causal and not (spec.window_left or spec.window_right or spec.alibi or spec.dropout) and \
        spec.attn_mask == "none" and spec.seqlens == "fixed"
    return arch[0] == 9 and plain_causal and group > 1 and 64 < block_d <= 128 and spec.dtype != "float32"


def unpipelined(config: AttentionConfig) -> AttentionConfig:
    """`config`'s tiles and structure, every kernel at one stage without a register cap: the last fallback
    when the heuristic's own kernels cannot be built. Software pipelining and register caps are where the
    compilers have crashed (ptxas 13 with SIGSEGV on dQ's pipelined key loop once Triton specialised
    L_K = 1, at head dims 16-32 in fp16)."""
    return config.replace(**{kernel: dataclasses.replace(getattr(config, kernel), num_stages=1, maxnreg=0)
                             for kernel in ("fwd", "dkdv", "dq")})


def default_config(spec: KernelSpec, arch: Arch | None, decode: bool = False,
                   shares_sms: bool = False, group: int = 1) -> AttentionConfig:
    """Heuristic config for `spec` on a GPU of compute capability `arch` (None: interpreter);
    `decode`: the call has at most DECODE_QUERIES queries per sequence; `shares_sms`: (decode) its tiles
    give every multiprocessor at least two programs (decode_shares_sms); `group`: query heads per K/V head."""
    if arch is None:
        return with_forward_structure(INTERPRETER_CONFIG)
    block_d = max(lanes(spec.head_dim), lanes(spec.head_dim_v))
    if arch[0] >= 9 and shared_memory_limit(arch) >= HOPPER_SHARED_MEMORY:  # not sm_120's 99 KiB
        config = _hopper(block_d, spec.dtype, spec.causal or spec.window_right)
        if concurrent_dq(spec, arch, block_d, group):
            config = config.replace(dq=dataclasses.replace(config.dq, concurrent=1))
    else:
        config = _generic(block_d if spec.dtype != "float32" else 2 * block_d)
    if decode and spec.dtype != "float32":
        config = config.replace(fwd=_decode_forward(block_d, shares_sms))
    # the tiles above were chosen without a mask: its streamed tiles can take a pipeline stage's room (d > 128)
    config = fit_shared_memory(config, spec, shared_memory_limit(arch), arch)
    return with_forward_structure(with_runnable_split_d(config, spec))


def decode_shares(problem: AttentionProblem, sms: int | None, packed: bool = True) -> bool:
    """Whether `problem` is a decode call whose forward tiles give each of `sms` multiprocessors at least two
    programs (decode_shares_sms; `packed`: its GQA groups packed into the tiles, as the decode forward does);
    False on a GPU of unknown size (None)."""
    group = problem.group_size if packed else 1
    return sms is not None and problem.max_seqlen_q <= DECODE_QUERIES and decode_shares_sms(
        problem.batch, problem.heads // group, group, problem.max_seqlen_q, sms)


def heuristic_config(problem: AttentionProblem, arch: Arch | None, sms: int | None,
                     packed: bool = True) -> AttentionConfig:
    """The built-in config for `problem` on a GPU of compute capability `arch` (None: the interpreter) and `sms`
    multiprocessors: default_config with the call's regime (decode: at most DECODE_QUERIES queries per sequence),
    whether its decode tiles share the multiprocessors, and its GQA group. The dispatcher, the search and the
    benchmarks all take the heuristic from here."""
    return default_config(problem.spec, arch, problem.max_seqlen_q <= DECODE_QUERIES,
                          decode_shares(problem, sms, packed), problem.group_size)
