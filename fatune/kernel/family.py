"""Kernel families: the code generators fatune can run a call's kernels with, in one registry.

A family renders its kernels from a template folder of its own, says which calls it can serve, gives its
built-in config for a call, builds the plan that launches a call's kernels, and hashes the kernel sources a
config can launch (what a tuned entry stores). The runtime, the search, the tuned DB and the CLI find a family
here by name (a config names its own: AttentionConfig.family); a new family plugs in by joining FAMILIES below.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from fatune.hardware import Arch
from fatune.kernel.codegen import Templates
from fatune.kernel.gluon.family import GLUON, measured_faster
from fatune.kernel.problem import AttentionProblem
from fatune.kernel.spec import AttentionConfig, KernelSpec
from fatune.kernel.triton.family import TRITON

DEFAULT_FAMILY = "triton"


class KernelFamily(Protocol):
    """What the runtime, the search, the tuned DB and the CLI ask of a kernel family."""

    name: str
    templates: Templates
    kinds: tuple[str, ...]  # the modules it renders per call ("fwd", "bwd")

    def serves(self, spec: KernelSpec, device: torch.device) -> str | None:
        """None if the family can run calls of `spec` on `device`; else why not (one line)."""

    def heuristic(self, problem: AttentionProblem, arch: Arch | None, sms: int | None) -> AttentionConfig:
        """The built-in config for `problem` on a GPU of compute capability `arch` with `sms` multiprocessors."""

    def render(self, kind: str, spec: KernelSpec, config: AttentionConfig) -> str:
        """The source of one of its modules (`kind`) for `spec` and `config`."""

    def source_path(self, kind: str, spec: KernelSpec, config: AttentionConfig) -> Path:
        """The cache file that holds (or will hold) one of its modules for `spec` and `config`."""

    def kernel_hashes(self, spec: KernelSpec, config: AttentionConfig, grouped: bool) -> str:
        """The code hashes of every source `config` can launch for `spec` ("KIND:HASH,..."; a tuned entry's)."""

    def search_hash(self, spec: KernelSpec, grouped: bool) -> str:
        """A hash of every source a search of this family's configs for `spec` can render (a study's name holds
        it, so that a template edit starts new studies)."""

    def plan(self, problem: AttentionProblem, config: AttentionConfig, device: torch.device, q: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor, fallback: AttentionConfig | None,
             sources: frozenset[str] | None, strict: bool = False) -> Any:
        """What launches `problem`'s kernels with `config` (forward_with_spans, backward; see the Triton plan);
        `strict`: a kernel that cannot be built raises rather than hand its part of the call to other kernels."""


FAMILIES: dict[str, KernelFamily] = {family.name: family for family in (TRITON, GLUON)}


def family(name: str = DEFAULT_FAMILY) -> KernelFamily:
    """The registered family `name`; ValueError naming the known ones otherwise."""
    found = FAMILIES.get(name)
    if found is None:
        raise ValueError(f"family: expected one of {sorted(FAMILIES)}, got {name!r}")
    return found


def builtin_choice(problem: AttentionProblem, arch: Arch | None, sms: int | None) -> tuple[bool, ...]:
    """Which of the built-in config's kernels are the Gluon family's (forward, backward): what it decides from
    the call beyond its DB key (batch, heads, exact lengths)."""
    return measured_faster(problem, sms) if arch == (9, 0) else ()


def builtin_config(problem: AttentionProblem, arch: Arch | None, sms: int | None) -> AttentionConfig:
    """The config a call runs with no tuned entry: the Triton family's heuristic, with the Gluon family's forward
    and backward on Hopper where they measured faster (gluon.family.measured_faster)."""
    config = family().heuristic(problem, arch, sms)
    if arch != (9, 0):
        return config
    gluon = GLUON.heuristic(problem, arch, sms)
    forward, backward = measured_faster(problem, sms)
    return config.replace(fwd=gluon.fwd if forward else config.fwd, dkdv=gluon.dkdv if backward else config.dkdv)
