"""The tuned DB file: a SQLite file of entries (fatune.db.entry) written with sqlite-utils.

One row per key (KEY_COLUMNS but the kernel hashes); an upsert keeps
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
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sqlite3
import stat
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import sqlite_utils

from fatune.db.entry import _COLUMNS, DBError, Entry, InvalidEntry, is_stale
from fatune.db.keys import KEY_COLUMNS, CallKey, is_decode
from fatune.settings import DB_ENV, user_path

SCHEMA_VERSION = 1
TABLE = "entries"


def default_path() -> Path:
    """The user's tuned DB: $FATUNE_DB, else ~/.cache/fatune/tuned.sqlite."""

    try:
        return user_path(DB_ENV, "tuned.sqlite")
    except RuntimeError as error:  # Path.expanduser: no home directory for '~user'
        raise DBError(str(error)) from None


def label(path: str | os.PathLike) -> str:
    """`path` for messages, naming $FATUNE_DB when that is where the path came from."""
    configured = os.environ.get(DB_ENV)
    try:
        from_env = bool(configured) and Path(configured).expanduser() == Path(path)
    except RuntimeError:  # '~user' with no such user
        from_env = False
    return f"{path} (${DB_ENV})" if from_env else str(path)


# -- the key ---------------------------------------------------------------------------------


# -- entries ---------------------------------------------------------------------------------


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
                self._enable_wal()
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

    def _enable_wal(self, timeout_s: float = 30.0) -> None:
        """Switch to WAL journaling. SQLite answers 'database is locked' at once, without its busy handler,
        while another connection of a file still in rollback mode reads it (processes opening a fresh file
        together), so the switch is retried here for as long as the busy timeout would wait."""
        deadline = time.monotonic() + timeout_s
        delay = 0.001
        while True:
            try:
                self.db.enable_wal()
                return
            except sqlite3.OperationalError as error:
                if "locked" not in str(error) or time.monotonic() > deadline:
                    raise
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

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
        missing = [column for column in ("id", *_COLUMNS) if column not in self.db[TABLE].columns_dict]
        if missing:
            raise DBError(f"{self.label}: not a fatune tuned DB (table {TABLE} lacks columns {missing})")
        triggers = [row[0] for row in self.db.execute("select name from sqlite_master where type = 'trigger'")]
        if triggers:  # fatune makes none; one could refuse or rewrite what fatune writes
            raise DBError(f"{self.label}: not a fatune tuned DB (it has triggers: {triggers[:3]})")
        if not self.readonly:
            problems = [row[0] for row in self.db.execute("PRAGMA quick_check(3)")]
            if problems != ["ok"]:  # caught here, not by the write at the end of a search
                raise DBError(f"{self.label}: damaged SQLite file ({'; '.join(problems)[:200]})")

    def _create(self) -> None:
        with self.transaction():
            self.db["meta"].create({"key": str, "value": str}, pk="key", if_not_exists=True)
            self.db["meta"].upsert({"key": "schema_version", "value": str(SCHEMA_VERSION)}, pk="key")
            self.db[TABLE].create({"id": int, **_COLUMNS}, pk="id", if_not_exists=True)
            self.db[TABLE].create_index(KEY_COLUMNS, unique=True, if_not_exists=True)

    # -- transactions ------------------------------------------------------------------------

    class _Transaction:
        """BEGIN IMMEDIATE (the write lock now: no lost updates) .. COMMIT, or ROLLBACK on an error; an error of
        SQLite's (a damaged or foreign file, a full disk) leaves as a DBError naming the file."""

        def __init__(self, db: sqlite_utils.Database, label: str):
            self.db = db
            self.label = label

        def __enter__(self):
            try:
                self.db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as error:
                raise DBError(f"{self.label}: cannot be written ({error})") from None
            return self

        def __exit__(self, kind, value, traceback):
            try:
                self.db.execute("ROLLBACK" if kind else "COMMIT")
            except sqlite3.Error as error:
                if kind is None:  # the COMMIT failed: roll back, or the write lock stays held
                    with contextlib.suppress(sqlite3.Error):
                        self.db.execute("ROLLBACK")
                    raise DBError(f"{self.label}: cannot be written ({error})") from None
            if kind is not None and issubclass(kind, sqlite3.Error):
                raise DBError(f"{self.label}: cannot be written ({value})") from None
            return False

    def transaction(self) -> TunedDB._Transaction:
        return TunedDB._Transaction(self.db, self.label)

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
            # a stale entry never replaces a current one (the dispatcher would not run it); a stale row loses to a
            # current entry; otherwise the faster stays
            if is_stale(entry) and not is_stale(current):
                return False
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
        """The usable entry nearest `key` on this GPU, and why; invalid rows, rows of another Triton version and
        rows whose kernels have changed since they were measured are reported, skipped (the next nearest, or the
        next layer, answers). Only the nearest candidates are rendered to tell the last (cached per config; a
        launch checks the sources it runs too, Entry.sources)."""
        filters = {"gpu": gpu, "capability": capability, **asdict(key)}
        del filters["seqlen_q_bucket"], filters["seqlen_k_bucket"]
        usable = []
        for entry in self.entries(on_invalid=report, **filters):
            if is_stale(entry, render=False):  # one message per file, not per entry
                report(f"{self.label}: entries tuned with another Triton version are not used; `fatune db refresh` "
                       f"re-times them on this GPU, `fatune search` searches again (`fatune db list` shows them)")
                continue
            usable.append(entry)
        changed, rendered, found, more = 0, set(), None, ""
        for entry in ranked(usable, key):
            configs = (entry.attention_config(), entry.group_size > 1)  # what its kernels are rendered from
            if configs not in rendered and len(rendered) == MAX_RENDERED:
                more = " or more"
                break
            rendered.add(configs)
            if not is_stale(entry):
                found = entry, _nearness(entry, key)
                break
            changed += 1
        if changed:
            report(f"{self.label}: {changed}{more} entries measured with kernels that have changed since are not "
                   f"used; `fatune db refresh` re-times them on this GPU (`fatune db list` shows them)")
        return found

    def invalid_rows(self, **filters: Any) -> list[int]:
        """The ids of the rows matching `filters` that hold no valid entry (no fatune can use them)."""
        where, args = self._where({key: value for key, value in filters.items() if value is not None})
        invalid = []
        for row in self.db[TABLE].rows_where(where, args):
            try:
                Entry.from_row(row)
            except InvalidEntry:
                invalid.append(row["id"])
        return invalid

    def delete_rows(self, ids: list[int]) -> int:
        """Delete the rows of these ids."""
        with self.transaction():
            return sum(self.db.execute(f"delete from {TABLE} where id = ?", [row]).rowcount for row in ids)

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
        with TunedDB(path, wal=False) as out:
            with out.transaction():
                for entry in entries:
                    out.upsert_in_transaction(entry)
            return out.count()  # rows of one key merge as an upsert merges them
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
    """Merge `path` into `db` as a search's upsert does (per key the faster entry of one problem, the newer of
    different problems, a current one over a stale one); (written, kept) counts.

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


def bucket_distance(entry: Entry, key: CallKey) -> float:
    """How far an entry's buckets are from a call's, in octaves of Lq plus octaves of Lk."""
    return (abs(math.log2(entry.seqlen_q_bucket / key.seqlen_q_bucket))
            + abs(math.log2(entry.seqlen_k_bucket / key.seqlen_k_bucket)))


# the configs of a key's entries whose kernels the dispatcher renders, nearest first, to tell whether they have
# changed (after a template change a whole DB's have): a DB holding many configs of one key costs no more than this
MAX_RENDERED = 16


def ranked(entries: Iterable[Entry], key: CallKey) -> list[Entry]:
    """The entries of the call's regime, nearest `key` first. On a tie: an entry with a tuned backward, then one
    that routes to a torch SDPA backend (measured faster than fatune's kernels at its lengths: a call between two
    lengths that disagree runs as fast as SDPA where the route can be taken), then the smaller problem (Lq x Lk
    buckets, then Lq; entries of other buckets timed other problems, so their times do not compare), then the
    faster. Only entries of the call's regime compete: a prefill entry's tiles (up to 128 query rows) would leave a
    decode call's tile nearly empty, and a decode entry's untuned backward would serve training calls."""
    decode = is_decode(key.seqlen_q_bucket)
    return sorted((e for e in entries if is_decode(e.seqlen_q_bucket) == decode),
                  key=lambda e: (bucket_distance(e, key), e.forward_only, not e.route(),
                                 e.seqlen_q_bucket * e.seqlen_k_bucket, e.seqlen_q_bucket, e.time_ms))


def nearest(entries: Iterable[Entry], key: CallKey) -> tuple[Entry, str] | None:
    """The entry nearest `key` (ranked) and a reason saying how near."""
    best = next(iter(ranked(entries, key)), None)
    return None if best is None else (best, _nearness(best, key))


def _nearness(entry: Entry, key: CallKey) -> str:
    if bucket_distance(entry, key) == 0:
        return f"tuned entry, exact bucket Lq<={key.seqlen_q_bucket}, Lk<={key.seqlen_k_bucket}"
    return (f"tuned entry, nearest bucket Lq<={entry.seqlen_q_bucket}, Lk<={entry.seqlen_k_bucket} "
            f"(call: Lq<={key.seqlen_q_bucket}, Lk<={key.seqlen_k_bucket})")


def shipped_dbs() -> list[Path]:
    """The tuned DBs installed with the package (fatune/tuned_db, or tuned_db/ in a checkout)."""
    package = Path(__file__).resolve().parent.parent
    for folder in (package / "tuned_db", package.parent / "tuned_db"):
        if folder.is_dir():
            return sorted(folder.glob("*.sqlite"))
    return []
