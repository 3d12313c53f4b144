"""The Triton family: FlashAttention forward and backward written in Triton's tile language.

It serves every call on any CUDA GPU Triton supports, and on the CPU through Triton's interpreter. Its
kernels come from templates/triton/ (fatune.kernel.triton.codegen), launch through a Plan
(fatune.kernel.triton.launch), and are configured by an AttentionConfig of three LaunchConfigs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from fatune.hardware import Arch
from fatune.kernel.codegen import Templates
from fatune.kernel.problem import AttentionProblem
from fatune.kernel.spec import AttentionConfig, KernelSpec
from fatune.kernel.triton import codegen, heuristics, launch, resolve


@dataclass(frozen=True)
class TritonFamily:
    name: str = "triton"
    templates: Templates = codegen.TEMPLATES
    kinds: tuple[str, ...] = ("fwd", "bwd")

    def serves(self, spec: KernelSpec, device: torch.device) -> str | None:
        return None

    def heuristic(self, problem: AttentionProblem, arch: Arch | None, sms: int | None) -> AttentionConfig:
        return heuristics.heuristic_config(problem, arch, sms)

    def render(self, kind: str, spec: KernelSpec, config: AttentionConfig) -> str:
        return codegen.render(kind, spec, config)

    def source_path(self, kind: str, spec: KernelSpec, config: AttentionConfig) -> Path:
        return codegen.source_path(kind, spec, config)

    def kernel_hashes(self, spec: KernelSpec, config: AttentionConfig, grouped: bool) -> str:
        return resolve.kernel_hashes(spec, config, grouped)

    def search_hash(self, spec: KernelSpec, grouped: bool) -> str:
        return resolve.search_hash(spec, grouped)

    def plan(self, problem: AttentionProblem, config: AttentionConfig, device: torch.device, q: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor, fallback: AttentionConfig | None,
             sources: frozenset[str] | None, strict: bool = False) -> launch.Plan:
        fallback = None if fallback is None or strict else triton_only(problem, fallback)
        return launch.Plan(problem, config, device, q, k, v, fallback=fallback, sources=sources)


TRITON = TritonFamily()


def triton_only(problem: AttentionProblem, config: AttentionConfig) -> AttentionConfig:
    """`config` with the Triton heuristic's kernels in place of any Gluon ones: what a Triton plan can fall back to
    (the built-in config on Hopper mixes the families)."""
    if config.family == TRITON.name:
        return config
    triton = TRITON.heuristic(problem, (9, 0), None)
    return config.replace(fwd=triton.fwd if config.gluon_forward else config.fwd,
                          dkdv=triton.dkdv if config.gluon_backward else config.dkdv)
