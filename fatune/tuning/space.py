"""The configs a search may try: each study's axes (SearchSpace) and the resource model that rejects, without
compiling, configs that cannot fit a GPU (infeasible).

A shape has a study per kernel of the Triton family ("fwd", "dkdv", "dq") and, where the Gluon family serves
it, one of the Gluon forward (GLUON_FORWARD) and one of the Gluon backward (GLUON_BACKWARD): the family is an
axis of the search, decided per slot by the studies' best times (fatune.tuning.search.choose_winners)."""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
from dataclasses import dataclass

from fatune.db import seqlen_bucket
from fatune.kernel.gluon import resources as gluon_resources
from fatune.kernel.spec import GluonBackwardConfig, GluonConfig, KernelSpec, LaunchConfig, lanes
from fatune.kernel.triton.resources import MIN_ELEMENTS_PER_THREAD, shared_memory_bytes, uncompilable
from fatune.kernel.triton.structure import atomic_dq_kinds, split_d_searched
from fatune.tuning.shape import Shape
from fatune.tuning.target import Target

SPLIT_WAVES = 4  # a forward whose fewest programs fill this many waves of the GPU gains nothing from split-KV


# the dQ kernel's register cap is searched up to this many lanes: there its registers, not its shared memory,
# limit the programs per SM (a cap of 128 fits two at d64; the forward and dK/dV lost with caps, H200, 2026-11-30)
MAXNREG_LANES = 64


GLUON_FORWARD = "fwd-gluon"  # the study of the Gluon family's forward
GLUON_BACKWARD = "dkdv-gluon"  # the study of the Gluon family's backward (its dK/dV kernel adds dQ up)
GLUON_STUDIES = {GLUON_FORWARD: ("fwd", GluonConfig), GLUON_BACKWARD: ("dkdv", GluonBackwardConfig)}
Config = LaunchConfig | GluonConfig | GluonBackwardConfig


def slot(kernel: str) -> str:
    """The kernel (an AttentionConfig field) a study's configs fill: "fwd" for either family's forward, "dkdv"
    for either family's backward."""
    return GLUON_STUDIES[kernel][0] if kernel in GLUON_STUDIES else kernel


def make_config(kernel: str, params: dict) -> Config:
    """A study's config from its axes' values; ValueError for a combination the family refuses (registers
    the consumer warpgroups cannot get)."""
    return GLUON_STUDIES[kernel][1].from_dict(params) if kernel in GLUON_STUDIES else LaunchConfig.from_dict(params)


@dataclass(frozen=True)
class SearchSpace:
    """Candidate launch configs for one kernel (the same axes for all three kernels)."""

    block_m: tuple[int, ...] = (16, 32, 64, 128)
    block_n: tuple[int, ...] = (16, 32, 64, 128)
    num_warps: tuple[int, ...] = (2, 4, 8)
    num_stages: tuple[int, ...] = (1, 2, 3, 4, 5)

    num_splits: tuple[int, ...] = (0, 1, 2, 4, 8, 16, 32)  # forward only; 0 = chosen at launch
    pack_gqa: tuple[int, ...] = (0, 1)  # forward only, GQA shapes only
    tma: tuple[int, ...] = (0, 1)  # forward and dK/dV; dropped at launch where TMA cannot read the tensors
    atomic_dq: tuple[int, ...] = (0, 1, 2)  # dK/dV only, where fatune.kernel.triton.structure.atomic_dq_kinds allows; 2 = TMA reductions
    split_d: tuple[int, ...] = (1, 2)  # dK/dV only, where fatune.kernel.triton.structure.split_d_searched
    maxnreg: tuple[int, ...] = (0, 128)  # dQ only, 16-bit head dims up to 64 (MAXNREG_LANES): a register cap
    # dQ only, GQA shapes only: the dQ kernel on a second stream beside dK/dV (1: dQ launched first, 2: dK/dV
    # first), which only gained there on an H200 (up to 1.19x less
    # backward time with GQA causal, within +-3% without GQA); where a config also adds dQ atomically the
    # kernel never runs and the switch is dropped (fatune.kernel.triton.structure.runnable_backward)
    concurrent: tuple[int, ...] = (0, 1, 2)

    # the Gluon forward (GLUON_FORWARD): key tiles, ring depth, consumer warpgroups and their registers (the
    # launch's register cap follows from the consumers: fatune.kernel.spec.gluon_register_cap)
    gluon_block_n: tuple[int, ...] = (64, 128)
    gluon_stages: tuple[int, ...] = (1, 2, 3, 4)
    consumers: tuple[int, ...] = (2, 3)
    consumer_regs: tuple[int, ...] = (160, 192, 216, 232, 240)
    overlap: tuple[int, ...] = (0, 1)  # the softmax under the previous tile's P V, or one step after the other
    pingpong: tuple[int, ...] = (0, 1)  # the consumers take turns issuing their products (with overlap only)
    persistent: tuple[int, ...] = (0, 1)  # one program per multiprocessor takes the query tiles (fixed lengths only)
    # the Gluon backward (GLUON_BACKWARD): query tiles, ring depth, dQ's slice and whether the consumers share its
    # reduction (consumers and registers above)
    gluon_block_m: tuple[int, ...] = (64, 128)
    gluon_bwd_stages: tuple[int, ...] = (1, 2, 3)
    dq_slice: tuple[int, ...] = (32, 64, 128)  # 32 at 256 lanes only, where two Q/dO stages fit with it
    shared_dq: tuple[int, ...] = (0, 1)
    # GQA shapes only: programs that share a key tile's group of query heads (those that divide the group)
    group_split: tuple[int, ...] = (1, 2, 4, 8)
    families: tuple[str, ...] = ("triton", "gluon")  # the kernel families whose studies a search runs

    def axes(self, kernel: str, shape: Shape, sms: int | None = None) -> dict[str, tuple[int, ...]]:
        """The axes searched for `kernel` on `shape`: tiles, warps, stages, and the structure fields it owns.

        On a GPU with `sms` multiprocessors, a shape whose forward fills SPLIT_WAVES waves even with
        its largest query tiles keeps only num_splits=0 (chosen at launch: no split there): splitting
        its keys would add partial results and merges to a grid that already has no idle multiprocessor."""
        if kernel == GLUON_FORWARD:
            return {"block_n": self.gluon_block_n, "num_stages": self.gluon_stages, "consumers": self.consumers,
                    "consumer_regs": self.consumer_regs, "overlap": self.overlap, "pingpong": self.pingpong,
                    "persistent": self.persistent if shape.spec.seqlens == "fixed" else (0,)}
        if kernel == GLUON_BACKWARD:
            width = lanes(shape.spec.head_dim)
            slices = tuple(value for value in self.dq_slice if value <= max(64, width) and (value >= 64 or width > 128))
            axes = {"block_m": self.gluon_block_m, "num_stages": self.gluon_bwd_stages, "consumers": self.consumers,
                    "consumer_regs": self.consumer_regs, "dq_slice": slices, "shared_dq": self.shared_dq}
            group = shape.heads // shape.kv_heads
            if group > 1:
                axes["group_split"] = tuple(value for value in self.group_split if group % value == 0)
            return axes
        axes = {"block_m": self.block_m, "block_n": self.block_n, "num_warps": self.num_warps,
                "num_stages": self.num_stages}
        if kernel == "fwd":
            axes["num_splits"] = (0,) if sms and self.fills_gpu(shape, sms) else self.num_splits
            if shape.kv_heads != shape.heads:
                axes["pack_gqa"] = self.pack_gqa
            axes["tma"] = self.tma
        kinds = tuple(kind for kind in self.atomic_dq if kind in atomic_dq_kinds(shape.spec))
        if kernel == "dkdv" and len(kinds) > 1:
            axes["atomic_dq"] = kinds
        if kernel == "dkdv":
            axes["tma"] = self.tma
            if split_d_searched(shape.spec):
                axes["split_d"] = self.split_d
        if kernel == "dq" and shape.spec.dtype != "float32" and \
                max(lanes(shape.spec.head_dim), lanes(shape.spec.head_dim_v)) <= MAXNREG_LANES:
            axes["maxnreg"] = self.maxnreg
        if kernel == "dq" and len(self.concurrent) > 1 and shape.kv_heads != shape.heads:
            axes["concurrent"] = self.concurrent
        return axes

    def fills_gpu(self, shape: Shape, sms: int) -> bool:
        """Whether the forward of `shape` (its length bucket, as the study is named) has at least
        SPLIT_WAVES x `sms` programs with the largest query tile, GQA groups packed."""
        rows = seqlen_bucket(shape.seqlen_q) * (shape.heads // shape.kv_heads)
        programs = math.ceil(rows / max(self.block_m)) * shape.kv_heads * shape.batch
        return programs >= SPLIT_WAVES * sms

    def grid(self, kernel: str, shape: Shape, sms: int | None = None) -> list[Config]:
        """Every config of the axes that the family accepts (make_config)."""
        axes = self.axes(kernel, shape, sms)
        configs = []
        for values in itertools.product(*axes.values()):
            try:
                configs.append(make_config(kernel, dict(zip(axes, values))))
            except ValueError:
                continue
        return configs

    def feasible(self, kernel: str, shape: Shape, target: Target) -> frozenset[Config]:
        """The grid's configs that the resource model (infeasible) lets run on `target`: the points a search
        may try, and so the most trials it can run."""
        return _feasible(self, kernel, shape, target.sms, target.shared_limit, target.arch)


GPU_SPACE = SearchSpace()


# The interpreter runs tiles as numpy arrays: a small space keeps CPU searches short.
INTERPRETER_SPACE = SearchSpace(block_m=(16, 32), block_n=(16, 32), num_warps=(4,), num_stages=(1,), num_splits=(0, 2),
                                maxnreg=(0,),  # the interpreter compiles nothing: a cap changes nothing there
                                concurrent=(0,),  # nor has it streams to run kernels side by side
                                pack_gqa=(1,), atomic_dq=(0, 1, 2),
                                families=("triton",))  # nor does it run Gluon kernels


def infeasible(kernel: str, spec: KernelSpec, config: Config, shared_limit: int | None,
               arch: tuple[int, int] = (9, 0)) -> str | None:
    """Why `config` cannot run well for `kernel` on a GPU of compute capability `arch` with `shared_limit` bytes
    per block (None: the interpreter, where only correctness matters), decided without compiling; None if it may."""
    if isinstance(config, GluonConfig):
        return gluon_resources.infeasible(spec, config, shared_limit)
    if isinstance(config, GluonBackwardConfig):
        return gluon_resources.backward_infeasible(spec, config, shared_limit)
    if shared_limit is None:
        return None
    reason = uncompilable(kernel, spec, config, arch)
    if reason is not None:
        return reason
    if config.block_m * config.block_n < config.num_warps * 32 * MIN_ELEMENTS_PER_THREAD:
        return (f"{config.num_warps} warps for a {config.block_m}x{config.block_n} tile: under "
                f"{MIN_ELEMENTS_PER_THREAD} elements per thread")
    needed = shared_memory_bytes(kernel, spec, config, arch)
    if needed > shared_limit:
        return f"needs ~{needed // 1024} KiB shared memory, the GPU has {shared_limit // 1024} KiB per block"
    # accumulators in registers (a head-dim split's dK/dV programs each hold half)
    resident = {"fwd": config.block_m * lanes(spec.head_dim_v), "dkdv": config.block_n * (lanes(spec.head_dim)
                + lanes(spec.head_dim_v)) // config.split_d, "dq": config.block_m * lanes(spec.head_dim)}[kernel]
    if (resident + config.block_m * config.block_n) / (config.num_warps * 32) > 512:
        return "float32 accumulators alone need over 512 registers per thread"
    return None


def default_space(target: Target) -> SearchSpace:
    return INTERPRETER_SPACE if target.interpret else GPU_SPACE


@functools.lru_cache(maxsize=1024)
def _feasible(space: SearchSpace, kernel: str, shape: Shape, sms: int | None, shared_limit: int | None,
              arch: tuple[int, int]) -> frozenset[Config]:
    return frozenset(config for config in space.grid(kernel, shape, sms)
                     if infeasible(kernel, shape.spec, config, shared_limit, arch) is None)


def trial_budget(space: SearchSpace | None, target: Target, shape: Shape, kernel: str, trials: int) -> int:
    """The trials a study of `kernel` runs for `--trials trials`: as many, or every feasible point of a smaller
    space (SearchSpace.feasible)."""
    space = space or default_space(target)
    return min(trials, len(space.feasible(kernel, shape, target)))


def axes_digest(space: SearchSpace, target: Target, shape: Shape, kernel: str) -> str:
    """A short hash of the axes `space` searches for `kernel` on `shape`: changes whenever an axis or a value
    joins or leaves them."""
    axes = space.axes(kernel, shape, target.sms)
    return hashlib.sha256(repr(sorted(axes.items())).encode()).hexdigest()[:8]
