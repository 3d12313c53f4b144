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
MIN_MAXNREG = 24  # the fewest registers per thread ptxas accepts as a cap
_POW2_TILES = (16, 32, 64, 128, 256)


class TritonExpr(str):
    """A template option rendered verbatim into the generated source (e.g. tl.float32), not quoted."""


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

    def options(self) -> dict[str, Any]:
        """Upper-case constants the templates turn into `tl.constexpr` values."""
        return {
            "HEAD_DIM": self.head_dim,
            "HEAD_DIM_V": self.head_dim_v,
            "BLOCK_D": lanes(self.head_dim),
            "BLOCK_DV": lanes(self.head_dim_v),
            "DOT_PRECISION": "ieee" if self.dtype == "float32" else "tf32",
            # Delta = rowsum(dO * O) is later subtracted from dP (cancellation): for float32
            # inputs it is summed in float64 so its rounding stays below dP's.
            "DELTA_ACC": TritonExpr("tl.float64" if self.dtype == "float32" else "tl.float32"),
            # the per-row LSE (log2 units): P = exp2(S - LSE) loses the LSE's rounding at |LSE|'s magnitude
            # (4e-6 at 40), a float32 S's own size: float64 for float32 inputs (float32 dV's errors past 2x
            # torch's on 12 of 88 random calls, 6 with it); 16-bit rounding is far coarser
            "LSE_DTYPE": TritonExpr(lse_dtype_name(self.dtype, self.attn_mask)),
            # at head dims up to 32 the tile products are cheap next to the rest of a tile's work, and
            # dS's 16-bit rounding dominates dQ's error: split dS into hi + lo in every tile, not just
            # the masked ones (fp16 d16 causal dQ was 2.06x torch's error, over the 2x rule)
            "SPLIT_DS_EVERYWHERE": self.dtype != "float32" and max(self.head_dim, self.head_dim_v) <= 32,
            # dQ tiles whose rows see at most this many keys take Delta as sum P dP, not rowsum(dO * O): O's
            # rounding would reach their large dS (a row with one key gets dS = 0 exactly, as softmax's backward)
            "EXACT_DELTA_KEYS": 128,
        }

    def switches(self) -> dict[str, Any]:
        """Compile-time code-path switches: Jinja uses these to include or leave out code."""
        has_right = self.causal or self.window_right
        return {
            "HAS_RIGHT": has_right,
            "HAS_LEFT": self.window_left,
            "HAS_BAND": has_right or self.window_left,
            "IS_CAUSAL": self.causal,
            # the query tiles further down see more keys (a band's right edge; most mask tensors: causal, prefix
            # LM, documents): the forward and dQ kernels launch them first, so the last wave is short
            "LATE_ROWS_FIRST": bool(has_right) or self.attn_mask != "none",
            "BOTTOM_RIGHT": self.bottom_right,
            "MASK_KIND": self.attn_mask,
            "SEQLENS": self.seqlens,
            "ALIBI": self.alibi,
            "DROPOUT": self.dropout,
            "PAGED": self.paged,
            # Rows can end with every key masked (and -inf scores) in any tile, not just band tiles.
            "ANY_TILE_MASKS": self.attn_mask != "none",
            # a boolean mask is applied with the band's, in masked tiles only (fatune.mask_spans' full tiles skip it)
            "HAS_SCORE_MOD": self.attn_mask == "additive" or self.alibi,
            # 16-bit dS is split into hi + lo parts in masked tiles (see attn_bwd.py.jinja)
            "SPLIT_DS": self.dtype != "float32",
            # ... and with only a band to mask (no mask tensor or ALiBi, which can leave a row few keys anywhere),
            # only in masked tiles where some row sees at most EXACT_DELTA_KEYS keys: the rows whose dS is large.
            # A row that sees many keys has most of them in unmasked tiles, which never split (window 1024,
            # L = 8192: 2 of every ~17 tiles are masked; causal dQ took 10% less time without the splits)
            "SPLIT_DS_COUNTED": self.dtype != "float32" and max(self.head_dim, self.head_dim_v) > 32 and
                                bool(has_right or self.window_left) and self.attn_mask == "none" and not self.alibi,
            # float32 gradients are summed with Kahan compensation (see _common.py.jinja)
            "COMPENSATED": self.dtype == "float32",
            "PAD_D": lanes(self.head_dim) != self.head_dim,
            "PAD_DV": lanes(self.head_dim_v) != self.head_dim_v,
        }

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
        elsewhere drop it (fatune.launch.resolve). Also a dK/dV field: the query and dO
        tiles streaming past the key tile are read through TMA descriptors (dropped
        likewise, and for a dO TMA cannot read).
    dK/dV only:
    atomic_dq: 1 = the dK/dV kernel also computes dQ (dS K, added to a float32 buffer with
        atomic adds), so the backward runs 5 tile products instead of 7 and no dQ kernel;
        the dQ config then only sizes the small kernels around it (Delta, dQ's final store).
        2 = the same, each tile's dS K added in one TMA bulk reduction (cp.reduce.async.bulk)
        instead of one atomic per element: Hopper and newer, head dims that are a multiple of
        4 (launches elsewhere take 1, fatune.launch.resolve).
    split_d: 2 = two programs share each key tile, each owning half of dK's and dV's head dim
        (and of dQ's, with atomic dQ): half the accumulators, so large head dims keep tensor-core
        tiles in registers, for S and dP computed over the full head dim by both (1.5x the
        products). Head dims of at least 32 lanes (fatune.launch.resolve takes 1 below).
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


def atomic_dq_kinds(spec: KernelSpec) -> tuple[int, ...]:
    """The atomic_dq values that run as themselves for `spec` (fatune.launch.resolve lowers the others):
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
# read shared memory out of bounds (random call seed 1067163355; benchmarks/split_d_probe.py, session 29). Halves of
# 64 and 128 ran correctly; the search offers the split from SPLIT_D_LANES only, where it can pay
SPLIT_D_MIN_LANES = 128
# the search offers the split from this many lanes (at 128 it lost on every dK/dV tile, L=4096, session 9)
SPLIT_D_LANES = 256


def split_d_searched(spec: KernelSpec) -> bool:
    """Whether searches of `spec` offer dK/dV's head-dim split."""
    return min(lanes(spec.head_dim), lanes(spec.head_dim_v)) >= SPLIT_D_LANES


def split_d_runs(spec: KernelSpec) -> bool:
    """Whether dK/dV's head-dim split can run for `spec`: each half of at least 64 lanes (SPLIT_D_MIN_LANES), so
    the two head dims' halves are within 2x of each other as well (Triton 3.6 miscompiled halves of 128 and 32
    under a GQA loop: an illegal address on an H200 at 64x128/w8; benchmarks/fault_probe.py, session 16)."""
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


def misplaced_structure(kernel: str, config: LaunchConfig) -> list[str]:
    """The structure fields `config` sets that do not belong to `kernel` (sorted)."""
    return sorted(name for name in config.structure if kernel not in STRUCTURE_OWNER[name])


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


@dataclass(frozen=True)
class AttentionConfig:
    """Launch configs of the three kernels: forward, backward dK/dV, backward dQ."""

    fwd: LaunchConfig
    dkdv: LaunchConfig
    dq: LaunchConfig

    def __post_init__(self) -> None:
        for name in KERNELS:
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
        return cls(**{name: LaunchConfig.from_dict(data[name]) for name in KERNELS})
