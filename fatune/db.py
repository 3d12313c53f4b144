"""The tuned database: winning launch configs per GPU, versions, kernel spec and shape bucket.

A SQLite file written with sqlite-utils. One row per key (see KEY_COLUMNS); an upsert keeps
the faster entry. WAL journaling and a busy timeout let several searching processes write
one file without losing rows; every write runs in an IMMEDIATE transaction. The schema
version lives in the `meta` table: older files are migrated, newer or foreign ones refused.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sqlite3
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import sqlite_utils

from fatune.spec import AttentionConfig, LaunchConfig

SCHEMA_VERSION = 1
TABLE = "entries"
DB_ENV = "FATUNE_DB"
KEY_COLUMNS = (
    "gpu", "capability", "triton_version", "torch_version", "template_hash", "dtype", "head_dim", "head_dim_v",
    "mask_variant", "group_size", "seqlen_q_bucket", "seqlen_k_bucket",
)


class DBError(Exception):
    """A tuned DB file that fatune cannot use (foreign, corrupt or from a newer fatune)."""


def seqlen_bucket(seqlen: int) -> int:
    """Log-scale bucket of a sequence length: the next power of two, at least 16."""
    return max(16, 1 << max(0, int(seqlen) - 1).bit_length())


def default_path() -> Path:
    """The user's tuned DB: $FATUNE_DB, else ~/.cache/fatune/tuned.sqlite."""
    from fatune.codegen import user_path

    return user_path(DB_ENV, "tuned.sqlite")


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
    bwd_ms: float = math.nan
    fwd_bwd_ms: float = math.nan
    tflops: float = math.nan
    sdpa_backend: str = ""
    sdpa_ms: float = math.nan
    speedup: float = math.nan  # SDPA fwd+bwd ms / fatune fwd+bwd ms
    batch: int = 0
    heads: int = 0
    seqlen_q: int = 0
    seqlen_k: int = 0
    trials: int = 0
    interpreted: bool = False  # timed in the Triton interpreter: not meaningful
    created_at: str = ""

    def key(self) -> tuple:
        return tuple(getattr(self, column) for column in KEY_COLUMNS)

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
        row["created_at"] = self.created_at or datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        return row

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Entry:
        data = dict(row)
        data.pop("id", None)
        data["fwd_config"] = json.loads(data["fwd_config"] or "{}")
        data["bwd_config"] = json.loads(data["bwd_config"] or "{}")
        data["interpreted"] = bool(data["interpreted"])
        for column, kind in _COLUMNS.items():
            if kind is float and data.get(column) is None:
                data[column] = math.nan  # SQLite stores NaN as NULL
        return cls(**{key: value for key, value in data.items() if key in cls.__dataclass_fields__})


_COLUMNS = {
    "gpu": str, "capability": str, "triton_version": str, "torch_version": str, "template_hash": str, "dtype": str,
    "head_dim": int, "head_dim_v": int, "mask_variant": str, "group_size": int, "seqlen_q_bucket": int,
    "seqlen_k_bucket": int, "fwd_config": str, "bwd_config": str, "fwd_ms": float, "bwd_ms": float,
    "fwd_bwd_ms": float, "tflops": float, "sdpa_backend": str, "sdpa_ms": float, "speedup": float, "batch": int,
    "heads": int, "seqlen_q": int, "seqlen_k": int, "trials": int, "interpreted": int, "created_at": str,
}
# version -> SQL that brings a file from the previous version to it
MIGRATIONS: dict[int, list[str]] = {}


class TunedDB:
    """A tuned DB file (created on first write). Safe for several processes to share."""

    def __init__(self, path: str | os.PathLike, *, readonly: bool = False):
        self.path = Path(path)
        self.readonly = readonly
        if readonly:
            if not self.path.exists():
                raise DBError(f"{self.path}: no such tuned DB")
            uri = f"file:{self.path}?mode=ro"
            self.db = sqlite_utils.Database(sqlite3.connect(uri, uri=True, timeout=30, check_same_thread=False))
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite_utils.Database(sqlite3.connect(str(self.path), timeout=30, check_same_thread=False))
            self.db.conn.isolation_level = None  # explicit transactions below
        try:
            self.db.execute("PRAGMA busy_timeout = 30000")
            self._check_schema()
            if not readonly:
                self.db.enable_wal()
        except sqlite3.DatabaseError as error:
            self.db.conn.close()
            raise DBError(f"{self.path}: not a usable SQLite database ({error})") from None
        except DBError:
            self.db.conn.close()
            raise

    # -- schema ------------------------------------------------------------------------------

    def _check_schema(self) -> None:
        tables = set(self.db.table_names())
        if not tables:
            if self.readonly:
                raise DBError(f"{self.path}: empty file, not a fatune tuned DB")
            self._create()
            return
        if "meta" not in tables or TABLE not in tables:
            raise DBError(f"{self.path}: not a fatune tuned DB (tables {sorted(tables)}; expected meta and {TABLE})")
        row = self.db.execute("select value from meta where key = 'schema_version'").fetchone()
        version = int(row[0]) if row else 0
        if version > SCHEMA_VERSION:
            raise DBError(f"{self.path}: schema version {version} is newer than this fatune's {SCHEMA_VERSION}; "
                          f"upgrade fatune to read it")
        if version < SCHEMA_VERSION:
            if self.readonly or any(v not in MIGRATIONS for v in range(version + 1, SCHEMA_VERSION + 1)):
                raise DBError(f"{self.path}: schema version {version} cannot be migrated to {SCHEMA_VERSION}")
            with self.transaction():
                for target in range(version + 1, SCHEMA_VERSION + 1):
                    for statement in MIGRATIONS[target]:
                        self.db.execute(statement)
                self.db["meta"].upsert({"key": "schema_version", "value": str(SCHEMA_VERSION)}, pk="key")

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
        where, args = self._where(dict(zip(KEY_COLUMNS, key)))
        rows = list(self.db[TABLE].rows_where(where, args))
        return Entry.from_row(rows[0]) if rows else None

    def upsert(self, entry: Entry, *, keep_faster: bool = True) -> bool:
        """Write `entry` unless an entry with the same key is faster; True if written."""
        if self.readonly:
            raise DBError(f"{self.path}: opened read-only")
        with self.transaction():
            return self.upsert_in_transaction(entry, keep_faster=keep_faster)

    def upsert_in_transaction(self, entry: Entry, *, keep_faster: bool = True) -> bool:
        """upsert() for a caller that holds the write transaction."""
        where, args = self._where(dict(zip(KEY_COLUMNS, entry.key())))
        current = self.db.execute(f"select id, fwd_bwd_ms from {TABLE} where {where}", args).fetchone()
        if current is not None:
            if keep_faster and current[1] is not None and current[1] <= entry.fwd_bwd_ms:
                return False
            self.db.execute(f"delete from {TABLE} where id = ?", [current[0]])
        self.db[TABLE].insert(entry.to_row())
        return True

    def entries(self, **filters: Any) -> Iterator[Entry]:
        where, args = self._where({key: value for key, value in filters.items() if value is not None})
        for row in self.db[TABLE].rows_where(where, args, order_by="gpu, dtype, head_dim, mask_variant, seqlen_q_bucket"):
            yield Entry.from_row(row)

    def delete(self, entries: Iterable[Entry]) -> int:
        count = 0
        with self.transaction():
            for entry in entries:
                where, args = self._where(dict(zip(KEY_COLUMNS, entry.key())))
                count += self.db.execute(f"delete from {TABLE} where {where}", args).rowcount
        return count

    def count(self) -> int:
        return self.db[TABLE].count

    def close(self) -> None:
        self.db.conn.close()

    def __enter__(self) -> TunedDB:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def is_stale(entry: Entry) -> list[str]:
    """Why `entry` cannot be used by this installation (other Triton version or templates); [] if it can."""
    import triton

    from fatune import codegen

    reasons = []
    if entry.triton_version != triton.__version__:
        reasons.append(f"Triton {entry.triton_version} != {triton.__version__}")
    if entry.template_hash != codegen.template_hash():
        reasons.append(f"template hash {entry.template_hash} != {codegen.template_hash()}")
    return reasons


def export_entries(entries: Iterable[Entry], path: str | os.PathLike) -> int:
    """Write entries to a new file: JSON when the name ends in .json, else a tuned DB (SQLite)."""
    entries = list(entries)
    path = Path(path)
    if path.exists():
        raise DBError(f"{path}: exists already; export writes a new file")
    if path.suffix == ".json":
        payload = {"fatune_tuned_db": SCHEMA_VERSION, "entries": [asdict(entry) for entry in entries]}
        path.write_text(json.dumps(payload, indent=1, sort_keys=True))
        return len(entries)
    with TunedDB(path) as out:
        for entry in entries:
            out.upsert(entry)
    return len(entries)


def read_entries(path: str | os.PathLike) -> list[Entry]:
    """Every entry of a tuned DB or of its JSON export; DBError for anything else."""
    path = Path(path)
    if not path.exists():
        raise DBError(f"{path}: no such file")
    if path.suffix == ".json":
        try:
            payload = json.loads(path.read_text())
            version = payload["fatune_tuned_db"]
            rows = payload["entries"]
        except (ValueError, KeyError, TypeError) as error:
            raise DBError(f"{path}: not a fatune tuned-DB export ({type(error).__name__}: {error})") from None
        if version != SCHEMA_VERSION:
            raise DBError(f"{path}: export schema version {version}; this fatune reads {SCHEMA_VERSION}")
        try:
            return [Entry(**row) for row in rows]
        except TypeError as error:
            raise DBError(f"{path}: malformed entry ({error})") from None
    with TunedDB(path, readonly=True) as source:
        return list(source.entries())


def import_entries(db: TunedDB, path: str | os.PathLike, *, force: bool = False) -> tuple[int, int]:
    """Merge `path` into `db`, keeping the faster entry per key; (written, kept) counts.

    The whole file is read and checked first: an unreadable, foreign or stale file (another
    Triton version or template hash, unless force) raises DBError and `db` is left untouched.
    """
    entries = read_entries(path)
    if not force:
        stale = [(entry, reasons) for entry in entries if (reasons := is_stale(entry))]
        if stale:
            entry, reasons = stale[0]
            raise DBError(f"{path}: {len(stale)} of {len(entries)} entries were tuned for another installation "
                          f"(e.g. {entry.gpu} {entry.dtype} d{entry.head_dim} {entry.mask_variant}: "
                          f"{'; '.join(reasons)}); pass force=True (--force) to import them anyway")
    written = 0
    with db.transaction():
        for entry in entries:
            written += db.upsert_in_transaction(entry)
    return written, len(entries) - written
