"""The tuned database: winning launch configs per GPU, versions, kernel spec and shape bucket.

A SQLite file written with sqlite-utils. One row per key (KEY_COLUMNS but the kernel hash); an upsert keeps
the faster entry of one problem, or the newer search's of different problems (`Entry.supersedes`). WAL
journaling and a busy timeout let several searching processes write one file without losing rows; every
write runs in an IMMEDIATE transaction. The schema version lives in the `meta` table: older files are
migrated, newer or foreign ones refused.

A tuned DB travels between machines, so it is untrusted input: every entry is validated
when it is imported, upserted and read (`Entry.check`: times no GPU can measure included), only
regular files are opened (a FIFO would block SQLite forever), and a file is opened for reading
with `mode=ro` (or `immutable=1` where a WAL file's side files cannot be created, as in a
read-only deployment image). Exports are written in rollback-journal mode so that they can
be read from a read-only folder. A forward-only entry (an inference search: at most
DECODE_QUERIES queries per sequence) has bwd_ms and fwd_bwd_ms NaN, not timed, and the
heuristic's backward configs; the upsert then compares forward times.
This module also owns the key: how a call or a searched shape maps to key columns
(`call_key`), nearest-bucket matching and staleness.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import itertools
import json
import math
import os
import re
import sqlite3
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import sqlite_utils

from fatune.heuristics import DECODE_QUERIES
from fatune.spec import (DTYPES, LATER_FIELDS, MASK_KINDS, MAX_HEAD_DIM, SEQLEN_MODES, STRUCTURE_FIELDS,
                         AttentionConfig, KernelSpec, LaunchConfig, misplaced_structure)

if TYPE_CHECKING:
    from fatune.inputs import AttentionProblem
    from fatune.measure import Shape

SCHEMA_VERSION = 1
TABLE = "entries"
DB_ENV = "FATUNE_DB"
MIN_BUCKET, MAX_BUCKET = 16, 1 << 31  # sequence lengths are int32 in the kernels
MAX_COUNT = 1 << 62  # informational integers (batch, trials, ...) must fit SQLite's int64
MIN_TIME_MS = 1e-3  # 1 µs: no GPU kernel launch completes sooner, so no stored time can be shorter
# 10 PFLOP/s: several times the dense 16-bit tensor-core peak of any GPU today (an H100's or H200's is about
# 1 PFLOP/s); a time implying more on the problem an entry stores was not measured
MAX_FLOPS_PER_S = 10e15


class DBError(Exception):
    """A tuned DB file that fatune cannot use (unreadable, foreign, corrupt or from a newer fatune)."""


class InvalidEntry(DBError):
    """An entry whose fields the kernels or the dispatcher cannot use; the message names the field."""


def seqlen_bucket(seqlen: int) -> int:
    """Log-scale bucket of a sequence length: the next power of two, at least 16."""
    return max(MIN_BUCKET, 1 << max(0, int(seqlen) - 1).bit_length())


def default_path() -> Path:
    """The user's tuned DB: $FATUNE_DB, else ~/.cache/fatune/tuned.sqlite."""
    from fatune.codegen import user_path

    try:
        return user_path(DB_ENV, "tuned.sqlite")
    except RuntimeError as error:  # Path.expanduser: no home directory for '~user'
        raise DBError(f"${DB_ENV}={os.environ.get(DB_ENV, '')!r}: {error}") from None


def label(path: str | os.PathLike) -> str:
    """`path` for messages, naming $FATUNE_DB when that is where the path came from."""
    configured = os.environ.get(DB_ENV)
    try:
        from_env = bool(configured) and Path(configured).expanduser() == Path(path)
    except RuntimeError:  # '~user' with no such user
        from_env = False
    return f"{path} (${DB_ENV})" if from_env else str(path)


# -- the key ---------------------------------------------------------------------------------

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


def shape_key(shape: Shape) -> CallKey:
    return call_key(shape.spec, shape.heads // shape.kv_heads, *shape.key_lengths(), max(shape.window, 0), 0)


def installation(gpu: str, capability: str) -> dict[str, str]:
    """The key columns that say where an entry was tuned: the GPU, and this installation's versions."""
    import torch
    import triton

    from fatune import codegen

    return dict(zip(INSTALLATION_COLUMNS, (gpu, capability, triton.__version__, torch.__version__.split("+")[0],
                                           codegen.template_hash())))


def key_columns(gpu: str, capability: str, key: CallKey) -> dict[str, Any]:
    """Every key column of an entry tuned here on `gpu` for `key`."""
    return {**installation(gpu, capability), **asdict(key)}


def is_stale(entry: Entry) -> list[str]:
    """Why `entry` cannot be used by this installation (another Triton version, or kernels these templates
    render differently from the ones it was measured with: its template_hash column holds the hash of
    those kernels, `launch.kernel_hash`); [] if it can."""
    import triton

    reasons = []
    if entry.triton_version != triton.__version__:
        reasons.append(f"Triton {entry.triton_version} (running {triton.__version__})")
    try:
        expected = entry.kernel_hash()
    except Exception as error:  # noqa: BLE001 - a config these templates cannot render is stale too
        expected = f"none ({type(error).__name__})"
    if entry.template_hash != expected:
        reasons.append(f"kernels that have changed since (kernel hash {entry.template_hash}, these templates "
                       f"render {expected})")
    return reasons


def bucket_distance(entry: Entry, key: CallKey) -> float:
    """How far an entry's buckets are from a call's, in octaves of Lq plus octaves of Lk."""
    return (abs(math.log2(entry.seqlen_q_bucket / key.seqlen_q_bucket))
            + abs(math.log2(entry.seqlen_k_bucket / key.seqlen_k_bucket)))


def is_decode(seqlen_q_bucket: int) -> bool:
    """Whether a key's L_q bucket is the decode regime's (at most DECODE_QUERIES queries per sequence): K/V
    streamed at memory speed by short query tiles, searched forward only."""
    return seqlen_q_bucket <= DECODE_QUERIES


def nearest(entries: Iterable[Entry], key: CallKey) -> tuple[Entry, str] | None:
    """The entry whose buckets are nearest `key`, and a reason saying how near. On a tie: an entry with a tuned
    backward, then the smaller problem (Lq x Lk buckets, then Lq; entries of other buckets timed other problems,
    so their times do not compare), then the faster. Only entries of the call's regime compete: a prefill
    entry's tiles (up to 128 query rows) would leave a decode call's tile nearly empty, and a decode entry's
    untuned backward would serve training calls."""
    decode = is_decode(key.seqlen_q_bucket)
    entries = [e for e in entries if is_decode(e.seqlen_q_bucket) == decode]
    best = min(entries, key=lambda e: (bucket_distance(e, key), e.forward_only, e.seqlen_q_bucket * e.seqlen_k_bucket,
                                       e.seqlen_q_bucket, e.time_ms), default=None)
    if best is None:
        return None
    if bucket_distance(best, key) == 0:
        return best, f"tuned entry, exact bucket Lq<={key.seqlen_q_bucket}, Lk<={key.seqlen_k_bucket}"
    return best, (f"tuned entry, nearest bucket Lq<={best.seqlen_q_bucket}, Lk<={best.seqlen_k_bucket} "
                  f"(call: Lq<={key.seqlen_q_bucket}, Lk<={key.seqlen_k_bucket})")


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


# -- entries ---------------------------------------------------------------------------------

# mask-variant parts whose sizes an entry does not store (a window's width, the kept keys, the documents, a mask's
# contents): two entries of such a variant may have timed different problems at the same batch, heads and lengths
_UNSTORED_SIZES = ("window", "seqlens-k", "varlen", "mask-")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


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
        wins (its studies started from the entry it replaces, fatune.search.warm_starts); a tie keeps `other`."""
        if self.sized and (self.batch, self.heads, self.seqlen_q, self.seqlen_k) == \
                (other.batch, other.heads, other.seqlen_q, other.seqlen_k):
            if self.forward_only or other.forward_only:
                return self.fwd_ms < other.fwd_ms
            return self.fwd_bwd_ms < other.fwd_bwd_ms
        return (self.created_at or _now()) > (other.created_at or _now())

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
            misplaced = misplaced_structure(kernel, _launch_config(name, data))
            if misplaced:
                raise InvalidEntry(f"{name}: {misplaced} do not apply to the {kernel} kernel")
        return self

    def forward_flops(self) -> int | None:
        """The FLOPs of the forward pass of the problem this entry timed: 2 per multiply-add of Q K^T and P V over
        the (query, key) pairs its mask keeps, as fatune.measure.Shape.flops counts them. None where the stored
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

    def kernel_hash(self) -> str:
        """The hash of the kernels this entry's configs launch with these templates (`launch.kernel_hash`)."""
        from fatune import launch

        return launch.kernel_hash(self.spec(), self.attention_config(), self.group_size > 1)

    def attention_config(self) -> AttentionConfig:
        """The three kernels' launch configs this entry stores."""
        return AttentionConfig(fwd=LaunchConfig.from_dict(self.fwd_config),
                               dkdv=LaunchConfig.from_dict(self.bwd_config["dkdv"]),
                               dq=LaunchConfig.from_dict(self.bwd_config["dq"]))

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


def _is_text(value: Any, pattern: str = r".+") -> bool:
    return isinstance(value, str) and re.fullmatch(pattern, value, re.DOTALL) is not None


_FIELD_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "gpu": (_is_text, "a GPU name"),
    "capability": (lambda v: _is_text(v, r"\d+\.\d+|cpu"), "'MAJOR.MINOR' such as '9.0', or 'cpu'"),
    "triton_version": (_is_text, "a Triton version"),
    "torch_version": (_is_text, "a torch version"),
    "template_hash": (_is_text, "a kernel hash"),
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
    "sdpa_backend": (lambda v: isinstance(v, str), "a string"),
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
        when = datetime.datetime.fromisoformat(value)
    except ValueError:
        return False
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return when <= datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=1)


def _launch_config(name: str, data: Any) -> LaunchConfig:
    """The LaunchConfig `data` holds (every field an int the kernels accept); InvalidEntry naming the field."""
    fields = [f.name for f in dataclasses.fields(LaunchConfig)]
    optional = sorted(set(STRUCTURE_FIELDS) | set(LATER_FIELDS))  # older entries lack them
    required = [field for field in fields if field not in optional]
    if not isinstance(data, dict) or not set(required) <= set(data) <= set(fields):
        raise InvalidEntry(f"{name}: expected an object with {required} (and optionally {optional}), "
                           f"got {data!r:.80}")
    for key in data:
        if type(data[key]) is not int:
            raise InvalidEntry(f"{name}.{key}: expected an int, got {data[key]!r:.80}")
    try:
        return LaunchConfig(**data)
    except ValueError as error:
        raise InvalidEntry(f"{name}.{error}") from None


_COLUMNS = {
    "gpu": str, "capability": str, "triton_version": str, "torch_version": str, "template_hash": str, "dtype": str,
    "head_dim": int, "head_dim_v": int, "mask_variant": str, "group_size": int, "seqlen_q_bucket": int,
    "seqlen_k_bucket": int, "fwd_config": str, "bwd_config": str, "fwd_ms": float, "bwd_ms": float,
    "fwd_bwd_ms": float, "tflops": float, "sdpa_backend": str, "sdpa_ms": float, "speedup": float, "batch": int,
    "heads": int, "seqlen_q": int, "seqlen_k": int, "trials": int, "interpreted": int, "created_at": str,
}
# version -> SQL that brings a file from the previous version to it
MIGRATIONS: dict[int, list[str]] = {}


# -- files -----------------------------------------------------------------------------------

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
# the files SQLite opens beside a database (a rollback journal, a WAL and its shared-memory index)
SIDE_FILES = ("-journal", "-wal", "-shm")


def _not_regular(path: Path, mode: int, side: str = "") -> DBError:
    kind = next((name for test, name in _KINDS if test(mode)), "a special file")
    if side:
        return DBError(f"{label(path)}: its SQLite side file {side} is {kind}, not a regular file")
    return DBError(f"{label(path)}: is {kind}, not a regular file (expected a tuned DB file)")


def _mode(name: str) -> int | None:
    """os.stat(name).st_mode (a symlink followed); None where nothing is there."""
    try:
        return os.stat(name).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None


def check_regular(path: Path) -> bool:
    """Whether a file is at `path`; DBError if it, or a side file SQLite would open beside it, is not a regular
    file. Checked before any open: SQLite (and open()) would block forever on a FIFO, and a directory, device or
    socket is no tuned DB. A symlink to a regular file is one."""
    try:
        mode = _mode(str(path))
    except (OSError, ValueError) as error:
        raise DBError(f"{label(path)}: cannot be read ({getattr(error, 'strerror', None) or error})") from None
    if mode is not None and not stat.S_ISREG(mode):
        raise _not_regular(path, mode)
    # beside the name and beside the file a symlink names (SQLite resolves symlinks)
    sides = dict.fromkeys(f"{base}{suffix}" for base in (path, os.path.realpath(path)) for suffix in SIDE_FILES)
    for side in sides:
        try:
            side_mode = _mode(side)
        except (OSError, ValueError):
            continue  # SQLite cannot open it either, and says so itself
        if side_mode is not None and not stat.S_ISREG(side_mode):
            raise _not_regular(path, side_mode, side)
    return mode is not None


def check_readable(path: Path) -> None:
    """DBError naming the reason if `path` cannot be read as a file (missing, not a regular file, no permission)."""
    if not check_regular(path):
        raise DBError(f"{label(path)}: no such file")
    try:  # non-blocking, and checked again once open: it may have been replaced since the stat
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            mode = os.fstat(descriptor).st_mode
        finally:
            os.close(descriptor)
    except FileNotFoundError:
        raise DBError(f"{label(path)}: no such file") from None
    except OSError as error:
        raise DBError(f"{label(path)}: cannot be read ({error.strerror or error})") from None
    if not stat.S_ISREG(mode):
        raise _not_regular(path, mode)


def check_writable(path: Path, *, create: bool = True) -> None:
    """DBError naming the reason if an SQLite file at `path` cannot be written (or created, with create).

    Checked before any work, so a write command fails at once: SQLite also needs to write
    its journal beside the file, so the folder must be writable too.
    """
    if check_regular(path):
        if not os.access(path, os.R_OK | os.W_OK):
            raise DBError(f"{label(path)}: is read-only (no write permission)")
        folder = path.parent
    elif not create:
        raise DBError(f"{label(path)}: no such file")
    else:
        folder = path.parent
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        if not folder.is_dir():
            raise DBError(f"{label(path)}: {folder} is not a directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise DBError(f"{label(path)}: folder {folder} is read-only (SQLite writes its journal there)")


def _connect_readonly(path: Path) -> sqlite3.Connection:
    """A read-only connection: mode=ro, else immutable=1 (a WAL file in a folder where its side
    files cannot be created, such as a read-only deployment image)."""
    check_readable(path)
    uri = path.resolve().as_uri()  # percent-encodes '?', '%' and '#' in the name
    for query in ("mode=ro", "immutable=1"):
        connection = sqlite3.connect(f"{uri}?{query}", uri=True, timeout=10, check_same_thread=False)
        try:
            connection.execute("select count(*) from sqlite_master").fetchone()
            return connection
        except sqlite3.OperationalError as error:
            connection.close()
            if query == "immutable=1" or "locked" in str(error):
                raise
    raise AssertionError("unreachable")


class TunedDB:
    """A tuned DB file (created on first write unless create=False). Safe for several processes to share."""

    def __init__(self, path: str | os.PathLike, *, readonly: bool = False, create: bool = True, wal: bool = True):
        self.path = Path(path)
        self.readonly = readonly
        self.label = label(self.path)
        try:
            if readonly:
                connection = _connect_readonly(self.path)
            else:
                check_writable(self.path, create=create)
                self.path.parent.mkdir(parents=True, exist_ok=True)
                connection = sqlite3.connect(str(self.path), timeout=30, check_same_thread=False)
                connection.isolation_level = None  # explicit transactions below
        except sqlite3.Error as error:
            raise DBError(f"{self.label}: not a usable SQLite database ({error})") from None
        except OSError as error:
            raise DBError(f"{self.label}: cannot be opened ({error.strerror or error})") from None
        self.db = sqlite_utils.Database(connection)
        try:
            self.db.execute("PRAGMA busy_timeout = 30000")
            if not readonly:
                self._check_write_lock()
            self._check_schema()
            if not readonly and wal:
                self.db.enable_wal()
        except sqlite3.DatabaseError as error:
            self.db.conn.close()
            raise DBError(f"{self.label}: not a usable SQLite database ({error})") from None
        except DBError:
            self.db.conn.close()
            raise

    # -- schema ------------------------------------------------------------------------------

    def _check_write_lock(self) -> None:
        """Write and roll back: fails at once on a file this process may only read."""
        try:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                self.db.execute("CREATE TABLE fatune_write_probe (x)")
            finally:
                self.db.execute("ROLLBACK")
        except sqlite3.OperationalError as error:
            if "readonly" in str(error):
                raise DBError(f"{self.label}: is read-only ({error})") from None
            raise

    def _check_schema(self) -> None:
        tables = set(self.db.table_names())
        if not tables:
            if self.readonly:
                raise DBError(f"{self.label}: empty file, not a fatune tuned DB")
            self._create()
            return
        if "meta" not in tables or TABLE not in tables:
            raise DBError(f"{self.label}: not a fatune tuned DB (tables {sorted(tables)}; expected meta and {TABLE})")
        row = self.db.execute("select value from meta where key = 'schema_version'").fetchone()
        try:
            version = int(row[0]) if row else 0
        except (TypeError, ValueError):
            raise DBError(f"{self.label}: not a fatune tuned DB (schema version {row[0]!r:.40})") from None
        if version > SCHEMA_VERSION:
            raise DBError(f"{self.label}: schema version {version} is newer than this fatune's {SCHEMA_VERSION}; "
                          f"upgrade fatune to read it")
        if version < SCHEMA_VERSION:
            if self.readonly or any(v not in MIGRATIONS for v in range(version + 1, SCHEMA_VERSION + 1)):
                raise DBError(f"{self.label}: schema version {version} cannot be migrated to {SCHEMA_VERSION}")
            with self.transaction():
                for target in range(version + 1, SCHEMA_VERSION + 1):
                    for statement in MIGRATIONS[target]:
                        self.db.execute(statement)
                self.db["meta"].upsert({"key": "schema_version", "value": str(SCHEMA_VERSION)}, pk="key")
        missing = [column for column in _COLUMNS if column not in self.db[TABLE].columns_dict]
        if missing:
            raise DBError(f"{self.label}: not a fatune tuned DB (table {TABLE} lacks columns {missing})")

    def _create(self) -> None:
        with self.transaction():
            self.db["meta"].create({"key": str, "value": str}, pk="key", if_not_exists=True)
            self.db["meta"].upsert({"key": "schema_version", "value": str(SCHEMA_VERSION)}, pk="key")
            self.db[TABLE].create({"id": int, **_COLUMNS}, pk="id", if_not_exists=True)
            self.db[TABLE].create_index(KEY_COLUMNS, unique=True, if_not_exists=True)

    # -- transactions ------------------------------------------------------------------------

    class _Transaction:
        def __init__(self, db: sqlite_utils.Database):
            self.db = db

        def __enter__(self):
            self.db.execute("BEGIN IMMEDIATE")  # take the write lock now: no lost updates
            return self

        def __exit__(self, kind, value, traceback):
            self.db.execute("ROLLBACK" if kind else "COMMIT")

    def transaction(self) -> TunedDB._Transaction:
        return TunedDB._Transaction(self.db)

    # -- rows --------------------------------------------------------------------------------

    def _where(self, values: dict[str, Any]) -> tuple[str, list[Any]]:
        if not values:
            return "1 = 1", []
        return " and ".join(f"[{column}] = ?" for column in values), list(values.values())

    def get(self, key: tuple) -> Entry | None:
        return next(self.entries(**dict(zip(KEY_COLUMNS, key))), None)

    def upsert(self, entry: Entry, *, keep_faster: bool = True) -> bool:
        """Write `entry` unless a current entry with the same key is to stay (Entry.supersedes: the faster of one
        problem, the newer of two); the kernel hash is not part of that key, invalid rows of it never win,
        stale ones lose to a current entry. True if written (it then replaces them all)."""
        if self.readonly:
            raise DBError(f"{self.label}: opened read-only")
        with self.transaction():
            return self.upsert_in_transaction(entry, keep_faster=keep_faster)

    def upsert_in_transaction(self, entry: Entry, *, keep_faster: bool = True) -> bool:
        """upsert() for a caller that holds the write transaction; InvalidEntry for an entry that is not valid."""
        entry.check()
        key = {column: value for column, value in zip(KEY_COLUMNS, entry.key()) if column != "template_hash"}
        where, args = self._where(key)
        rows = list(self.db[TABLE].rows_where(where, args))
        for row in rows:
            try:
                current = Entry.from_row(row)
            except InvalidEntry:
                continue  # an invalid row never wins
            # a stale row loses to a current entry; otherwise the faster stays
            if keep_faster and (not is_stale(current) or is_stale(entry)) and not entry.supersedes(current):
                return False
        for row in rows:
            self.db.execute(f"delete from {TABLE} where id = ?", [row["id"]])
        self.db[TABLE].insert(entry.to_row())
        return True

    def entries(self, on_invalid: Callable[[str], None] | None = None, **filters: Any) -> Iterator[Entry]:
        """The valid entries matching `filters`. An invalid row raises InvalidEntry, or with `on_invalid`
        is passed over and reported to it (a message naming the file, the row and the field)."""
        where, args = self._where({key: value for key, value in filters.items() if value is not None})
        try:
            rows = list(self.db[TABLE].rows_where(where, args, order_by="gpu, dtype, head_dim, mask_variant, "
                                                                        "seqlen_q_bucket"))
        except sqlite3.DatabaseError as error:
            raise DBError(f"{self.label}: cannot be read ({error})") from None
        for row in rows:
            try:
                yield Entry.from_row(row)
            except InvalidEntry as error:
                message = f"{self.label}: invalid entry (row {row.get('id')}): {error}"
                if on_invalid is None:
                    raise InvalidEntry(message) from None
                on_invalid(message)

    def match(self, gpu: str, capability: str, key: CallKey, report: Callable[[str], None]) -> tuple[Entry, str] | None:
        """The usable entry nearest `key` on this GPU, and why; invalid and stale rows are reported, skipped."""
        filters = {"gpu": gpu, "capability": capability, **asdict(key)}
        del filters["seqlen_q_bucket"], filters["seqlen_k_bucket"]
        usable = []
        for entry in self.entries(on_invalid=report, **filters):
            stale = is_stale(entry)
            if stale:  # one message per file and kind (a log line each), not per entry
                kinds = ["another Triton version" if reason.startswith("Triton") else "kernels that have changed since"
                         for reason in stale]
                report(f"{self.label}: entries tuned with {' and '.join(kinds)} are not used; `fatune db refresh` "
                       f"re-times them on this GPU, `fatune search` searches again (`fatune db list` shows them)")
                continue
            usable.append(entry)
        return nearest(usable, key)

    def delete(self, entries: Iterable[Entry]) -> int:
        with self.transaction():
            return self.delete_in_transaction(entries)

    def delete_in_transaction(self, entries: Iterable[Entry], exact: bool = False) -> int:
        """delete() for a caller that holds the write transaction: the rows of these entries' keys (`exact`: only
        the rows written when these entries were, not a newer row of the same key and kernels)."""
        count = 0
        for entry in entries:
            where, args = self._where(dict(zip(KEY_COLUMNS, entry.key())))
            if exact:  # a row read with no creation time (NULL) reads back as ""
                where += " and ([created_at] = ? or ([created_at] is null and ? = ''))"
                args += [entry.created_at, entry.created_at]
            count += self.db.execute(f"delete from {TABLE} where {where}", args).rowcount
        return count

    def current(self, key: tuple) -> list[Entry]:
        """The valid entries that are not stale under `key` (KEY_COLUMNS' values; the kernel hash not compared)."""
        filters = {column: value for column, value in zip(KEY_COLUMNS, key) if column != "template_hash"}
        return [entry for entry in self.entries(on_invalid=lambda message: None, **filters) if not is_stale(entry)]

    def count(self) -> int:
        return self.db[TABLE].count

    def close(self) -> None:
        self.db.conn.close()

    def __enter__(self) -> TunedDB:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- export and import -----------------------------------------------------------------------

def export_entries(entries: Iterable[Entry], path: str | os.PathLike) -> int:
    """Write entries to a new file: JSON when the name ends in .json, else a tuned DB (SQLite) in
    rollback-journal mode, readable from a read-only folder. Nothing is left behind on failure."""
    entries = [entry.check() for entry in entries]
    path = Path(path)
    if path.exists():
        raise DBError(f"{path}: exists already; export writes a new file")
    if not path.parent.is_dir():
        raise DBError(f"{path}: folder {path.parent} does not exist")
    check_writable(path)
    try:
        if path.suffix == ".json":
            payload = {"fatune_tuned_db": SCHEMA_VERSION, "entries": [asdict(entry) for entry in entries]}
            path.write_text(json.dumps(payload, indent=1, sort_keys=True))
            return len(entries)
        with TunedDB(path, wal=False) as out, out.transaction():
            for entry in entries:
                out.upsert_in_transaction(entry)
        return len(entries)
    except BaseException as error:
        path.unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise DBError(f"{path}: cannot be written ({error.strerror or error})") from None
        raise


def read_entries(path: str | os.PathLike) -> list[Entry]:
    """Every entry of a tuned DB or of its JSON export, each checked; DBError naming the file, the
    entry and the field for anything else (one invalid entry refuses the whole file)."""
    path = Path(path)
    check_readable(path)
    if path.suffix != ".json":
        with TunedDB(path, readonly=True) as source:
            return list(source.entries())
    try:
        payload = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as error:
        raise DBError(f"{path}: not a fatune tuned-DB export ({type(error).__name__}: {error})") from None
    except OSError as error:
        raise DBError(f"{path}: cannot be read ({error.strerror or error})") from None
    if not isinstance(payload, dict) or set(payload) != {"fatune_tuned_db", "entries"}:
        raise DBError(f"{path}: not a fatune tuned-DB export (expected an object with fatune_tuned_db and entries)")
    version, rows = payload["fatune_tuned_db"], payload["entries"]
    if type(version) is not int or version != SCHEMA_VERSION:
        raise DBError(f"{path}: export schema version {version!r:.40}; this fatune reads {SCHEMA_VERSION}")
    if not isinstance(rows, list):
        raise DBError(f"{path}: entries: expected a list, got {type(rows).__name__}")
    entries = []
    for index, row in enumerate(rows):
        try:
            entries.append(Entry.from_json(row))
        except InvalidEntry as error:
            raise InvalidEntry(f"{path}: entry {index}: {error}") from None
    return entries


def import_entries(db: TunedDB, path: str | os.PathLike, *, force: bool = False) -> tuple[int, int]:
    """Merge `path` into `db`, keeping the faster entry per key; (written, kept) counts.

    The whole file is read and checked first: an unreadable, foreign or invalid file, or a
    stale one (another Triton version or changed kernels, unless force), raises DBError and
    `db` is left untouched.
    """
    entries = read_entries(path)
    if not force:
        stale = [(entry, reasons) for entry in entries if (reasons := is_stale(entry))]
        if stale:
            entry, reasons = stale[0]
            raise DBError(f"{path}: {len(stale)} of {len(entries)} entries were tuned for another installation "
                          f"(e.g. {entry.describe()}: {'; '.join(reasons)}); pass force=True (--force) to import "
                          f"them anyway")
    written = 0
    with db.transaction():
        for entry in entries:
            written += db.upsert_in_transaction(entry)
    return written, len(entries) - written
