"""The Optuna storage of a search: where its studies live, created safely by many processes at
once, and how the trials of a dead process are found and retried.

Studies live in an SQLAlchemy database: an SQLite file beside the tuned DB by default, or a
server that several hosts reach, e.g. PostgreSQL (`postgresql://user@host/db`, through
psycopg 3). Optuna creates its tables, studies and queued trials on first use, and that races
between processes: an SQLite storage is serialised by a file lock beside it, a PostgreSQL one
by an advisory lock on the server. A process records a heartbeat every HEARTBEAT_S for each
trial it holds; a running trial without one for GRACE_S belongs to a dead process: it is
marked failed and its parameters are queued once more (Optuna's retry callback).
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from pathlib import Path
from typing import Iterator

import optuna

from fatune.db import DBError, check_writable

HEARTBEAT_S, GRACE_S = 5, 30  # a RUNNING trial without a heartbeat for GRACE_S is marked failed
MAX_RETRY = 1  # a config whose trial died twice (it may be what kills its worker) is not queued again
LOCK_KEY = 0x666174756E65  # PostgreSQL advisory lock id of fatune's study creation ("fatune")
DRIVERS = {"postgresql": "postgresql+psycopg"}  # a URL without a driver gets psycopg 3


def normalise_url(url: str) -> str:
    """`url` with psycopg 3 as the driver of a PostgreSQL URL that names none (SQLAlchemy's default
    is psycopg2, which fatune does not install)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        return url
    driver = DRIVERS.get(parsed.drivername)
    return parsed.set(drivername=driver).render_as_string(hide_password=False) if driver else url


def default_storage_url(db_path: Path) -> str:
    """The SQLite Optuna storage beside a tuned DB, as a URL that keeps any '?', '%' or '#' in the name."""
    from sqlalchemy.engine import URL

    path = Path(os.path.abspath(db_path)).with_suffix(".optuna.sqlite")
    return URL.create("sqlite", database=str(path)).render_as_string(hide_password=False)


def _storage_file(url: str) -> Path | None:
    """The file an SQLite storage URL names; None for other databases and in-memory SQLite."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    database = parsed.database or ""
    if parsed.get_backend_name() != "sqlite" or database in ("", ":memory:") or database.startswith("file:"):
        return None
    return Path(database)


@contextlib.contextmanager
def _advisory_lock(url: str) -> Iterator[None]:
    """PostgreSQL's session-level advisory lock LOCK_KEY; the server drops it if this process dies."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
    try:
        with engine.connect() as connection:
            connection.execute(sqlalchemy.text("SELECT pg_advisory_lock(:key)"), {"key": LOCK_KEY})
            try:
                yield
            finally:
                connection.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:key)"), {"key": LOCK_KEY})
    finally:
        engine.dispose()


def storage_lock(url: str) -> contextlib.AbstractContextManager:
    """Held while creating tables, studies or queued trials: a file lock beside an SQLite storage, an
    advisory lock on a PostgreSQL server, none for other databases."""
    from filelock import FileLock
    from sqlalchemy.engine import make_url

    path = _storage_file(url)
    if path is not None:
        return FileLock(f"{path}.lock", timeout=300)
    if make_url(url).get_backend_name() == "postgresql":
        return _advisory_lock(url)
    return contextlib.nullcontext()


def check_storage(url: str) -> Path | None:
    """ValueError naming what is wrong with an Optuna storage URL or its location, checked without
    creating anything; the SQLite file it names (None for other databases)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        make_url(url).get_dialect()
        path = _storage_file(url)
    except (ArgumentError, ImportError):
        raise ValueError(f"expected an SQLAlchemy URL such as sqlite:///studies.sqlite or postgresql://user@host/db "
                         f"with its driver installed (PostgreSQL: pip install 'fatune[distributed]'), "
                         f"got {url!r}") from None
    if path is not None:
        if not path.parent.is_dir():
            raise ValueError(f"{url}: folder {path.parent} does not exist")
        try:
            check_writable(path)
        except DBError as error:
            raise ValueError(f"{url}: {error}") from None
    return path


def _retry_callback_kwargs() -> dict:
    """RDBStorage's argument that queues a dead trial's parameters again (renamed in Optuna 4.9)."""
    if hasattr(optuna.storages, "RetryHeartbeatStaleTrialCallback"):
        return {"heartbeat_stale_trial_callback": optuna.storages.RetryHeartbeatStaleTrialCallback(MAX_RETRY)}
    return {"failed_trial_callback": optuna.storages.RetryFailedTrialCallback(MAX_RETRY)}


def _write_ahead(engine) -> None:
    """An SQLite storage in WAL mode (kept in the file; set under the storage lock) and its connections
    with synchronous=NORMAL: a commit appends to the log without waiting for the disk (an Optuna trial
    commits ~20 times), readers do not block the writer, and a process that dies loses nothing (only a
    power cut may lose the last commits)."""
    import sqlalchemy

    def on_connect(connection, record) -> None:
        cursor = connection.cursor()
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    sqlalchemy.event.listen(engine, "connect", on_connect)
    engine.dispose()  # connections opened before the listener: opened again with it
    with engine.connect() as connection:
        connection.exec_driver_sql("PRAGMA journal_mode=WAL")


def _check_tables(engine) -> None:
    """ValueError where a table of Optuna's names lacks Optuna's columns (a foreign database: it would fail
    mid-search). RDBStorage has created the tables that were missing."""
    import sqlalchemy

    try:
        from optuna.storages._rdb.models import BaseModel
    except ImportError:  # another Optuna layout: RDBStorage's own checks only
        return
    inspector = sqlalchemy.inspect(engine)
    for table in BaseModel.metadata.sorted_tables:
        columns = {column["name"] for column in inspector.get_columns(table.name)}
        missing = sorted(column.name for column in table.columns if column.name not in columns)
        if missing:
            raise ValueError(f"table {table.name} lacks Optuna's columns {missing}: not an Optuna storage")


def open_storage(url: str) -> optuna.storages.RDBStorage:
    """The Optuna storage at `url` (created if new, safely when several searches start at once);
    ValueError naming what is wrong with the URL, its location or the server."""
    url = normalise_url(url)
    path = check_storage(url)
    engine_kwargs = {"connect_args": {"timeout": 60}} if path else {"pool_pre_ping": True}
    try:
        with storage_lock(url), warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            warnings.simplefilter("ignore", FutureWarning)
            storage = optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs, heartbeat_interval=HEARTBEAT_S,
                                                 grace_period=GRACE_S, **_retry_callback_kwargs())
            if path is not None:
                _write_ahead(storage.engine)
            _check_tables(storage.engine)
            return storage
    except Exception as error:  # noqa: BLE001 - unreachable servers, foreign databases
        raise ValueError(f"{url}: cannot open Optuna storage ({type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''})") from None


class Heartbeat:
    """A thread recording a heartbeat every HEARTBEAT_S for each trial this process holds (asked and
    not yet told), so that other processes can tell them from the trials of a dead one."""

    def __init__(self, storage: optuna.storages.RDBStorage):
        self.storage = storage
        self._held: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="fatune-heartbeat", daemon=True)

    def hold(self, trial: optuna.Trial) -> None:
        self.storage.record_heartbeat(trial._trial_id)  # at once: a trial without a heartbeat is never stale
        with self._lock:
            self._held.add(trial._trial_id)

    def release(self, trial: optuna.Trial) -> None:
        with self._lock:
            self._held.discard(trial._trial_id)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with self._lock:
                held = list(self._held)
            for trial_id in held:
                with contextlib.suppress(Exception):  # a lost connection: the next beat tries again
                    self.storage.record_heartbeat(trial_id)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

