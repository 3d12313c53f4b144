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
_CONFIG_RE = re.compile(r"(\d+)x(\d+)(?:/w(\d+))?(?:/s(\d+))?")
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


def lanes(dim: int) -> int:
    """Width of the register tile holding `dim` elements: the next power of two, at least 16."""
    return max(16, 1 << (dim - 1).bit_length())


@dataclass(frozen=True)
class KernelSpec:
    """The compile-time shape of the computation: dtype, head dims and mask variant."""

    dtype: str
    head_dim: int
    head_dim_v: int = 0  # 0: same as head_dim
    causal: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if not self.head_dim_v:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        for field in ("head_dim", "head_dim_v"):
            value = getattr(self, field)
            if not isinstance(value, int) or not 1 <= value <= MAX_HEAD_DIM:
                raise ValueError(f"{field}: expected an int in 1..{MAX_HEAD_DIM}, got {value!r}")

    @property
    def mask_variant(self) -> str:
        """The mask variant's name, as stored in the tuned DB."""
        return "causal" if self.causal else "none"

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
        }

    def switches(self) -> dict[str, bool]:
        """Compile-time code-path switches: Jinja uses these to include or leave out code."""
        return {
            "IS_CAUSAL": self.causal,
            "PAD_D": lanes(self.head_dim) != self.head_dim,
            "PAD_DV": lanes(self.head_dim_v) != self.head_dim_v,
        }

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and launch parameters of one kernel.

    block_m: query rows per tile (B_r); block_n: key/value rows per tile (B_c).
    """

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for field in ("block_m", "block_n"):
            value = getattr(self, field)
            if value not in _POW2_TILES:
                raise ValueError(f"{field}: expected one of {_POW2_TILES}, got {value!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps: expected one of 1, 2, 4, 8, 16, got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages: expected an int in 1..8, got {self.num_stages!r}")

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LaunchConfig:
        return cls(**{f.name: int(data[f.name]) for f in dataclasses.fields(cls) if f.name in data})

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}/w{self.num_warps}/s{self.num_stages}"

    @classmethod
    def parse(cls, text: str) -> LaunchConfig:
        """Read the `str()` form back: 'BLOCK_MxBLOCK_N[/wWARPS][/sSTAGES]', e.g. '128x64/w4/s3'."""
        match = _CONFIG_RE.fullmatch(text.strip())
        if not match:
            raise ValueError(f"config: expected BLOCK_MxBLOCK_N[/wWARPS][/sSTAGES] such as 128x64/w4/s3, got {text!r}")
        block_m, block_n, warps, stages = match.groups()
        return cls(int(block_m), int(block_n), int(warps or 4), int(stages or 2))


KERNELS = ("fwd", "dkdv", "dq")


@dataclass(frozen=True)
class AttentionConfig:
    """Launch configs of the three kernels: forward, backward dK/dV, backward dQ."""

    fwd: LaunchConfig
    dkdv: LaunchConfig
    dq: LaunchConfig

    def replace(self, **changes: LaunchConfig) -> AttentionConfig:
        return dataclasses.replace(self, **changes)

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
