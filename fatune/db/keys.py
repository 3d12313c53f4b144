"""The tuned DB's key: which entries a call may use, and which of them it takes.

An entry is keyed by where it was tuned (GPU, capability, Triton and torch versions, the code hashes of its
kernels) and by what it computes (dtype, head dims, mask variant, GQA group, length buckets). A call's key
(`problem_key`) matches the entries of its GPU, spec and group; the nearest length bucket of its regime
(decode or prefill) wins (`nearest`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import asdict, dataclass
from typing import Any

import torch
import triton

from fatune.kernel.problem import AttentionProblem
from fatune.kernel.spec import DECODE_QUERIES, MASK_KINDS, SEQLEN_MODES, KernelSpec

MIN_BUCKET = 16


MAX_BUCKET = 1 << 31  # sequence lengths are int32 in the kernels


def seqlen_bucket(seqlen: int) -> int:
    """Log-scale bucket of a sequence length: the next power of two, at least 16."""
    return max(MIN_BUCKET, 1 << max(0, int(seqlen) - 1).bit_length())


@dataclass(frozen=True)
class CallKey:
    """The key columns a call (or a searched shape) determines; the rest say where it was tuned."""

    dtype: str
    head_dim: int
    head_dim_v: int
    mask_variant: str
    group_size: int
    seqlen_q_bucket: int
    seqlen_k_bucket: int


INSTALLATION_COLUMNS = ("gpu", "capability", "triton_version", "torch_version", "template_hash")


KEY_COLUMNS = INSTALLATION_COLUMNS + tuple(f.name for f in dataclasses.fields(CallKey))  # one row per key


def key_reach(spec: KernelSpec, seqlen_k: int, window_left: int, window_right: int) -> int:
    """How far one query row's keys reach: L_k, or a sliding window's width (left + right of the diagonal)
    when both its edges are bounded and it is narrower. The key's Lk bucket is this reach: the work per query
    tile, and so the best tile, follows the window's width, not the sequence's length (one entry per width
    bucket, searched at that width)."""
    if spec.window_left and (spec.causal or spec.window_right):
        right = 0 if spec.causal else max(0, window_right)
        return min(seqlen_k, max(0, window_left) + right)
    return seqlen_k


def call_key(spec: KernelSpec, group_size: int, seqlen_q: int, seqlen_k: int,
             window_left: int = 0, window_right: int = 0) -> CallKey:
    """The one place a key is built: dispatcher (`problem_key`) and search (`shape_key`) both come here. A paged
    cache's call takes the contiguous call's key: it runs the same kernels but for where a key row is read (no
    search produces paged entries)."""
    if spec.paged:
        spec = dataclasses.replace(spec, paged=False)
    return CallKey(spec.dtype, spec.head_dim, spec.head_dim_v, spec.mask_variant, group_size,
                   seqlen_bucket(seqlen_q), seqlen_bucket(key_reach(spec, seqlen_k, window_left, window_right)))


def problem_key(problem: AttentionProblem) -> CallKey:
    return call_key(problem.spec, problem.group_size, problem.max_seqlen_q, problem.max_seqlen_k,
                    problem.window_left, problem.window_right)


def installation(gpu: str, capability: str, kernel_hashes: str) -> dict[str, str]:
    """The key columns that say where an entry was tuned: the GPU, this installation's versions, and the code
    hashes of the kernels it was measured with (fatune.kernel.triton.resolve.kernel_hashes)."""
    return dict(zip(INSTALLATION_COLUMNS, (gpu, capability, triton.__version__, torch.__version__.split("+")[0],
                                           kernel_hashes)))


def key_columns(gpu: str, capability: str, key: CallKey, kernel_hashes: str) -> dict[str, Any]:
    """Every key column of an entry tuned here on `gpu` for `key`, measured with kernels of `kernel_hashes`."""
    return {**installation(gpu, capability, kernel_hashes), **asdict(key)}


def is_decode(seqlen_q_bucket: int) -> bool:
    """Whether a key's L_q bucket is the decode regime's (at most DECODE_QUERIES queries per sequence): K/V
    streamed at memory speed by short query tiles, searched forward only."""
    return seqlen_q_bucket <= DECODE_QUERIES


@functools.lru_cache(maxsize=1)
def variant_fields() -> dict[str, dict[str, Any]]:
    """Every name KernelSpec.mask_variant can give (the only ones an entry may carry), with the KernelSpec
    fields that give it."""
    flags = ("causal", "window_left", "window_right", "bottom_right", "alibi", "dropout")  # paged: call_key
    variants = {}
    for values in itertools.product((False, True), repeat=len(flags)):
        for mask in MASK_KINDS:
            for seqlens in SEQLEN_MODES:
                fields = {"attn_mask": mask, "seqlens": seqlens, **dict(zip(flags, values))}
                variants[KernelSpec("float16", 16, **fields).mask_variant] = fields
    return variants


@functools.lru_cache(maxsize=1)
def mask_variants() -> frozenset[str]:
    """Every name KernelSpec.mask_variant can give: the only ones an entry may carry."""
    return frozenset(variant_fields())
