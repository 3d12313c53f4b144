"""What a generated kernel computes (KernelSpec) and how it is launched (LaunchConfig).

A KernelSpec is fixed at code-generation time: it chooses code paths in the
templates (which masks exist, how wide the head-dim lanes are). A LaunchConfig
holds the tunable numbers (tile sizes, warps, pipeline stages). An
AttentionConfig bundles the three independent kernels' launch configs:
forward, backward dK/dV and backward dQ.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
_DTYPE_ALIASES = {
    "fp16": "float16",
    "half": "float16",
    "f16": "float16",
    "bf16": "bfloat16",
    "fp32": "float32",
    "float": "float32",
    "f32": "float32",
}
MAX_HEAD_DIM = 256
_CONFIG_RE = re.compile(r"(\d+)x(\d+)(?:/w(\d+))?(?:/s(\d+))?(?:/k(\d+))?(/g)?(/t)?(/a([12])?)?(/d2)?(/c([12])?)?"
                        r"(?:/r(\d+))?")
MAX_SPLITS = 128
DECODE_QUERIES = 16  # calls with at most this many queries per sequence (decode) read K/V at memory speed
MIN_MAXNREG = 24  # the fewest registers per thread ptxas accepts as a cap
_POW2_TILES = (16, 32, 64, 128, 256)


def dtype_name(dtype: str | torch.dtype) -> str:
    """Canonical dtype name ('float16', 'bfloat16', 'float32') for a torch dtype or alias."""
    if isinstance(dtype, torch.dtype):
        for name, value in DTYPES.items():
            if value == dtype:
                return name
        raise TypeError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype}")
    name = _DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if name not in DTYPES:
        raise ValueError(f"dtype: expected one of fp16, bf16, fp32 (or {sorted(DTYPES)}), got {dtype!r}")
    return name


def lse_dtype_name(dtype: str, attn_mask: str = "none") -> str:
    """The Triton type of the per-row LSE the forward stores for inputs of `dtype` (KernelSpec's LSE_DTYPE):
    float64 for float32 inputs, and under an additive mask, whose biases (down to the kernels' MIN_BIAS) can put
    a row's LSE near -2^34, where a float32 LSE would lose the log of the row's sum and the backward's P would be
    off by that sum; float32 otherwise."""
    return "tl.float64" if dtype == "float32" or attn_mask == "additive" else "tl.float32"


def lanes(dim: int) -> int:
    """Width of the register tile holding `dim` elements: the next power of two, at least 16."""
    return max(16, 1 << (dim - 1).bit_length())


MASK_KINDS = ("none", "bool", "additive")
SEQLEN_MODES = ("fixed", "seqlens_k", "varlen")


@dataclass(frozen=True)
class KernelSpec:
    """The compile-time shape of the computation: dtype, head dims and mask variant.

    Each field switches code in or out of the generated kernels; a kernel without a mask
    carries no mask code. Run-time values (window sizes, lengths, dropout rate) are
    kernel arguments.

    causal        keys j <= i + offset only (offset: 0 top-left, L_k - L_q bottom-right)
    window_left   keys j >= i + offset - left (a sliding window's left edge is bounded)
    window_right  keys j <= i + offset + right (the right edge is bounded)
    bottom_right  diagonal offset L_k - L_q (flash-attn) instead of 0 (torch SDPA)
    attn_mask     "none", "bool" (True = keep) or "additive" (added to the scores)
    seqlens       "fixed", "seqlens_k" (per-batch key lengths) or "varlen" (packed)
    alibi         per-head linear bias -slope * |i + offset - j| computed in-kernel
    dropout       dropout on the probabilities, regenerated in backward from a seed
    paged         keys and values read from a paged cache through a block table (forward only)
    """

    dtype: str
    head_dim: int
    head_dim_v: int = 0  # 0: same as head_dim
    causal: bool = False
    window_left: bool = False
    window_right: bool = False
    bottom_right: bool = False
    attn_mask: str = "none"
    seqlens: str = "fixed"
    alibi: bool = False
    dropout: bool = False
    paged: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if not self.head_dim_v:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        for field in ("head_dim", "head_dim_v"):
            value = getattr(self, field)
            if not isinstance(value, int) or not 1 <= value <= MAX_HEAD_DIM:
                raise ValueError(f"{field}: expected an int in 1..{MAX_HEAD_DIM}, got {value!r}")
        if self.attn_mask not in MASK_KINDS:
            raise ValueError(f"attn_mask: expected one of {MASK_KINDS}, got {self.attn_mask!r}")
        if self.seqlens not in SEQLEN_MODES:
            raise ValueError(f"seqlens: expected one of {SEQLEN_MODES}, got {self.seqlens!r}")

    @property
    def mask_variant(self) -> str:
        """The mask variant's name, as stored in the tuned DB (e.g. 'causal', 'causal+window-left+bottom-right').

        One name per combination of compile-time switches (every field but dtype and head
        dims), so the tuned-DB key never mixes two kernels; a plain call is 'none' or 'causal'.
        """
        parts = []
        if self.causal:
            parts.append("causal")
        if self.window_left:
            parts.append("window-left")
        if self.window_right:
            parts.append("window-right")
        if self.bottom_right:
            parts.append("bottom-right")
        if self.attn_mask != "none":
            parts.append(f"mask-{self.attn_mask}")
        if self.seqlens != "fixed":
            parts.append(self.seqlens.replace("_", "-"))
        if self.alibi:
            parts.append("alibi")
        if self.dropout:
            parts.append("dropout")
        if self.paged:
            parts.append("paged")
        return "+".join(parts) or "none"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KernelSpec:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in names})


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes, launch parameters and code-structure choices of one kernel.

    block_m: query rows per tile (B_r); block_n: key/value rows per tile (B_c).
    Forward only:
    num_splits: the keys of each query tile are cut into this many runs, each a program of
        its own, and the last to finish merges their partial results by log-sum-exp (split-KV,
        flash-decoding); 0 = chosen when launching, from the grid and the GPU's SM count.
    pack_gqa: 1 = one program serves all query heads that share a K/V head (their rows are
        packed into the tile), so each K/V tile is loaded once per group.
    tma: 1 = K and V tiles (and the query tile, unless packed) are read through on-device TMA
        tensor descriptors, one per (batch, head) program; the hardware's bounds check
        zero-fills rows past the sequence. Hopper (sm_90) and newer, and only for tensors
        TMA can read (unit head-dim stride, 16-byte aligned base and strides): launches
        elsewhere drop it (fatune.kernel.triton.resolve.resolve). Also a dK/dV field: the query and dO
        tiles streaming past the key tile are read through TMA descriptors (dropped
        likewise, and for a dO TMA cannot read).
    dK/dV only:
    atomic_dq: 1 = the dK/dV kernel also computes dQ (dS K, added to a float32 buffer with
        atomic adds), so the backward runs 5 tile products instead of 7 and no dQ kernel;
        the dQ config then only sizes the small kernels around it (Delta, dQ's final store).
        2 = the same, each tile's dS K added in one TMA bulk reduction (cp.reduce.async.bulk)
        instead of one atomic per element: Hopper and newer, head dims that are a multiple of
        4 (launches elsewhere take 1, fatune.kernel.triton.resolve.resolve).
    split_d: 2 = two programs share each key tile, each owning half of dK's and dV's head dim
        (and of dQ's, with atomic dQ): half the accumulators, so large head dims keep tensor-core
        tiles in registers, for S and dP computed over the full head dim by both (1.5x the
        products). Head dims of at least 32 lanes (fatune.kernel.triton.resolve.resolve takes 1 below).
    dQ only:
    concurrent: 1 = the dQ kernel runs on a second CUDA stream beside the dK/dV kernel, launched first,
        after a pass of its own computes Delta (as the dQ kernel otherwise does before dK/dV starts); 2 =
        the same, the dK/dV kernel launched first. Each kernel's last wave leaves multiprocessors idle that
        the other's programs can take. No effect with atomic dQ (no dQ kernel runs) or in the interpreter
        (no streams: the three launches run in order).
    Every kernel:
    maxnreg: registers per thread the compiler may use (0: its own choice, up to 255); fewer can fit
        more programs on a multiprocessor where shared memory allows, at the price of spills.
    """

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    num_splits: int = 1
    pack_gqa: int = 0
    tma: int = 0
    atomic_dq: int = 0
    split_d: int = 1
    concurrent: int = 0
    maxnreg: int = 0

    def __post_init__(self) -> None:
        for field in ("block_m", "block_n"):
            value = getattr(self, field)
            if value not in _POW2_TILES:
                raise ValueError(f"{field}: expected one of {_POW2_TILES}, got {value!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps: expected one of 1, 2, 4, 8, 16, got {self.num_warps!r}")
        if not _is_int(self.num_stages) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages: expected an int in 1..8, got {self.num_stages!r}")
        if not _is_int(self.num_splits) or not 0 <= self.num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits: expected an int in 0..{MAX_SPLITS} (0 = chosen at launch), "
                             f"got {self.num_splits!r}")
        for field in ("pack_gqa", "tma"):
            value = getattr(self, field)
            if value not in (0, 1) or not _is_int(value):
                raise ValueError(f"{field}: expected 0 or 1, got {value!r}")
        if self.atomic_dq not in (0, 1, 2) or not _is_int(self.atomic_dq):
            raise ValueError(f"atomic_dq: expected 0, 1 or 2, got {self.atomic_dq!r}")
        if self.split_d not in (1, 2) or not _is_int(self.split_d):
            raise ValueError(f"split_d: expected 1 or 2, got {self.split_d!r}")
        if self.concurrent not in (0, 1, 2) or not _is_int(self.concurrent):
            raise ValueError(f"concurrent: expected 0, 1 or 2, got {self.concurrent!r}")
        if not _is_int(self.maxnreg) or not (self.maxnreg == 0 or MIN_MAXNREG <= self.maxnreg <= 255):
            raise ValueError(f"maxnreg: expected 0 (the compiler's choice) or an int in {MIN_MAXNREG}..255, "
                             f"got {self.maxnreg!r}")

    def to_dict(self) -> dict[str, int]:
        """The fields, less those added after tuned DBs were shipped while at their plain value: the dict
        enters every rendered source, so an older entry's kernels (and their hash) stay what they were."""
        data = dataclasses.asdict(self)
        for name, plain in LATER_FIELDS.items():
            if data[name] == plain:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LaunchConfig:
        return cls(**{f.name: int(data[f.name]) for f in dataclasses.fields(cls) if f.name in data})

    @property
    def compile_options(self) -> dict[str, int]:
        """Triton's compile options for a kernel launched with this config."""
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.maxnreg:
            options["maxnreg"] = self.maxnreg
        return options

    @property
    def structure(self) -> dict[str, int]:
        """The code-structure fields that differ from the plain kernel's."""
        return {name: getattr(self, name) for name in STRUCTURE_FIELDS if getattr(self, name) != STRUCTURE_FIELDS[name]}

    def __str__(self) -> str:
        text = f"{self.block_m}x{self.block_n}/w{self.num_warps}/s{self.num_stages}"
        if self.num_splits != 1:
            text += f"/k{self.num_splits}"
        atomic = {0: "", 1: "/a", 2: "/a2"}[self.atomic_dq]
        concurrent = {0: "", 1: "/c", 2: "/c2"}[self.concurrent]
        return text + ("/g" if self.pack_gqa else "") + ("/t" if self.tma else "") + atomic + \
            ("/d2" if self.split_d == 2 else "") + concurrent + (f"/r{self.maxnreg}" if self.maxnreg else "")

    @classmethod
    def parse(cls, text: str) -> LaunchConfig:
        """Read the `str()` form back: 'MxN[/wWARPS][/sSTAGES][/kSPLITS][/g][/t][/a|/a2][/d2][/c|/c2][/rREGS]',
        e.g. '128x64/w4/s3', '64x64/w4/s2/k8/g' or '128x64/w8/s3/t/r128' (forward), '64x128/w8/s2/a' or
        '64x64/w4/s1/t/d2' (dK/dV), '128x64/w8/s3/c' (dQ)."""
        match = _CONFIG_RE.fullmatch(text.strip())
        if not match:
            raise ValueError(f"config: expected BLOCK_MxBLOCK_N[/wWARPS][/sSTAGES][/kSPLITS][/g][/t][/a|/a2][/d2][/c|/c2]"
                             f"[/rREGS] such as 128x64/w4/s3, got {text!r}")
        (block_m, block_n, warps, stages, splits, pack, tma, atomic, atomic_kind, split_d, concurrent, concurrent_kind,
         maxnreg) = match.groups()
        return cls(int(block_m), int(block_n), int(warps or 4), int(stages or 2), int(splits or 1), int(bool(pack)),
                   tma=int(bool(tma)), atomic_dq=int(atomic_kind or 1) if atomic else 0, split_d=2 if split_d else 1,
                   concurrent=int(concurrent_kind or 1) if concurrent else 0, maxnreg=int(maxnreg or 0))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# the code-structure fields and their plain-kernel values
STRUCTURE_FIELDS = {"num_splits": 1, "pack_gqa": 0, "tma": 0, "atomic_dq": 0, "split_d": 1, "concurrent": 0}
# fields added after the first shipped DB, and their plain values (LaunchConfig.to_dict; older entries lack them)
LATER_FIELDS = {"split_d": 1, "maxnreg": 0, "concurrent": 0}
KERNELS = ("fwd", "dkdv", "dq")
# the kernels whose code each structure field changes (the others keep the plain value)
STRUCTURE_OWNER = {"num_splits": ("fwd",), "pack_gqa": ("fwd",), "tma": ("fwd", "dkdv"), "atomic_dq": ("dkdv",),
                   "split_d": ("dkdv",), "concurrent": ("dq",)}


def misplaced_structure(kernel: str, config: LaunchConfig) -> list[str]:
    """The structure fields `config` sets that do not belong to `kernel` (sorted)."""
    return sorted(name for name in config.structure if kernel not in STRUCTURE_OWNER[name])


GLUON_SPLIT_M = 64  # rows per consumer warpgroup of a Gluon kernel, the forward's queries, the backward's keys (a wgmma's M)


GLUON_PRODUCER_REGS = 24  # registers per thread the Gluon forward's producer warpgroup keeps (setmaxnreg)


SM_REGISTERS = 65536  # 32-bit registers per Hopper multiprocessor, shared by the threads of one program


def gluon_register_cap(consumers: int) -> int:
    """The launch's register cap (maxnreg) of a Gluon forward with `consumers` warpgroups: all of an SM's
    registers over its warpgroups (the producer's included), a multiple of 8 (168 for two, 128 for three)."""
    return min(255, SM_REGISTERS // (128 * (consumers + 1))) // 8 * 8


@dataclass(frozen=True)
class GluonConfig:
    """A Gluon forward's launch: `consumers` warpgroups of 64 query rows each (block_m = 64 x consumers), key
    tiles of block_n rows streamed `num_stages` deep, the consumers' register budget (`consumer_regs`, set per
    warpgroup with setmaxnreg; the producer keeps GLUON_PRODUCER_REGS), the launch's register cap (`maxnreg`;
    0: gluon_register_cap), whether a consumer runs the softmax of tile j while P_{j-1} V_{j-1} is on the
    tensor cores (`overlap`, 1) or one step after the other (0), and whether the consumers take turns issuing
    their products (`pingpong`, FlashAttention-3's schedule: one's softmax under another's products), and
    whether one program per multiprocessor takes the query tiles in turn (`persistent`: the next tile's loads
    under the last one's epilogue; causal, the longest tiles first). The consumers' and the producer's
    registers must fit the pool the cap launches with (setmaxnreg waits for registers that never come
    otherwise)."""

    block_n: int = 128
    num_stages: int = 2
    consumers: int = 2
    consumer_regs: int = 240
    maxnreg: int = 0
    overlap: int = 1
    pingpong: int = 0
    persistent: int = 0

    def __post_init__(self) -> None:
        for name, allowed in (("block_n", (64, 128)), ("num_stages", (1, 2, 3, 4)), ("consumers", (2, 3)),
                              ("overlap", (0, 1)), ("pingpong", (0, 1)), ("persistent", (0, 1))):
            if getattr(self, name) not in allowed or not _is_int(getattr(self, name)):
                raise ValueError(f"{name}: expected one of {allowed}, got {getattr(self, name)!r}")
        if self.pingpong and not self.overlap:
            raise ValueError("pingpong: the consumers take turns issuing the overlapped loop's products; expected "
                             "0 with overlap=0")
        _check_registers(self)

    @property
    def block_m(self) -> int:
        return GLUON_SPLIT_M * self.consumers

    def to_dict(self) -> dict[str, Any]:
        return _gluon_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GluonConfig:
        return _gluon_config(cls, data)

    def __str__(self) -> str:
        return (f"gluon {self.block_m}x{self.block_n}/s{self.num_stages}/c{self.consumers}/r{self.consumer_regs}"
                f"/m{self.maxnreg}{'' if self.overlap else '/sequential'}{'/pingpong' if self.pingpong else ''}"
                f"{'/persistent' if self.persistent else ''}")


def _gluon_dict(config: GluonConfig | GluonBackwardConfig) -> dict[str, Any]:
    """A Gluon config as stored: its family named, then its fields."""
    return {"family": "gluon", **dataclasses.asdict(config)}


def _gluon_config(cls: type, data: dict[str, Any]) -> Any:
    """A Gluon config of `cls` from a stored dict: the fields it holds, as ints (absent ones take their defaults)."""
    return cls(**{field.name: int(data[field.name]) for field in dataclasses.fields(cls) if field.name in data})


def _check_registers(config: GluonConfig | GluonBackwardConfig) -> None:
    """Fill in a Gluon config's register cap (maxnreg 0: gluon_register_cap) and check that its consumers' and
    producer's registers fit the pool the cap launches with (setmaxnreg waits for registers that never come
    otherwise)."""
    if not (_is_int(config.consumer_regs) and 24 <= config.consumer_regs <= 256 and config.consumer_regs % 8 == 0):
        raise ValueError(f"consumer_regs: expected a multiple of 8 in 24..256, got {config.consumer_regs!r}")
    if config.maxnreg == 0:
        object.__setattr__(config, "maxnreg", gluon_register_cap(config.consumers))
    if not (_is_int(config.maxnreg) and 24 <= config.maxnreg <= 255):
        raise ValueError(f"maxnreg: expected an int in 24..255, got {config.maxnreg!r}")
    pool = 128 * (config.consumers + 1) * config.maxnreg
    wanted = 128 * (config.consumers * config.consumer_regs + GLUON_PRODUCER_REGS)
    if wanted > pool or pool > SM_REGISTERS:
        raise ValueError(f"consumer_regs: {config.consumers} consumer warpgroups of {config.consumer_regs} registers "
                         f"and a producer of {GLUON_PRODUCER_REGS} need {wanted} registers; maxnreg "
                         f"{config.maxnreg} launches with {pool} (at most {SM_REGISTERS})")


@dataclass(frozen=True)
class GluonBackwardConfig:
    """A Gluon backward's launch (its dK/dV kernel, which also adds dQ up): `consumers` warpgroups of 64 keys each
    (block_n = 64 x consumers), query tiles of block_m rows (Q and dO) streamed `num_stages` deep, dQ's products
    and bulk reductions `dq_slice` lanes wide, the consumers' register budget and the launch's register cap, as
    for GluonConfig. `shared_dq`: the consumers add up a query tile's dQ over the whole key tile, each for its
    share of the lanes (one reduction per tile, FlashAttention-3's), instead of each over its own keys.
    `group_split`: with grouped query heads, up to that many programs share a key tile's group (each summing a
    part of its heads, dK and dV added up in float32), where one program per key tile would leave the GPU idle."""

    block_m: int = 64
    num_stages: int = 2
    consumers: int = 2
    consumer_regs: int = 240
    maxnreg: int = 0
    dq_slice: int = 64
    shared_dq: int = 0
    group_split: int = 1

    def __post_init__(self) -> None:
        for name, allowed in (("block_m", (64, 128)), ("num_stages", (1, 2, 3, 4)), ("consumers", (2, 3)),
                              ("dq_slice", (32, 64, 128, 256)), ("shared_dq", (0, 1)),
                              ("group_split", (1, 2, 4, 8))):
            if getattr(self, name) not in allowed or not _is_int(getattr(self, name)):
                raise ValueError(f"{name}: expected one of {allowed}, got {getattr(self, name)!r}")
        _check_registers(self)

    @property
    def block_n(self) -> int:
        return GLUON_SPLIT_M * self.consumers

    def to_dict(self) -> dict[str, Any]:
        """Its fields, group_split only where it is not 1: a config stored before that field existed reads and
        renders as it did."""
        data = _gluon_dict(self)
        if self.group_split == 1:
            del data["group_split"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GluonBackwardConfig:
        return _gluon_config(cls, data)

    def __str__(self) -> str:
        return (f"gluon {self.block_m}x{self.block_n}/s{self.num_stages}/c{self.consumers}/r{self.consumer_regs}"
                f"/m{self.maxnreg}/dq{self.dq_slice}{'/shared' if self.shared_dq else ''}"
                f"{f'/g{self.group_split}' if self.group_split > 1 else ''}")


@dataclass(frozen=True)
class AttentionConfig:
    """Launch configs of the three kernels: forward, backward dK/dV, backward dQ. The forward's is a LaunchConfig
    (the Triton family) or a GluonConfig (the Gluon family's Hopper forward); the dK/dV kernel's a LaunchConfig or
    a GluonBackwardConfig (the Gluon family's Hopper backward, which adds dQ up: the dQ config then sets the tile of
    the Triton passes around it, attn_bwd_prep and attn_bwd_dq_store)."""

    fwd: LaunchConfig | GluonConfig
    dkdv: LaunchConfig | GluonBackwardConfig
    dq: LaunchConfig

    def __post_init__(self) -> None:
        for name in KERNELS:
            config = getattr(self, name)
            if isinstance(config, (GluonConfig, GluonBackwardConfig)):
                expected = {"fwd": GluonConfig, "dkdv": GluonBackwardConfig}.get(name)
                if not isinstance(config, expected or ()):
                    raise ValueError(f"{name}: a Gluon config runs the forward (GluonConfig) or the dK/dV kernel "
                                     f"(GluonBackwardConfig), got {config}")
                continue
            misplaced = misplaced_structure(name, getattr(self, name))
            if misplaced:
                owners = ", ".join(f"{field}: {'/'.join(STRUCTURE_OWNER[field])}" for field in misplaced)
                raise ValueError(f"{name}: {misplaced} belong to another kernel ({owners})")

    def replace(self, **changes: LaunchConfig) -> AttentionConfig:
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        return f"fwd {self.fwd} | dkdv {self.dkdv} | dq {self.dq}"

    def to_dict(self) -> dict[str, dict[str, int]]:
        return {name: getattr(self, name).to_dict() for name in KERNELS}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AttentionConfig:
        missing = [name for name in KERNELS if name not in data]
        if missing:
            raise ValueError(f"config: missing kernel entries {missing}; expected keys {list(KERNELS)}")
        gluon = {"fwd": GluonConfig, "dkdv": GluonBackwardConfig}

        def parse(name: str):
            entry = data[name]
            if isinstance(entry, dict) and entry.get("family") == "gluon" and name in gluon:
                return gluon[name].from_dict(entry)
            return LaunchConfig.from_dict(entry)

        return cls(**{name: parse(name) for name in KERNELS})

    @property
    def family(self) -> str:
        """The kernel family of this config (fatune.kernel.family): 'gluon' where a Gluon kernel runs the forward
        or the backward, else 'triton'."""
        return "gluon" if self.gluon_forward or self.gluon_backward else "triton"

    @property
    def gluon_forward(self) -> bool:
        return isinstance(self.fwd, GluonConfig)

    @property
    def gluon_backward(self) -> bool:
        return isinstance(self.dkdv, GluonBackwardConfig)


def lse_dtype(dtype: torch.dtype, additive: bool = False) -> torch.dtype:
    """The dtype of the per-row LSE (log2 units) the forward stores for inputs of `dtype` (`additive`: under an
    additive mask): float64 for float32 inputs and additive masks, float32 otherwise (fatune.kernel.spec.lse_dtype_name)."""
    return torch.float64 if dtype == torch.float32 or additive else torch.float32
