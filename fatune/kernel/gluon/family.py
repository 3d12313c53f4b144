"""The Gluon family: the warp-specialized Hopper forward and backward of templates/gluon/, with the Triton family's
kernels for what they do not take (the backward's Delta and dQ passes, masks not ported yet).

Its kernels serve the calls `unserved` and `backward_unserved` let through (Hopper, 16-bit, head dims up to 256
that are multiples of 8, no mask tensor, dropout or paged cache); a config with a Gluon kernel for any other call
runs the Triton family's instead, said once. `measured_faster` says where the built-in config takes them.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from math import ceil
from pathlib import Path

import torch

from fatune.hardware import Arch
from fatune.kernel.codegen import Templates
from fatune.kernel.gluon import codegen
from fatune.kernel.gluon.launch import (GluonPlan, backward_unserved, backward_untemplated, passes_config,
                                        unserved, untemplated)
from fatune.kernel.problem import AttentionProblem
from fatune.kernel.spec import (DECODE_QUERIES, AttentionConfig, GluonBackwardConfig, GluonConfig, KernelSpec,
                                LaunchConfig)
from fatune.kernel.triton import resolve
from fatune.kernel.triton.family import TRITON, triton_only
from fatune.kernel.triton.resolve import source_hash

TRITON_FORWARD = LaunchConfig(64, 64)  # any Triton forward: only the backward's hashes are taken from its config
MIN_WAVES = 4  # programs per multiprocessor below which the built-in config keeps the Triton kernels
MIN_KEYS = 1024  # keys below which it keeps them too (the shortest measured)
HOPPER_SMS = 132  # an H100 SXM's and an H200's multiprocessors, where the count is unknown


def default_forward(spec: KernelSpec) -> GluonConfig:
    """The forward's config before a search (H100 sweeps, bf16, B L = 16384, H D = 2048, beside cuDNN's forward):
    two consumer warpgroups on 128-key tiles, three deep at d96-d128 (0.95-1.02x cuDNN; two deep: 0.92-1.04x),
    two deep at d64 (0.90-0.97x; three consumers: 0.78-0.91x); 64-key tiles above d128 (d192, d256), whose
    128-key tiles would not fit 227 KiB of shared memory. Without a mask, persistent: one program per
    multiprocessor takes the query tiles in turn (2-8% faster at d64-d256, L 1k-4k; under a causal mask 3-35%
    slower, so there it is not)."""
    lanes = codegen.width(spec.head_dim)
    persistent = int(persistent_measured(spec))
    if lanes > 128:
        return GluonConfig(block_n=64, num_stages=2, persistent=persistent)
    if lanes > 64:
        return GluonConfig(block_n=128, num_stages=3, persistent=persistent)
    return GluonConfig(block_n=128, num_stages=2, persistent=persistent)


def persistent_measured(spec: KernelSpec) -> bool:
    """Whether the persistent forward measured faster for `spec`: no mask at all (fixed lengths, no window,
    causal mask or ALiBi)."""
    return (spec.seqlens == "fixed" and not (spec.causal or spec.window_left or spec.window_right or spec.alibi)
            and spec.attn_mask == "none" and not spec.dropout and not spec.paged)


def measured_faster(problem: AttentionProblem, sms: int | None) -> tuple[bool, bool]:
    """Whether the Gluon forward and the Gluon backward (default_forward, default_backward) ran `problem` faster
    than the Triton family's heuristic kernels on an H100 (a training step's grid: bf16 and fp16, d64/128/256,
    causal or not, L 1k-16k, 8 or more waves of programs). The forward: above d64 everywhere (1.2-1.5x), at d64
    from 4k keys (at 1k the Triton forward is 1.15x faster). The backward (bf16, L 4k-16k): above d128
    (1.26-1.42x, its consumers splitting each query tile's rows), and at d128 from 4k keys: without a mask,
    where the consumers share dQ's reduction (1.13-1.20x), and causal (0.99-1.13x); at d64 causal from 4k
    queries and keys (1.04-1.22x, one loop over the query tiles; without a mask the Triton backward is
    1.17-1.21x faster). Under sliding windows, key lengths and packed
    sequences (d128, L 8k) the Gluon forward is 1.07-1.29x faster and the Gluon backward mostly slower
    (0.95-1.62x the Triton backward's time): the forward takes them above d64. The Triton kernels keep what was
    not measured or measured slower: ALiBi, fewer than MIN_KEYS keys, decode, grids of fewer than MIN_WAVES
    waves on the GPU's `sms` multiprocessors (the Triton forward splits their keys, e.g. a chunked prefill), a
    backward under any mask but causal, and a backward over grouped query heads (GQA 8:1, d128: causal, the
    Triton backward's step is 1.10-1.18x faster than the Gluon one's best group split, which is 1.29-1.32x faster
    than one program per key tile; without a mask, L 8k, the Gluon one's is 1.11x faster: one shape, left to the
    search)."""
    spec = problem.spec
    if spec.alibi or problem.max_seqlen_k < MIN_KEYS:
        return False, False
    masked = bool(spec.window_left or spec.window_right or spec.seqlens != "fixed")
    lanes = codegen.width(spec.head_dim)
    waves = MIN_WAVES * (sms or HOPPER_SMS)
    forward = (untemplated(spec) is None and problem.max_seqlen_q > DECODE_QUERIES
               and problem.batch * problem.heads * ceil(problem.max_seqlen_q / default_forward(spec).block_m) >= waves
               and (lanes > 64 or (problem.max_seqlen_k >= 4096 and not masked)))
    backward = (not masked and backward_untemplated(spec) is None and problem.group_size == 1
                and problem.batch * problem.kv_heads * ceil(problem.max_seqlen_k /
                                                            codegen.backward_block_n(spec, default_backward(spec))) >= waves
                and (lanes > 128 or (lanes == 128 and problem.max_seqlen_k >= 4096)
                     or (lanes == 64 and spec.causal and min(problem.max_seqlen_q, problem.max_seqlen_k) >= 4096)))
    return forward, backward


def default_backward(spec: KernelSpec) -> GluonBackwardConfig:
    """The backward's config before a search: two consumer warpgroups of 64 keys, 64-row query tiles two deep, dQ
    in 64-lane slices (what fits 240 registers per consumer at d128 with little spilled). At 128 lanes without
    a mask or under a causal one, the consumers share dQ's reduction (H100, bf16, L 4k: 1.23-1.27x faster than
    each reducing its own; at d64 it is not faster, 0.83-0.98x). At 256 lanes the two
    share one key tile, one ring stage deep, each with its 128 lanes of dQ in one slice; packed sequences under a
    left window at 128 lanes take whole-row dQ slices too: Triton 3.6's ptxas crashes compiling 64-lane ones
    there."""
    lanes = codegen.width(spec.head_dim)
    if lanes > 128:  # two consumers share a 64-key tile; one ring stage fits
        return GluonBackwardConfig(num_stages=1, dq_slice=128)
    if spec.seqlens == "varlen" and spec.window_left and lanes == 128:
        return GluonBackwardConfig(dq_slice=128)
    if lanes == 128 and spec.seqlens == "fixed" and not (spec.window_left or spec.window_right or spec.alibi):
        return GluonBackwardConfig(shared_dq=1)
    return GluonBackwardConfig()


@functools.lru_cache(maxsize=256)
def _search_hash(spec: KernelSpec, grouped: bool, templates: Path) -> str:
    """The forward's sources with two and three consumer warpgroups, overlapped or not, with ping-pong or not,
    persistent or not, and the backward's with two and three, sharing dQ's reduction or not (`grouped`: with the
    group split too): each source the studies can render (the tiles and registers only fill in numbers), from
    the `templates` folder. Cached: a search's progress names its studies, and rendering them all takes a few
    hundred ms."""
    forwards = [GluonConfig(consumers=consumers, consumer_regs=160, overlap=overlap, pingpong=pingpong,
                            persistent=persistent)
                for consumers in (2, 3) for overlap, pingpong in ((0, 0), (1, 0), (1, 1)) for persistent in (0, 1)]
    sources = [source_hash("fwd", codegen.render(spec, config)) for config in forwards
               if codegen.unpersistent(spec, config) is None]
    if backward_untemplated(spec) is None:
        backwards = [GluonBackwardConfig(consumers=consumers, consumer_regs=160, shared_dq=shared, group_split=parts)
                     for consumers in (2, 3) for shared in (0, 1) for parts in ((1, 2) if grouped else (1,))]
        sources += [source_hash("bwd", codegen.render_backward(spec, config)) for config in backwards
                    if config.consumers % codegen.backward_head_split(spec) == 0
                    and codegen.unshared_dq(spec, config) is None]
    return hashlib.sha256(",".join(sources).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class GluonFamily:
    name: str = "gluon"
    templates: Templates = codegen.TEMPLATES
    kinds: tuple[str, ...] = ("fwd",)

    def serves(self, spec: KernelSpec, device: torch.device) -> str | None:
        return unserved(spec, device)

    def serves_backward(self, spec: KernelSpec, device: torch.device) -> str | None:
        """None if the Gluon backward runs calls of `spec` on `device`; else why not."""
        return backward_unserved(spec, device)

    def heuristic(self, problem: AttentionProblem, arch: Arch | None, sms: int | None) -> AttentionConfig:
        """The Triton family's heuristic with this family's forward and backward wherever they render; decode
        keeps the Triton forward (its split keys: a 128-row query tile would hold one query)."""
        config = TRITON.heuristic(problem, arch, sms)
        if untemplated(problem.spec) is None and problem.max_seqlen_q > DECODE_QUERIES:
            config = config.replace(fwd=default_forward(problem.spec))
        if backward_untemplated(problem.spec) is None:
            config = config.replace(dkdv=default_backward(problem.spec))
        return config

    def render(self, kind: str, spec: KernelSpec, config: AttentionConfig) -> str:
        if kind == "fwd" and config.gluon_forward:
            return codegen.render(spec, config.fwd)
        if kind == "bwd" and config.gluon_backward:
            return codegen.render_backward(spec, config.dkdv)
        return TRITON.render(kind, spec, self.triton_part(spec, config))

    def source_path(self, kind: str, spec: KernelSpec, config: AttentionConfig) -> Path:
        if kind == "fwd" and config.gluon_forward:
            return codegen.source_path(spec, config.fwd)
        if kind == "bwd" and config.gluon_backward:
            return codegen.backward_source_path(spec, config.dkdv)
        return TRITON.source_path(kind, spec, self.triton_part(spec, config))

    @staticmethod
    def triton_part(spec: KernelSpec, config: AttentionConfig) -> AttentionConfig:
        """The Triton family's config a plan of `config` runs beside its Gluon kernels: any Triton forward in place
        of a Gluon one, the atomic-dQ config whose passes run around a Gluon backward (passes_config)."""
        return config.replace(fwd=TRITON_FORWARD if config.gluon_forward else config.fwd,
                              dkdv=passes_config(spec) if config.gluon_backward else config.dkdv)

    def kernel_hashes(self, spec: KernelSpec, config: AttentionConfig, grouped: bool) -> str:
        return _kernel_hashes(self, spec, config, grouped)

    def search_hash(self, spec: KernelSpec, grouped: bool) -> str:
        """Hash of every source a search of `spec` can render (_search_hash)."""
        return _search_hash(spec, grouped, codegen.TEMPLATES.path)

    def plan(self, problem: AttentionProblem, config: AttentionConfig, device: torch.device, q: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor, fallback: AttentionConfig | None,
             sources: frozenset[str] | None, strict: bool = False) -> GluonPlan:
        triton = TRITON.heuristic(problem, (9, 0), None) if fallback is None else triton_only(problem, fallback)
        return GluonPlan(problem, config, device, q, k, v, triton, sources, strict)


GLUON = GluonFamily()


@functools.lru_cache(maxsize=4096)  # (rendering a Gluon kernel takes tens of ms: the dispatcher asks per entry)
def _kernel_hashes(gluon: GluonFamily, spec: KernelSpec, config: AttentionConfig, grouped: bool) -> str:
    """The Gluon kernels' code hashes and those of the Triton kernels that run beside them (as the Triton family
    hashes them): the Triton forward where no Gluon forward runs, the Triton backward's (with a Gluon backward, its
    atomic-dQ passes')."""
    triton_hashes = resolve.kernel_hashes(spec, gluon.triton_part(spec, config), grouped).split(",")
    hashes = {entry for entry in triton_hashes if entry.startswith("bwd:") or
              (entry.startswith("fwd:") and not config.gluon_forward)}
    if config.gluon_forward:
        hashes.add(source_hash("fwd", codegen.render(spec, config.fwd)))
    if config.gluon_backward:
        hashes.add(source_hash("bwd", codegen.render_backward(spec, config.dkdv)))
    return ",".join(sorted(hashes))
