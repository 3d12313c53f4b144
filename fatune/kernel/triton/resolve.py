"""A config as a launch runs it, and the hashes of the kernel sources a config can launch.

`resolve` makes a config's launch-time choices for one call (key splits, TMA, GQA packing, the backward's
runnable structure); `resolutions` lists every config a tuned one can turn into, so `kernel_hashes` can
name every source it may launch (what a tuned entry stores) and `search_hash` every source a search of a
spec can render (part of a study's name).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from types import ModuleType
from typing import Sequence

import torch
import triton

from fatune.hardware import sm_count, tma_available
from fatune.kernel.codegen import CODE_HASH, code_hash
from fatune.kernel.layout import MAX_SLICE_OFFSET
from fatune.kernel.problem import AttentionProblem
from fatune.kernel.spec import MAX_SPLITS, AttentionConfig, KernelSpec, LaunchConfig
from fatune.kernel.triton import codegen
from fatune.kernel.triton.structure import runnable_backward, split_d_searched


def choose_splits(programs: int, key_tiles: int, sms: int) -> int:
    """Split-KV runs when the grid leaves multiprocessors idle: as many splits as fill one wave
    without starting a second (a partial second wave costs a whole split's time: decode B=8 on
    an H200 ran 80.6 us with 2 splits = 128 programs, 97.7 with 5),
    each split with at least two key tiles."""
    if programs >= sms:
        return 1
    return max(1, min(MAX_SPLITS, sms // programs, key_tiles // 2))


def tma_readable(tensor: torch.Tensor, seq_dim: int, every_head: bool = False) -> bool:
    """Whether TMA can read `tensor`'s rows tile by tile: unit head-dim stride, a 16-byte aligned
    base, a positive 16-byte multiple as the row (`seq_dim`) stride, and as the other strides where
    their dim has more than one index (the kernel offsets its base by them). `every_head`: one
    descriptor spans all heads (dim 1), so the head stride is one of its strides, however many heads."""
    size = tensor.element_size()
    if tensor.data_ptr() % 16 or (tensor.stride(-1) != 1 and tensor.shape[-1] > 1):
        return False
    return all(stride > 0 and (stride * size) % 16 == 0 for dim, stride in enumerate(tensor.stride()[:-1])
               if dim == seq_dim or tensor.shape[dim] > 1 or (every_head and dim == 1))


def resolve(config: AttentionConfig, problem: AttentionProblem, device: torch.device,
            tensors: Sequence[torch.Tensor]) -> AttentionConfig:
    """`config` with its launch-time choices made for the call's `tensors` (q, k, v): GQA packing
    only where groups exist, the number of key splits when it is 0 (auto; any number lowered to what the
    partial results' int32 offsets can address: 1 past 2^30 output elements), TMA only on GPUs that
    have it and for tensors it can read (dK/dV's: the query's, and with the head-dim split K's and V's), and
    the backward's structure as it runs (fatune.kernel.triton.structure.runnable_backward: atomic dQ of a kind that runs, TMA
    reductions only on GPUs with TMA; the head-dim split only where its halves are 64 lanes or more), and
    one stage for a kernel whose streamed loop runs once."""
    config = runnable_backward(config, problem.spec, tma_available(device))
    fwd = config.fwd
    pack = fwd.pack_gqa if problem.group_size > 1 else 0
    splits = fwd.num_splits
    if splits == 0:
        rows = problem.max_seqlen_q * (problem.group_size if pack else 1)
        programs = triton.cdiv(rows, fwd.block_m) * (problem.kv_heads if pack else problem.heads) * problem.batch
        splits = choose_splits(programs, triton.cdiv(problem.max_seqlen_k, fwd.block_n), sm_count(device))
    # the partial results (split, batch, head, row, D_v) are offset by split x split stride in int32
    part_rows = (1 if problem.packed else problem.batch) * problem.heads * problem.seqlen_q
    splits = max(1, min(splits, (MAX_SLICE_OFFSET + 1) // max(1, part_rows * problem.spec.head_dim_v)))
    seq_dim = 0 if problem.packed else 2
    # a paged cache's tiles gather rows from several pages: no descriptor spans them
    tma = bool(fwd.tma) and tma_available(device) and all(tma_readable(t, seq_dim) for t in tensors) and \
        not problem.spec.paged
    resolved = dataclasses.replace(fwd, pack_gqa=pack, num_splits=splits, tma=int(tma))
    # dK/dV reads the query rows (and dO's, checked per backward) of every head through one descriptor
    dkdv_tma = bool(config.dkdv.tma) and tma_available(device) and tma_readable(tensors[0], seq_dim, every_head=True)
    if config.dkdv.split_d == 2:  # the split also reads its resident K and V tiles through TMA
        dkdv_tma = dkdv_tma and all(tma_readable(t, seq_dim) for t in tensors[1:3])
    dkdv = dataclasses.replace(config.dkdv, tma=int(dkdv_tma))
    dq = config.dq
    # a loop that runs once has nothing to pipeline (and ptxas 13 crashed compiling dQ's pipelined key loop
    # once Triton had specialised L_K = 1): the forward and dQ stream key tiles, dK/dV query tiles. Packed
    # sequences: max_seqlen_* is the caller's bound, the kernels' L_Q / L_K the total, each sequence within both
    keys = min(problem.max_seqlen_k, problem.seqlen_k)
    queries = min(problem.max_seqlen_q, problem.seqlen_q)
    if keys <= resolved.block_n:
        resolved = dataclasses.replace(resolved, num_stages=1)
    if keys <= dq.block_n:
        dq = dataclasses.replace(dq, num_stages=1)
    if queries <= dkdv.block_m:
        dkdv = dataclasses.replace(dkdv, num_stages=1)
    if (resolved, dkdv, dq) == (fwd, config.dkdv, config.dq):
        return config
    return config.replace(fwd=resolved, dkdv=dkdv, dq=dq)


def resolutions(config: AttentionConfig, spec: KernelSpec, grouped: bool) -> list[AttentionConfig]:
    """Every config `resolve` (and the backward, for its dO) can turn `config` into for calls of `spec` (with
    GQA groups or not), whatever their tensors and GPU: key splits chosen (one, or several) when 0, TMA kept
    or dropped, atomic dQ as asked or lowered; in a fixed order. Not the one-stage kernels of calls whose loops
    run once: they render the same source but for the config named in its header. (torch's deterministic mode, which swaps
    atomic dQ for the dQ kernel, is the caller's choice, not part of what a tuned config was measured as.)"""
    fwd = config.fwd
    fwds = {dataclasses.replace(fwd, pack_gqa=fwd.pack_gqa if grouped else 0, num_splits=splits, tma=tma)
            for splits in ((1, 2) if fwd.num_splits == 0 else (fwd.num_splits,)) for tma in {fwd.tma, 0}}
    backwards = {(dataclasses.replace(runnable.dkdv, tma=tma), runnable.dq)
                 for runnable in (runnable_backward(config, spec, tma_dq) for tma_dq in (True, False))
                 for tma in {config.dkdv.tma, 0}}
    return [config.replace(fwd=f, dkdv=d, dq=q) for f in sorted(fwds, key=str)
            for d, q in sorted(backwards, key=lambda pair: (str(pair[0]), str(pair[1])))]


def source_hash(kind: str, module_or_source: ModuleType | str) -> str:
    """One kernel source's entry in a tuned entry's hashes: "KIND:CODE_HASH" (of a loaded module, or of a
    rendered source)."""
    if isinstance(module_or_source, str):
        return f"{kind}:{code_hash(module_or_source)}"
    return f"{kind}:{getattr(module_or_source, CODE_HASH)}"


@functools.lru_cache(maxsize=4096)
def kernel_hashes(spec: KernelSpec, config: AttentionConfig, grouped: bool) -> str:
    """The code hashes of every forward and backward source `config` can launch for `spec` (its `resolutions`,
    rendered), as a tuned entry stores them ("bwd:HASH,...,fwd:HASH,..."): what it was measured with. A
    template edit in code none of them contains, or in comments, leaves them unchanged."""
    resolved = resolutions(config, spec, grouped)
    forwards = {c.fwd: c for c in resolved}  # each forward and each backward rendered once
    backwards = {(c.dkdv, c.dq): c for c in resolved}
    hashes = {source_hash(kind, codegen.render(kind, spec, configs[variant]))
              for kind, configs in (("fwd", forwards), ("bwd", backwards)) for variant in configs}
    return ",".join(sorted(hashes))


SEARCH_HASH_TILE = LaunchConfig(64, 64, num_warps=4, num_stages=2)  # tiles enter the source as constants only


@functools.lru_cache(maxsize=1024)
def search_hash(spec: KernelSpec, grouped: bool) -> str:
    """Hash of every kernel source a search of `spec` can render, at one fixed tile with each structure value
    (forward TMA, key splits, GQA packing; dK/dV TMA, each atomic-dQ kind, the head-dim split where searched;
    with GQA the dQ kernel beside dK/dV):
    the templates' part of a study's
    name (fatune.tuning.study.study_name). A template edit in code none of them contains (another mask variant's,
    say) leaves it unchanged, so an interrupted search's studies still resume after it."""
    tile = SEARCH_HASH_TILE
    hashes = [kernel_hashes(spec, AttentionConfig(fwd=dataclasses.replace(tile, num_splits=0, pack_gqa=pack, tma=1),
                                                dkdv=dataclasses.replace(tile, tma=1, atomic_dq=atomic, split_d=split),
                                                dq=dataclasses.replace(tile, concurrent=concurrent)),
                          grouped)
              for pack in ((0, 1) if grouped else (0,)) for atomic in (0, 2)
              for split in ((1, 2) if split_d_searched(spec) else (1,))
              for concurrent in ((0, 1) if grouped and not atomic else (0,))]
    return hashlib.sha256(",".join(hashes).encode()).hexdigest()[:16]
