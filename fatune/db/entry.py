"""One tuned entry: the winning configs of a key, what was measured, and the checks every entry passes.

A tuned DB travels between machines, so each entry is validated wherever it comes in (`Entry.check`): known
fields of the kinds the kernels and the dispatcher take, times a GPU can measure, configs the kernels accept.
An entry stores the code hashes of the kernels it was measured with (`template_hash`: one per kernel source
its configs can launch, as "fwd:HASH,bwd:HASH,..."); it is stale when today's kernels for its configs hash
otherwise (another Triton version, or a template edit that changed their code). A launch checks the sources
it runs against them (fatune.kernel.triton.launch), so reading the DB renders nothing.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import triton

from fatune.db.keys import KEY_COLUMNS, MAX_BUCKET, MIN_BUCKET, mask_variants, variant_fields
from fatune.kernel.family import family
from fatune.kernel.gluon.codegen import unpersistent
from fatune.kernel.spec import (
    DTYPES,
    LATER_FIELDS,
    MAX_HEAD_DIM,
    STRUCTURE_FIELDS,
    AttentionConfig,
    GluonBackwardConfig,
    GluonConfig,
    KernelSpec,
    LaunchConfig,
    misplaced_structure,
)

MAX_COUNT = 1 << 62  # informational integers (batch, trials, ...) must fit SQLite's int64


MIN_TIME_MS = 1e-3  # 1 µs: no GPU kernel launch completes sooner, so no stored time can be shorter


# 10 PFLOP/s: several times the dense 16-bit tensor-core peak of any GPU today (an H100's or H200's is about
# 1 PFLOP/s); a time implying more on the problem an entry stores was not measured
MAX_FLOPS_PER_S = 10e15


class DBError(Exception):
    """A tuned DB file that fatune cannot use (unreadable, foreign, corrupt or from a newer fatune)."""


class InvalidEntry(DBError):
    """An entry whose fields the kernels or the dispatcher cannot use; the message names the field."""


def is_stale(entry: Entry, render: bool = True) -> list[str]:
    """Why `entry` cannot be used by this installation: another Triton version, or (`render`: its kernels
    rendered with these templates) kernels whose code has changed since it was measured; [] if it can. The
    dispatcher renders only its nearest candidates (TunedDB.match); a launch checks the sources it runs too
    (Entry.sources)."""
    reasons = []
    if entry.triton_version != triton.__version__:
        reasons.append(f"Triton {entry.triton_version} (running {triton.__version__})")
    if render:
        try:
            expected = entry.kernel_hashes()
        except Exception as error:  # noqa: BLE001 - a config these templates cannot render is stale too
            expected = f"none ({type(error).__name__})"
        if entry.template_hash != expected:
            reasons.append(f"kernels that have changed since (kernel hashes {entry.template_hash:.60}, these "
                           f"templates render {expected:.60})")
    return reasons


# the mask variants whose calls a route hands whole to torch SDPA (fatune.runtime.routes): no mask tensor, ALiBi,
# window, key lengths, packed or paged inputs; causal (if at all) aligned top-left, as SDPA's is_causal
ROUTABLE_VARIANTS = ("none", "causal", "dropout", "causal+dropout")

# mask-variant parts whose sizes an entry does not store (a window's width, the kept keys, the documents, a mask's
# contents): two entries of such a variant may have timed different problems at the same batch, heads and lengths
_UNSTORED_SIZES = ("window", "seqlens-k", "varlen", "mask-")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _creation_time(value: str) -> datetime.datetime:
    """A created_at as a UTC time ('' is now): compared as times, not strings (ISO 8601 has other spellings
    of a date, such as week dates, that sort after every calendar date)."""
    if not value:
        return datetime.datetime.now(datetime.timezone.utc)
    when = datetime.datetime.fromisoformat(value)
    return when.replace(tzinfo=datetime.timezone.utc) if when.tzinfo is None else when


@dataclass
class Entry:
    """One tuned result: the key columns, the winning configs and what was measured."""

    gpu: str
    capability: str
    triton_version: str
    torch_version: str
    template_hash: str
    dtype: str
    head_dim: int
    head_dim_v: int
    mask_variant: str
    group_size: int
    seqlen_q_bucket: int
    seqlen_k_bucket: int
    fwd_config: dict = field(default_factory=dict)
    bwd_config: dict = field(default_factory=dict)  # {"dkdv": {...}, "dq": {...}}
    fwd_ms: float = math.nan
    bwd_ms: float = math.nan  # NaN (with fwd_bwd_ms): a forward-only entry, its backward not timed
    fwd_bwd_ms: float = math.nan
    tflops: float = math.nan  # of the forward+backward (of the forward alone in a forward-only entry)
    sdpa_backend: str = ""
    sdpa_ms: float = math.nan  # SDPA's best training step (its forward alone for a forward-only entry)
    speedup: float = math.nan  # SDPA fwd+bwd ms / fatune fwd+bwd ms (forward ms / forward ms if forward-only)
    batch: int = 0
    heads: int = 0
    seqlen_q: int = 0
    seqlen_k: int = 0
    trials: int = 0
    interpreted: bool = False  # timed in the Triton interpreter: not meaningful
    created_at: str = ""

    def key(self) -> tuple:
        return tuple(getattr(self, column) for column in KEY_COLUMNS)

    @property
    def forward_only(self) -> bool:
        """Tuned and timed for inference: the forward alone (its backward configs are the heuristic's)."""
        return isinstance(self.fwd_bwd_ms, float) and math.isnan(self.fwd_bwd_ms)

    @property
    def time_ms(self) -> float:
        """What the search minimised: the forward+backward, or the forward alone in a forward-only entry."""
        return self.fwd_ms if self.forward_only else self.fwd_bwd_ms

    def supersedes(self, other: Entry) -> bool:
        """Whether this entry should take `other`'s place (same key). Measured on the same problem (the stored
        batch, heads and lengths, in a mask variant they describe fully): the faster, by forward+backward time,
        or by forward time when either is forward-only (like with like: it has no backward time). Otherwise the
        two timed different problems and their times say nothing about each other's configs: the newer search
        wins (its studies started from the entry it replaces, fatune.tuning.search.warm_starts); a tie keeps `other`."""
        if self.sized and (self.batch, self.heads, self.seqlen_q, self.seqlen_k) == \
                (other.batch, other.heads, other.seqlen_q, other.seqlen_k):
            if self.forward_only or other.forward_only:
                return self.fwd_ms < other.fwd_ms
            return self.fwd_bwd_ms < other.fwd_bwd_ms
        return _creation_time(self.created_at) > _creation_time(other.created_at)

    def route(self) -> str:
        """The torch SDPA backend a call of this entry's key runs on ("" for fatune's kernels): the one measured
        beside fatune's winners, where it was faster on a GPU (an interpreter's timings decide nothing), for a
        mask variant SDPA computes as fatune does (ROUTABLE_VARIANTS; others time SDPA as a yardstick only)."""
        faster = math.isfinite(self.sdpa_ms) and math.isfinite(self.time_ms) and self.sdpa_ms < self.time_ms
        routable = self.mask_variant in ROUTABLE_VARIANTS and not self.interpreted
        return self.sdpa_backend if faster and self.sdpa_backend and routable else ""

    @property
    def sized(self) -> bool:
        """Whether the stored batch, heads and lengths describe the whole problem this entry timed: its mask
        variant has no size an entry does not store (a window's width, the kept keys, documents, a mask)."""
        return not any(part in self.mask_variant for part in _UNSTORED_SIZES)

    def describe(self) -> str:
        """A short name for messages: GPU, dtype, head dim, mask variant and buckets."""
        return (f"{self.gpu} {self.dtype} d{self.head_dim} {self.mask_variant} "
                f"Lq<={self.seqlen_q_bucket} Lk<={self.seqlen_k_bucket}")

    def check(self) -> Entry:
        """This entry if every field is one the kernels and the dispatcher can use; else InvalidEntry."""
        for name, (valid, expected) in _FIELD_CHECKS.items():
            value = getattr(self, name)
            if not valid(value):
                raise InvalidEntry(f"{name}: expected {expected}, got {value!r:.80}")
        untimed = [name for name in ("bwd_ms", "fwd_bwd_ms") if math.isnan(getattr(self, name))]
        if len(untimed) == 1:
            raise InvalidEntry(f"{untimed[0]}: NaN (not timed) only in a forward-only entry, where bwd_ms and "
                               f"fwd_bwd_ms both are; expected a time")
        self._check_throughput()
        if not isinstance(self.bwd_config, dict) or set(self.bwd_config) != {"dkdv", "dq"}:
            raise InvalidEntry(f"bwd_config: expected an object with exactly 'dkdv' and 'dq' launch configs, "
                               f"got {self.bwd_config!r:.80}")
        for kernel, name in (("fwd", "fwd_config"), ("dkdv", "bwd_config.dkdv"), ("dq", "bwd_config.dq")):
            data = self.fwd_config if kernel == "fwd" else self.bwd_config[kernel]
            if kernel in ("fwd", "dkdv") and isinstance(data, dict) and "family" in data:
                config = _gluon_config(name, data, GluonConfig if kernel == "fwd" else GluonBackwardConfig)
                unfit = unpersistent(self.spec(), config) if kernel == "fwd" else None
                if unfit:
                    raise InvalidEntry(f"{name}.persistent: {unfit}")
                parts = getattr(config, "group_split", 1)
                if parts > 1 and self.group_size % parts:  # (the search splits a group evenly, never a lone head)
                    raise InvalidEntry(f"{name}.group_split: expected 1 or a divisor of the group size "
                                       f"{self.group_size}, got {parts}")
                continue
            misplaced = misplaced_structure(kernel, _launch_config(name, data))
            if misplaced:
                raise InvalidEntry(f"{name}: {misplaced} do not apply to the {kernel} kernel")
        return self

    def forward_flops(self) -> int | None:
        """The FLOPs of the forward pass of the problem this entry timed: 2 per multiply-add of Q K^T and P V over
        the (query, key) pairs its mask keeps, as fatune.tuning.shape.Shape.flops counts them. None where the stored
        sizes do not say (not stored, or a variant with sizes an entry does not store: `sized`)."""
        sizes = (self.batch, self.heads, self.seqlen_q, self.seqlen_k)
        if not self.sized or not all(size > 0 for size in sizes):
            return None
        fields = variant_fields()[self.mask_variant]
        lq, lk = self.seqlen_q, self.seqlen_k
        pairs = _causal_pairs(lq, lk, lk - lq if fields["bottom_right"] else 0) if fields["causal"] else lq * lk
        return 2 * self.batch * self.heads * pairs * (self.head_dim + self.head_dim_v)

    def _check_throughput(self) -> None:
        """InvalidEntry naming the time that would put its problem's FLOPs above MAX_FLOPS_PER_S."""
        forward = self.forward_flops()
        if forward is None:
            return
        passes = {"fwd_ms": 1.0, "bwd_ms": 2.5, "fwd_bwd_ms": 3.5, "sdpa_ms": 1.0 if self.forward_only else 3.5}
        for name, factor in passes.items():
            ms, flops = getattr(self, name), forward * factor
            least = flops / MAX_FLOPS_PER_S * 1e3
            if not math.isnan(ms) and ms < least:
                raise InvalidEntry(
                    f"{name}: {ms:.3g} ms for the {flops:.3g} FLOPs of its problem (batch {self.batch}, heads "
                    f"{self.heads}, seqlen_q {self.seqlen_q}, seqlen_k {self.seqlen_k}) is {flops / ms / 1e9:.3g} "
                    f"TFLOP/s, above any GPU's peak; expected a time >= {least:.3g} ms")

    def spec(self) -> KernelSpec:
        """The kernel spec this entry was tuned for (its dtype, head dims and mask variant)."""
        return KernelSpec(self.dtype, self.head_dim, self.head_dim_v, **variant_fields()[self.mask_variant])

    def kernel_hashes(self) -> str:
        """The code hashes of the kernels this entry's configs launch with these templates (rendered)."""
        config = self.attention_config()
        return family(config.family).kernel_hashes(self.spec(), config, self.group_size > 1)

    @property
    def sources(self) -> frozenset[str]:
        """The kernel sources this entry was measured with ("KIND:CODE_HASH" each): a launch runs it only on
        these."""
        return frozenset(self.template_hash.split(","))

    def attention_config(self) -> AttentionConfig:
        """The three kernels' launch configs this entry stores."""
        return AttentionConfig.from_dict({"fwd": self.fwd_config, **self.bwd_config})

    def to_row(self) -> dict[str, Any]:
        row = asdict(self)
        row["fwd_config"] = json.dumps(self.fwd_config, sort_keys=True)
        row["bwd_config"] = json.dumps(self.bwd_config, sort_keys=True)
        row["interpreted"] = int(self.interpreted)
        row["created_at"] = self.created_at or _now()
        return row

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Entry:
        """The checked entry a DB row holds; InvalidEntry naming the field if it holds none."""
        data = {name: row.get(name) for name in _COLUMNS}
        missing = [name for name in KEY_COLUMNS if data[name] is None]
        if missing:
            raise InvalidEntry(f"{missing[0]}: expected a value, got NULL")
        for name in ("fwd_config", "bwd_config"):
            if not isinstance(data[name], str):
                raise InvalidEntry(f"{name}: expected a JSON text, got {data[name]!r:.80}")
            try:
                data[name] = json.loads(data[name])
            except (ValueError, RecursionError) as error:
                raise InvalidEntry(f"{name}: not valid JSON ({error})") from None
        if data["interpreted"] not in (0, 1):
            raise InvalidEntry(f"interpreted: expected 0 or 1, got {data['interpreted']!r:.80}")
        data["interpreted"] = bool(data["interpreted"])
        for name, kind in _COLUMNS.items():
            if data[name] is None:
                data[name] = math.nan if kind is float else ("" if kind is str else 0)  # SQLite stores NaN as NULL
        return cls(**data).check()

    @classmethod
    def from_json(cls, data: Any) -> Entry:
        """The checked entry an export's JSON object holds: every field present, no unknown ones."""
        if not isinstance(data, dict):
            raise InvalidEntry(f"expected an object with the entry's fields, got {type(data).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(str(name) for name in data if name not in names)
        missing = [name for name in names if name not in data]
        if unknown or missing:
            raise InvalidEntry(f"{(unknown or missing)[0]}: {'unknown' if unknown else 'missing'} field")
        return cls(**data).check()


def _is_int(value: Any, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high


def _is_number(value: Any, low: float, high: float = math.inf, *, above: bool = False, nan: bool = False) -> bool:
    """A finite int or float in low..high (> low with above); NaN, 'not measured', with nan."""
    if type(value) not in (int, float):
        return False
    if math.isnan(value):
        return nan
    return math.isfinite(value) and (value > low if above else value >= low) and value <= high


def _is_time(value: Any, *, nan: bool = False) -> bool:
    """A time an entry may store: finite milliseconds >= MIN_TIME_MS (NaN, 'not measured', with nan)."""
    return _is_number(value, MIN_TIME_MS, nan=nan)


def _causal_pairs(lq: int, lk: int, offset: int) -> int:
    """The (query, key) pairs a causal mask keeps: query row i sees keys 0 .. i + offset (offset 0: top-left,
    Lk - Lq: bottom-right), that is clamp(i + 1 + offset, 0, Lk) keys."""
    def upto(n: int) -> int:  # sum of min(a, lk) for a in 1..n
        if n <= 0:
            return 0
        return n * (n + 1) // 2 if n <= lk else lk * (lk + 1) // 2 + (n - lk) * lk

    return upto(lq + offset) - upto(offset)


def _is_text(value: Any, pattern: str = r"[^\x00-\x1f\x7f]{1,200}") -> bool:
    """A string matching `pattern`: by default one line of printable text (a field is printed in log lines)."""
    return isinstance(value, str) and re.fullmatch(pattern, value) is not None


_FIELD_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "gpu": (_is_text, "a GPU name"),
    "capability": (lambda v: _is_text(v, r"\d+\.\d+|cpu"), "'MAJOR.MINOR' such as '9.0', or 'cpu'"),
    "triton_version": (_is_text, "a Triton version"),
    "torch_version": (_is_text, "a torch version"),
    "template_hash": (lambda v: _is_text(v, r"[^\x00-\x1f\x7f]{1,4000}"), "kernel hashes, one line"),
    "dtype": (lambda v: isinstance(v, str) and v in DTYPES, f"one of {sorted(DTYPES)}"),
    "head_dim": (lambda v: _is_int(v, 1, MAX_HEAD_DIM), f"an int in 1..{MAX_HEAD_DIM}"),
    "head_dim_v": (lambda v: _is_int(v, 1, MAX_HEAD_DIM), f"an int in 1..{MAX_HEAD_DIM}"),
    "mask_variant": (lambda v: isinstance(v, str) and v in mask_variants(),
                     "a mask variant such as 'none', 'causal' or 'causal+window-left+bottom-right'"),
    "group_size": (lambda v: _is_int(v, 1, MAX_COUNT), "an int >= 1"),
    "seqlen_q_bucket": (lambda v: _is_int(v, MIN_BUCKET, MAX_BUCKET) and v & (v - 1) == 0,
                        f"a power of two in {MIN_BUCKET}..{MAX_BUCKET}"),
    "seqlen_k_bucket": (lambda v: _is_int(v, MIN_BUCKET, MAX_BUCKET) and v & (v - 1) == 0,
                        f"a power of two in {MIN_BUCKET}..{MAX_BUCKET}"),
    "fwd_ms": (_is_time, f"a finite time >= {MIN_TIME_MS} ms (no kernel runs faster)"),
    "bwd_ms": (lambda v: _is_time(v, nan=True), f"a finite time >= {MIN_TIME_MS} ms, or NaN (forward-only)"),
    "fwd_bwd_ms": (lambda v: _is_time(v, nan=True), f"a finite time >= {MIN_TIME_MS} ms, or NaN (forward-only)"),
    "tflops": (lambda v: _is_number(v, 0, MAX_FLOPS_PER_S / 1e12, nan=True),
               f"a finite number in 0..{MAX_FLOPS_PER_S / 1e12:.0f} (TFLOP/s), or NaN"),
    "sdpa_backend": (lambda v: v == "" or _is_text(v), "'' or one line of text"),
    "sdpa_ms": (lambda v: _is_time(v, nan=True), f"a finite time >= {MIN_TIME_MS} ms, or NaN"),
    "speedup": (lambda v: _is_number(v, 0, above=True, nan=True), "a finite number > 0, or NaN"),
    **{name: (lambda v: _is_int(v, 0, MAX_COUNT), "an int >= 0")
       for name in ("batch", "heads", "seqlen_q", "seqlen_k", "trials")},
    "interpreted": (lambda v: isinstance(v, bool), "true or false"),
    "created_at": (lambda v: _is_creation_time(v), "'' or an ISO 8601 time not in the future (a newer entry "
                                                     "replaces an older one of another problem)"),
}


def _is_creation_time(value: Any) -> bool:
    """'' (unknown), or an ISO 8601 time at most a day ahead of this machine's clock (clocks drift; a forged
    future time would win every upsert against entries of other problems)."""
    if not isinstance(value, str):
        return False
    if not value:
        return True
    try:
        when = _creation_time(value)
    except ValueError:
        return False
    return when <= datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=1)


def _launch_config(name: str, data: Any) -> LaunchConfig:
    """The LaunchConfig `data` holds (every field an int the kernels accept); InvalidEntry naming the field."""
    fields = [f.name for f in dataclasses.fields(LaunchConfig)]
    optional = sorted(set(STRUCTURE_FIELDS) | set(LATER_FIELDS))  # older entries lack them
    required = [field for field in fields if field not in optional]
    if not isinstance(data, dict) or not set(required) <= set(data) <= set(fields):
        raise InvalidEntry(f"{name}: expected an object with {required} (and optionally {optional}), "
                           f"got {data!r:.80}")
    return _config_of(name, data, list(data), lambda: LaunchConfig(**data))


def _gluon_config(name: str, data: dict, kind: type = GluonConfig) -> GluonConfig | GluonBackwardConfig:
    """The Gluon config of `kind` (the forward's or the backward's) `data` holds (the family named, every field an
    int the kernel accepts, a register split the GPU can give); InvalidEntry naming the field."""
    fields = [f.name for f in dataclasses.fields(kind)]
    # older entries lack them
    optional = ("overlap", "pingpong", "persistent") if kind is GluonConfig else ("shared_dq", "group_split")
    required = [field for field in fields if field not in optional]
    if data.get("family") != "gluon" or not {"family", *required} <= set(data) <= {"family", *fields}:
        raise InvalidEntry(f"{name}: expected a Triton launch config or {{'family': 'gluon'}} with {required}"
                           f"{f' (and optionally {list(optional)})' if optional else ''}, got {data!r:.80}")
    return _config_of(name, data, [key for key in fields if key in data], lambda: kind.from_dict(data))


def _config_of(name: str, data: dict, ints: list[str], make: Callable[[], Any]) -> Any:
    """make(), once the `ints` fields of `data` are ints; InvalidEntry naming the field that is not, or the one
    the config refuses."""
    for key in ints:
        if type(data[key]) is not int:
            raise InvalidEntry(f"{name}.{key}: expected an int, got {data[key]!r:.80}")
    try:
        return make()
    except ValueError as error:
        raise InvalidEntry(f"{name}.{error}") from None


_COLUMNS = {
    "gpu": str, "capability": str, "triton_version": str, "torch_version": str, "template_hash": str, "dtype": str,
    "head_dim": int, "head_dim_v": int, "mask_variant": str, "group_size": int, "seqlen_q_bucket": int,
    "seqlen_k_bucket": int, "fwd_config": str, "bwd_config": str, "fwd_ms": float, "bwd_ms": float,
    "fwd_bwd_ms": float, "tflops": float, "sdpa_backend": str, "sdpa_ms": float, "speedup": float, "batch": int,
    "heads": int, "seqlen_q": int, "seqlen_k": int, "trials": int, "interpreted": int, "created_at": str,
}
