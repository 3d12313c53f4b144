"""The tuned DB: keep-the-faster upserts, schema checks, export/import round trips, concurrent writers,
entry validation, the key, read-only opening and writability checks."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import multiprocessing
import os
import re
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import sqlite_utils
import torch
import triton
from click.testing import CliRunner

from fatune.db import (
    MAX_FLOPS_PER_S,
    MIN_TIME_MS,
    SCHEMA_VERSION,
    CallKey,
    DBError,
    Entry,
    InvalidEntry,
    TunedDB,
    export_entries,
    import_entries,
    is_stale,
    read_entries,
    seqlen_bucket,
)
from fatune.cli import cli
from fatune.kernel.codegen import Templates
from fatune.kernel.spec import DTYPES, KernelSpec
from fatune.kernel.triton import codegen, resolve
from tests.conftest import run_together

ASSETS = Path(__file__).parent / "assets"


def make_entry(**changes) -> Entry:
    """A valid, current entry (its template_hash the hash of the kernels its configs render to), with
    `changes`; an entry the changes make invalid keeps a placeholder hash."""
    entry = Entry(gpu="NVIDIA H200", capability="9.0", triton_version=triton.__version__, torch_version="2.11.0",
                  template_hash="0123456789abcdef", dtype="bfloat16", head_dim=64, head_dim_v=64,
                  mask_variant="causal", group_size=1, seqlen_q_bucket=4096, seqlen_k_bucket=4096,
                  fwd_config={"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3},
                  bwd_config={"dkdv": {"block_m": 32, "block_n": 128, "num_warps": 4, "num_stages": 3},
                              "dq": {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3}},
                  fwd_ms=1.0, bwd_ms=2.0, fwd_bwd_ms=3.0, tflops=400.0, trials=30)
    entry = replace(entry, **changes)
    if "template_hash" not in changes:
        with contextlib.suppress(Exception):
            entry = replace(entry, template_hash=entry.check().kernel_hashes())
    return entry


@pytest.fixture(params=["flat", "nested"])
def db_path(request, tmp_path) -> Path:
    """Contract tests run against a file at the top of a folder and one in folders created on demand."""
    return tmp_path / "tuned.sqlite" if request.param == "flat" else tmp_path / "a" / "b" / "tuned.sqlite"


OLD, NEW = "2026-11-01T00:00:00+00:00", "2026-11-30T00:00:00+00:00"


@pytest.mark.parametrize("mine, theirs, replaces", [
    # the same problem: the faster stays, whenever either was searched
    ({"fwd_bwd_ms": 2.0, "created_at": OLD}, {"fwd_bwd_ms": 3.0, "created_at": NEW}, True),
    ({"fwd_bwd_ms": 3.0, "created_at": NEW}, {"fwd_bwd_ms": 2.0, "created_at": OLD}, False),
    ({"bwd_ms": math.nan, "fwd_bwd_ms": math.nan, "fwd_ms": 1.0}, {"bwd_ms": math.nan, "fwd_bwd_ms": math.nan, "fwd_ms": 1.5},
     True),  # forward-only
    # another problem of the key (another length in the bucket, another batch): the newer search
    ({"seqlen_q": 3000, "seqlen_k": 3000, "fwd_bwd_ms": 3.0, "created_at": NEW},
     {"fwd_bwd_ms": 2.0, "created_at": OLD}, True),
    ({"batch": 4, "fwd_bwd_ms": 1.0, "created_at": OLD}, {"batch": 8, "fwd_bwd_ms": 3.0, "created_at": NEW}, False),
    ({"batch": 4, "fwd_bwd_ms": 9.0}, {"batch": 8, "fwd_bwd_ms": 1.0, "created_at": NEW}, True),  # "": written now
    # sizes an entry does not store (a window's width, the kept keys, documents, a mask): never compared by time
    *[({"mask_variant": variant, "fwd_bwd_ms": 3.0, "created_at": NEW},
       {"mask_variant": variant, "fwd_bwd_ms": 2.0, "created_at": OLD}, True)
      for variant in ("causal+window-left+bottom-right", "causal+seqlens-k", "causal+bottom-right+varlen",
                      "mask-bool")],
    # a forward-only and a full entry of one problem: their forwards
    ({"bwd_ms": math.nan, "fwd_bwd_ms": math.nan, "fwd_ms": 9.0, "created_at": NEW},
     {"fwd_ms": 1.0, "created_at": OLD}, False),
    # the same instant: the entry in place stays
    ({"batch": 4, "fwd_bwd_ms": 1.0, "created_at": NEW}, {"batch": 8, "fwd_bwd_ms": 3.0, "created_at": NEW}, False),
    # times compared as times: an ISO week date (2026-W01-1 is 2025-12-29) and another time zone are no newer
    # for sorting after the calendar date as text
    pytest.param({"batch": 4, "created_at": "2026-W01-1"}, {"batch": 8, "created_at": "2026-01-05T00:00:00+00:00"},
                 False, marks=pytest.mark.skipif(sys.version_info < (3, 11), reason="week dates parse from 3.11")),
    ({"batch": 4, "created_at": "2026-01-05T01:00:00+05:00"}, {"batch": 8, "created_at": "2026-01-04T21:00:00+00:00"},
     False),
])
def test_an_entry_supersedes_by_time_on_its_problem_and_by_recency_across_problems(mine, theirs, replaces):
    """Times of different problems say nothing about each other's configs; a newer search of a key started
    from the config in place (its warm start), so it knows better."""
    base = {"batch": 2, "heads": 16, "seqlen_q": 4096, "seqlen_k": 4096}
    assert make_entry(**{**base, **mine}).supersedes(make_entry(**{**base, **theirs})) is replaces


def test_upsert_keeps_the_faster_entry(db_path):
    with TunedDB(db_path) as db:
        assert db.upsert(make_entry(fwd_bwd_ms=3.0))
        assert not db.upsert(make_entry(fwd_bwd_ms=4.0))
        assert db.upsert(make_entry(fwd_bwd_ms=2.5))
        assert db.count() == 1 and db.get(make_entry().key()).fwd_bwd_ms == 2.5
        assert db.upsert(make_entry(seqlen_q_bucket=8192, seqlen_k_bucket=8192))
        assert db.count() == 2
        assert db.db.execute("pragma journal_mode").fetchone()[0] == "wal"


def test_entry_config_round_trip(db_path):
    with TunedDB(db_path) as db:
        db.upsert(make_entry())
        (entry,) = db.entries()
    config = entry.attention_config()
    assert str(config.fwd) == "64x64/w4/s3" and str(config.dkdv) == "32x128/w4/s3" and str(config.dq) == "128x64/w8/s3"


@pytest.mark.parametrize("suffix", [".sqlite", ".json"])
def test_export_import_round_trip_preserves_every_row(tmp_path, suffix):
    source = TunedDB(tmp_path / "source.sqlite")
    rows = [make_entry(head_dim=d, mask_variant=m, seqlen_q_bucket=n, seqlen_k_bucket=n, fwd_bwd_ms=float(d + n))
            for d in (64, 128) for m in ("none", "causal") for n in (512, 4096)]
    for row in rows:
        source.upsert(row)
    exported = tmp_path / f"export{suffix}"
    assert export_entries(source.entries(), exported) == len(rows)
    target = TunedDB(tmp_path / "target.sqlite")
    assert import_entries(target, exported) == (len(rows), 0)
    key = lambda e: e.key()  # noqa: E731
    strip = lambda e: {k: v for k, v in asdict(e).items() if k != "created_at"}  # noqa: E731
    assert [strip(e) for e in sorted(target.entries(), key=key)] == [strip(e) for e in sorted(source.entries(), key=key)]
    # importing again keeps the rows already there (equal times are not faster)
    assert import_entries(target, exported) == (0, len(rows))


def write_bad_db(path: Path, kind: str, **match) -> Path:
    """A file at `path` that fatune must refuse (import) or pass over (dispatch); `match` sets the
    key columns of the one entry the entry-level kinds hold."""
    if kind == "directory":
        path.mkdir()
    elif kind == "garbage":
        path.write_bytes(b"SQLite format 3\x00" + b"not a database" * 100)
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "json-garbage":
        path.write_text(json.dumps({"something": "else"}))
    elif kind == "foreign":
        connection = sqlite3.connect(path)
        connection.execute("create table users (name text)")
        connection.commit()
        connection.close()
    elif kind in ("newer", "stale"):
        with TunedDB(path) as db:
            stale = {"template_hash": "0123456789abcdef", "triton_version": "2.0.0"} if kind == "stale" else {}
            db.upsert(make_entry(**match, **stale))
        if kind == "newer":
            connection = sqlite3.connect(path)
            connection.execute("update meta set value = ? where key = 'schema_version'", [str(SCHEMA_VERSION + 1)])
            connection.commit()
            connection.close()
    elif kind in ("trigger", "check", "no-id", "damaged", "bad-text"):  # fatune's tables, altered as no fatune would
        with TunedDB(path, wal=False) as db:
            db.upsert(make_entry(**match))
        connection = sqlite3.connect(path)
        if kind == "trigger":
            connection.execute("create trigger refuse before insert on entries begin select raise(abort, 'no'); end")
        elif kind == "check":  # refuses every entry fatune writes
            (sql,) = connection.execute("select sql from sqlite_master where name = 'entries'").fetchone()
            connection.executescript(f"drop table entries; {sql.rstrip()[:-1]}, check (seqlen_q_bucket < 16));")
        elif kind == "no-id":
            columns = ", ".join(c for (_, c, *_) in connection.execute("pragma table_info(entries)") if c != "id")
            connection.executescript(f"create table copied as select {columns} from entries; drop table entries; "
                                     f"alter table copied rename to entries;")
        elif kind == "bad-text":  # not UTF-8, in the row an upsert of the same key reads
            connection.execute("update entries set sdpa_backend = cast(x'c328' as text)")
        else:  # the entries table's first page overwritten
            (page,) = connection.execute("select rootpage from sqlite_master where name = 'entries'").fetchone()
            (size,) = connection.execute("pragma page_size").fetchone()
        connection.commit()
        connection.close()
        if kind == "damaged":
            with open(path, "r+b") as handle:
                handle.seek((page - 1) * size)
                handle.write(b"\xff" * size)
    else:  # a row no fatune would write: block_m 7, a missing backward config or a negative time
        TunedDB(path).close()
        raw_insert(path, **match, **{
            "invalid-entry": {"fwd_config": '{"block_m": 7, "block_n": 64, "num_warps": 4, "num_stages": 3}'},
            "null-config": {"bwd_config": None}, "negative-time": {"fwd_bwd_ms": -1.0}}[kind])
    return path


@pytest.mark.parametrize("content", ["garbage", "json-garbage", "foreign", "newer", "stale", "invalid-entry"])
def test_import_refuses_bad_files_and_leaves_the_db_untouched(tmp_path, content):
    db = TunedDB(tmp_path / "mine.sqlite")
    db.upsert(make_entry())
    before = [asdict(e) for e in db.entries()]
    bad = write_bad_db(tmp_path / ("bad.json" if content == "json-garbage" else "bad.sqlite"), content, head_dim=128)
    with pytest.raises(DBError) as raised:
        import_entries(db, bad)
    message = str(raised.value)
    expected = {"garbage": "not a usable SQLite", "json-garbage": "not a fatune tuned-DB export",
                "foreign": "not a fatune tuned DB", "newer": "newer", "stale": "kernel hashes 0123456789abcdef",
                "invalid-entry": "fwd_config.block_m"}[content]
    assert expected in message and str(bad) in message
    assert [asdict(e) for e in db.entries()] == before
    if content == "stale":
        assert import_entries(db, bad, force=True) == (1, 0)


def test_shipped_schema_v1_asset_still_opens(tmp_path):
    """tests/assets keeps a file of every schema version: a newer fatune must migrate or read it."""
    copy = tmp_path / "v1.sqlite"
    shutil.copy(ASSETS / "tuned-schema-v1.sqlite", copy)
    entries = read_entries(copy)
    assert entries and entries[0].attention_config().fwd.block_m > 0
    with TunedDB(copy) as db:
        assert db.count() == len(entries)


def _write_many(path: str, worker: int, count: int) -> None:
    with TunedDB(path) as db:
        for i in range(count):
            db.upsert(make_entry(seqlen_q_bucket=16 << (i % 10), seqlen_k_bucket=16 << (i // 10),
                                 head_dim=worker + 1, fwd_bwd_ms=float(i + 1)))


def test_concurrent_writers_lose_nothing(tmp_path):
    path = str(tmp_path / "shared.sqlite")
    TunedDB(path).close()
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_write_many, args=(path, w, 40)) for w in range(3)]
    for process in workers:
        process.start()
    for process in workers:
        process.join(120)
        assert process.exitcode == 0
    with TunedDB(path, readonly=True) as db:
        assert db.count() == 3 * 40


def test_connections_opening_a_fresh_file_together_all_succeed(tmp_path):
    """SQLite refuses the switch to WAL at once, without its busy handler, when another connection changes
    the file's locks meanwhile (processes opening a fresh file together: several searches started at once).
    Without a retry about one round in ten of six openers fails."""
    failures = []
    for round_ in range(60):
        path = tmp_path / f"fresh-{round_}.sqlite"
        barrier = threading.Barrier(6)

        def open_it(_: int):
            barrier.wait()
            try:
                with TunedDB(path) as db:
                    db.count()
            except Exception as error:  # noqa: BLE001 - any error of any opener fails the test
                failures.append(repr(error))

        run_together(open_it, 6, timeout=60)
    assert failures == []


def test_seqlen_buckets_are_log_scale():
    assert [seqlen_bucket(n) for n in (1, 16, 17, 1000, 1024, 1025, 16384)] == [16, 16, 32, 1024, 1024, 2048, 16384]


# -- every entry validated: on upsert, on import and on read ---------------------------------

GOOD_CONFIG = {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3}
GLUON_CONFIG = {"family": "gluon", "block_n": 128, "num_stages": 2, "consumers": 2, "consumer_regs": 240, "maxnreg": 168}
GLUON_BACKWARD = {"family": "gluon", "block_m": 64, "num_stages": 2, "consumers": 2, "consumer_regs": 240,
                  "maxnreg": 168, "dq_slice": 64}
INVALID_FIELDS = [  # (field, bad value, what the message must name)
    ("fwd_config", {**GOOD_CONFIG, "block_m": 7}, "fwd_config.block_m"),
    ("fwd_config", {**GOOD_CONFIG, "num_warps": 3}, "fwd_config.num_warps"),
    ("fwd_config", {**GOOD_CONFIG, "num_stages": True}, "fwd_config.num_stages"),
    ("fwd_config", {**GOOD_CONFIG, "block_n": 64.0}, "fwd_config.block_n"),
    ("fwd_config", {"block_m": 64, "block_n": 64}, "fwd_config"),
    ("fwd_config", None, "fwd_config"),
    ("bwd_config", {}, "bwd_config"),
    ("bwd_config", None, "bwd_config"),
    ("bwd_config", {"dkdv": GOOD_CONFIG}, "bwd_config"),
    ("bwd_config", {"dkdv": GOOD_CONFIG, "dq": {**GOOD_CONFIG, "block_m": 512}}, "bwd_config.dq.block_m"),
    ("fwd_config", {**GOOD_CONFIG, "tma": 2}, "fwd_config.tma"),
    ("fwd_config", {**GOOD_CONFIG, "maxnreg": 8}, "fwd_config.maxnreg"),
    ("bwd_config", {"dkdv": {**GOOD_CONFIG, "split_d": 3}, "dq": GOOD_CONFIG}, "bwd_config.dkdv.split_d"),
    ("bwd_config", {"dkdv": GOOD_CONFIG, "dq": {**GOOD_CONFIG, "split_d": 2}}, "bwd_config.dq: ['split_d']"),
    ("bwd_config", {"dkdv": GOOD_CONFIG, "dq": {**GOOD_CONFIG, "concurrent": 3}}, "bwd_config.dq.concurrent"),
    ("bwd_config", {"dkdv": {**GOOD_CONFIG, "concurrent": 1}, "dq": GOOD_CONFIG}, "bwd_config.dkdv: ['concurrent']"),
    # a field this version does not know (e.g. a removed switch) makes the entry invalid
    ("fwd_config", {**GOOD_CONFIG, "tma": 1, "retired_switch": 1}, "fwd_config: expected an object"),
    ("bwd_config", {"dkdv": {**GOOD_CONFIG, "num_splits": 2}, "dq": GOOD_CONFIG}, "bwd_config.dkdv: ['num_splits']"),
    ("bwd_config", {"dkdv": GOOD_CONFIG, "dq": {**GOOD_CONFIG, "tma": 1}}, "bwd_config.dq: ['tma']"),
    ("bwd_config", {"dkdv": GOOD_CONFIG, "dq": {**GOOD_CONFIG, "retired_switch": 0}}, "bwd_config.dq: expected"),
    # a Gluon forward: its family named, its fields ints, a register split the GPU can give (else setmaxnreg hangs)
    ("fwd_config", {**GLUON_CONFIG, "consumers": 3}, "fwd_config.consumer_regs"),
    ("fwd_config", {**GLUON_CONFIG, "maxnreg": 128}, "fwd_config.consumer_regs"),
    ("fwd_config", {**GLUON_CONFIG, "block_n": 96}, "fwd_config.block_n"),
    ("fwd_config", {**GLUON_CONFIG, "num_stages": "2"}, "fwd_config.num_stages"),
    ("fwd_config", {**GLUON_CONFIG, "family": "cutlass"}, "fwd_config: expected"),
    ("fwd_config", {**GLUON_CONFIG, "overlap": 2}, "fwd_config.overlap"),
    ("fwd_config", {**GLUON_CONFIG, "overlap": 0, "pingpong": 1}, "fwd_config.pingpong"),
    ("fwd_config", {**GLUON_CONFIG, "block_m": 128}, "fwd_config: expected"),
    ("fwd_config", {"family": "gluon", "block_n": 128}, "fwd_config: expected"),
    ("bwd_config", {"dkdv": GLUON_CONFIG, "dq": GOOD_CONFIG}, "bwd_config.dkdv: expected"),
    # a Gluon backward: likewise
    ("bwd_config", {"dkdv": {**GLUON_BACKWARD, "dq_slice": 48}, "dq": GOOD_CONFIG}, "bwd_config.dkdv.dq_slice"),
    ("bwd_config", {"dkdv": {**GLUON_BACKWARD, "consumers": 3}, "dq": GOOD_CONFIG}, "bwd_config.dkdv.consumer_regs"),
    ("bwd_config", {"dkdv": {**GLUON_BACKWARD, "block_m": 1.5}, "dq": GOOD_CONFIG}, "bwd_config.dkdv.block_m"),
    ("bwd_config", {"dkdv": GOOD_CONFIG, "dq": GLUON_BACKWARD}, "bwd_config.dq"),
    ("fwd_config", GLUON_BACKWARD, "fwd_config: expected"),
    ("fwd_bwd_ms", -1.0, "fwd_bwd_ms"),
    ("fwd_bwd_ms", 0.0, "fwd_bwd_ms"),
    ("fwd_bwd_ms", float("nan"), "fwd_bwd_ms"),
    ("fwd_bwd_ms", float("inf"), "fwd_bwd_ms"),
    ("fwd_ms", -0.5, "fwd_ms"),
    ("bwd_ms", "fast", "bwd_ms"),
    ("sdpa_ms", -2.0, "sdpa_ms"),
    ("dtype", "int8", "dtype"),
    ("mask_variant", "window", "mask_variant"),  # the ambiguous name of older versions
    ("mask_variant", "causal+sideways", "mask_variant"),
    ("seqlen_q_bucket", 1000, "seqlen_q_bucket"),
    ("seqlen_k_bucket", 8, "seqlen_k_bucket"),
    ("group_size", 0, "group_size"),
    ("head_dim", 0, "head_dim"),
    ("head_dim_v", 999, "head_dim_v"),
    ("capability", "abc", "capability"),
    ("gpu", "", "gpu"),
    ("trials", -3, "trials"),
    ("interpreted", "yes", "interpreted"),
]


def test_a_gluon_backward_entry_is_stored_and_read_back(db_path):
    with TunedDB(db_path) as db:
        db.upsert(make_entry(fwd_config=GLUON_CONFIG, bwd_config={"dkdv": GLUON_BACKWARD, "dq": GOOD_CONFIG}))
        [entry] = db.entries()
    config = entry.attention_config()
    # an entry stored before the consumers could share dQ's reduction reads back without sharing it
    assert config.gluon_forward and config.gluon_backward and config.dkdv.to_dict() == {**GLUON_BACKWARD,
                                                                                        "shared_dq": 0}


@pytest.mark.parametrize("fwd_config", [
    {**GOOD_CONFIG, "tma": 1},
    {**GOOD_CONFIG, "num_splits": 0, "pack_gqa": 1, "tma": 1},
    {**GOOD_CONFIG, "tma": 1, "maxnreg": 128},
    GOOD_CONFIG,  # entries written before the structure fields existed
], ids=["tma", "all-forward-structure", "register-cap", "older-entry"])
def test_forward_structure_fields_are_stored_and_read_back(db_path, fwd_config):
    with TunedDB(db_path) as db:
        db.upsert(make_entry(fwd_config=fwd_config))
        [entry] = db.entries()
    fwd = entry.attention_config().fwd
    assert {name: getattr(fwd, name) for name in fwd_config} == fwd_config
    assert fwd.tma == fwd_config.get("tma", 0)


def test_a_concurrent_dq_config_is_stored_and_read_back(db_path):
    dq = {**GOOD_CONFIG, "concurrent": 2}
    with TunedDB(db_path) as db:
        db.upsert(make_entry(bwd_config={"dkdv": GOOD_CONFIG, "dq": dq}))
        [entry] = db.entries()
    assert entry.attention_config().dq.concurrent == 2 and entry.attention_config().dkdv.concurrent == 0


@pytest.mark.parametrize("name, value, named", INVALID_FIELDS, ids=[f"{n}={v!r}" for n, v, _ in INVALID_FIELDS])
def test_invalid_entries_are_refused_on_upsert_and_import_naming_the_field(tmp_path, name, value, named):
    db = TunedDB(tmp_path / "mine.sqlite")
    db.upsert(make_entry(fwd_bwd_ms=5.0))
    before = [asdict(e) for e in db.entries()]
    bad = replace(make_entry(), **{name: value})
    with pytest.raises(InvalidEntry, match=re.escape(named)):
        db.upsert(bad)
    export = tmp_path / "bad.json"
    export.write_text(json.dumps({"fatune_tuned_db": SCHEMA_VERSION, "entries": [asdict(make_entry(head_dim=128)),
                                                                                  asdict(bad)]}))
    with pytest.raises(DBError, match=f"entry 1: {re.escape(named)}"):
        import_entries(db, export)
    assert [asdict(e) for e in db.entries()] == before


def raw_insert(path: Path, **changes) -> None:
    """Write a row past fatune's checks, as another tool (or a damaged copy) could."""
    row = {**make_entry().to_row(), **changes}
    connection = sqlite3.connect(path)
    columns, marks = ", ".join(row), ", ".join("?" * len(row))
    connection.execute(f"insert into entries ({columns}) values ({marks})", list(row.values()))
    connection.commit()
    connection.close()


@pytest.mark.parametrize("column, value", [("fwd_config", "{not json"), ("bwd_config", '{"dkdv": {}}'),
                                           ("fwd_bwd_ms", -1.0), ("fwd_bwd_ms", None), ("seqlen_q_bucket", 100),
                                           ("interpreted", 7),
                                           ("fwd_config", json.dumps({**GOOD_CONFIG, "retired_switch": 1}))])
def test_invalid_rows_are_skipped_and_reported_on_read(tmp_path, column, value):
    path = tmp_path / "t.sqlite"
    TunedDB(path).upsert(make_entry(mask_variant="none"))
    raw_insert(path, **{column: value})
    reported = []
    with TunedDB(path, readonly=True) as db:
        assert [e.mask_variant for e in db.entries(on_invalid=reported.append)] == ["none"]
        with pytest.raises(InvalidEntry, match=column):
            list(db.entries())
    assert len(reported) == 1 and str(path) in reported[0] and column in reported[0]


def test_a_stored_bad_time_never_wins_against_a_real_one(tmp_path):
    path = tmp_path / "t.sqlite"
    TunedDB(path).close()
    raw_insert(path, fwd_bwd_ms=-1.0)
    with TunedDB(path) as db:
        assert db.upsert(make_entry(fwd_bwd_ms=9.0))
        assert db.get(make_entry().key()).fwd_bwd_ms == 9.0


# -- times no GPU can measure -------------------------------------------------------------------

PROBLEM = {"batch": 4, "heads": 16, "seqlen_q": 4096, "seqlen_k": 4096}  # make_entry's key: causal, d64
PROBLEM_FLOPS = 2 * 4 * 16 * (4096 * 4097 // 2) * (64 + 64)  # the forward: (query, key) pairs the mask keeps
LEAST_FWD_MS = PROBLEM_FLOPS / MAX_FLOPS_PER_S * 1e3  # about 0.11 ms (an H200 takes about 2 ms)
FORWARD_ONLY = {"bwd_ms": math.nan, "fwd_bwd_ms": math.nan}
IMPOSSIBLE_TIMES = [  # (changes to make_entry, the field the message must name)
    ({"fwd_ms": 1e-300}, "fwd_ms"),
    ({"fwd_ms": 0.9 * MIN_TIME_MS}, "fwd_ms"),
    ({"bwd_ms": 0.0}, "bwd_ms"),
    ({"bwd_ms": 1e-6}, "bwd_ms"),
    ({"fwd_bwd_ms": 1e-300}, "fwd_bwd_ms"),
    ({"sdpa_ms": 1e-12}, "sdpa_ms"),
    ({"fwd_ms": 1e-300, **FORWARD_ONLY}, "fwd_ms"),
    ({"fwd_ms": 1e-300, "interpreted": True}, "fwd_ms"),
    # a variant whose sizes an entry does not store: the floor still holds
    ({"fwd_ms": 1e-300, "mask_variant": "causal+window-left+bottom-right"}, "fwd_ms"),
    ({"fwd_bwd_ms": 1e-300, **PROBLEM, "mask_variant": "causal+seqlens-k"}, "fwd_bwd_ms"),
    # its stored problem's FLOPs in that time: above any GPU's peak
    ({**PROBLEM, "fwd_ms": 0.99 * LEAST_FWD_MS}, "fwd_ms"),
    ({**PROBLEM, "fwd_ms": 0.99 * LEAST_FWD_MS, **FORWARD_ONLY}, "fwd_ms"),
    ({**PROBLEM, "fwd_ms": 0.01, "interpreted": True}, "fwd_ms"),
    ({**PROBLEM, "bwd_ms": 2.49 * LEAST_FWD_MS}, "bwd_ms"),
    ({**PROBLEM, "fwd_bwd_ms": 3.49 * LEAST_FWD_MS}, "fwd_bwd_ms"),
    ({**PROBLEM, "sdpa_ms": 3.49 * LEAST_FWD_MS}, "sdpa_ms"),
    ({**PROBLEM, "sdpa_ms": 0.99 * LEAST_FWD_MS, "fwd_ms": 2.0, **FORWARD_ONLY}, "sdpa_ms"),
    ({**PROBLEM, "mask_variant": "none", "fwd_ms": 1.9 * LEAST_FWD_MS}, "fwd_ms"),  # no mask: twice the pairs
    ({**PROBLEM, "head_dim": 128, "head_dim_v": 128, "fwd_ms": 1.9 * LEAST_FWD_MS}, "fwd_ms"),
    # measured, not forged-fast: finite and within reach
    ({"tflops": 1e6}, "tflops"),
    ({"tflops": -1.0}, "tflops"),
    ({"tflops": math.inf}, "tflops"),
    ({"speedup": -1.0}, "speedup"),
    ({"speedup": math.inf}, "speedup"),
    # a creation time ahead of now would replace every entry of another problem (the newer search wins)
    ({"created_at": "2999-01-01T00:00:00+00:00"}, "created_at"),
    ({"created_at": "not a time"}, "created_at"),
]
POSSIBLE_TIMES = [  # changes to make_entry that real measurements give
    {**PROBLEM, "fwd_ms": 2.2, "bwd_ms": 6.0, "fwd_bwd_ms": 8.2, "sdpa_ms": 9.0, "tflops": 460.0, "speedup": 1.1},
    {**PROBLEM, "fwd_ms": 1.01 * LEAST_FWD_MS, "bwd_ms": 2.51 * LEAST_FWD_MS, "fwd_bwd_ms": 3.51 * LEAST_FWD_MS},
    {**PROBLEM, "fwd_ms": 1.01 * LEAST_FWD_MS, "sdpa_ms": 1.01 * LEAST_FWD_MS, **FORWARD_ONLY},
    {"fwd_ms": MIN_TIME_MS, "bwd_ms": MIN_TIME_MS, "fwd_bwd_ms": MIN_TIME_MS, "tflops": 0.0},  # sizes not stored
    {**PROBLEM, "mask_variant": "causal+window-left+bottom-right", "fwd_ms": 0.002, "fwd_bwd_ms": 0.004},
    # top-left causal, 16 queries: only the first 16 keys of 2**20 are kept (not half of them)
    {"batch": 1, "heads": 32, "seqlen_q": 16, "seqlen_k": 1 << 20, "fwd_ms": 0.005, "fwd_bwd_ms": 0.012},
    {**PROBLEM, "interpreted": True, "fwd_ms": 9e5, "bwd_ms": 2e6, "fwd_bwd_ms": 2.9e6},
]


@pytest.mark.parametrize("changes", POSSIBLE_TIMES)
def test_times_a_gpu_can_measure_are_valid(changes):
    assert make_entry(**changes).check()


@pytest.mark.parametrize("changes, named", IMPOSSIBLE_TIMES,
                         ids=[",".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in c.items())
                              for c, _ in IMPOSSIBLE_TIMES])
def test_impossible_times_are_refused_on_upsert_import_and_read(tmp_path, changes, named):
    """A forged time would win every upsert (the faster entry stays): refused wherever an entry comes in."""
    path = tmp_path / "mine.sqlite"
    forged = make_entry(**changes)
    real = make_entry(**PROBLEM, mask_variant=forged.mask_variant, head_dim=forged.head_dim,
                      head_dim_v=forged.head_dim_v, seqlen_q_bucket=2048, seqlen_k_bucket=2048, fwd_ms=2.2)
    forged = replace(forged, template_hash=real.template_hash)  # current kernels: only its times are wrong
    db = TunedDB(path)
    db.upsert(real)
    before = [asdict(e) for e in db.entries()]
    with pytest.raises(InvalidEntry, match=f"^{named}: "):
        db.upsert(forged)
    export = tmp_path / "forged.json"
    export.write_text(json.dumps({"fatune_tuned_db": SCHEMA_VERSION, "entries": [asdict(real), asdict(forged)]}))
    with pytest.raises(InvalidEntry, match=f"{re.escape(str(export))}: entry 1: {named}: "):
        import_entries(db, export)
    assert [asdict(e) for e in db.entries()] == before
    raw_insert(path, **forged.to_row())  # as another tool, or a hand-edited copy, could write it
    reported = []
    key = CallKey(**{name: getattr(forged, name) for name in CallKey.__dataclass_fields__})
    entry, _ = db.match(forged.gpu, forged.capability, key, reported.append)
    assert asdict(entry) == before[0]  # the real entry of the next bucket, not the forged one of the call's
    assert len(reported) == 1 and str(path) in reported[0] and f": {named}: " in reported[0], reported
    db.close()


# -- the key -----------------------------------------------------------------------------------

def test_mask_variant_names_every_compile_time_switch():
    """Two specs that render different kernels never share a tuned-DB key; plain calls keep their names."""
    flags = ("causal", "window_left", "window_right", "bottom_right", "alibi", "dropout")
    specs = [KernelSpec("float16", 64, attn_mask=mask, seqlens=seqlens, **dict(zip(flags, values)))
             for values in itertools.product((False, True), repeat=len(flags)) for mask in ("none", "bool", "additive")
             for seqlens in ("fixed", "seqlens_k", "varlen")]
    assert len({spec.mask_variant for spec in specs}) == len(specs) == 576  # one name per spec, so per kernel
    assert KernelSpec("float16", 64).mask_variant == "none" and KernelSpec("float16", 64, causal=True).mask_variant \
        == "causal"
    left = KernelSpec("float16", 64, window_left=True, bottom_right=True).mask_variant
    both = KernelSpec("float16", 64, window_left=True, window_right=True, bottom_right=True).mask_variant
    assert left != both


def test_search_and_dispatch_build_the_same_key():
    """A searched Shape and the call it stands for map to one key (fatune.db.call_key)."""
    from fatune.call import check_inputs
    from fatune.db import problem_key
    from fatune.tuning.shape import Shape, shape_key

    for shape in (Shape(2, 8, 1000, 700, 64, "float16", causal=True, kv_heads=2),
                  Shape(1, 4, 300, 300, 80, "bfloat16", causal=True, window=32, head_dim_v=64),
                  Shape(2, 4, 64, 128, 32, "float32", valid_keys=0.5),
                  Shape(2, 4, 4096, 4096, 64, "bfloat16", causal=True, window=1024),
                  Shape(2, 4, 4096, 4096, 64, "bfloat16", window=100),
                  Shape(1, 4, 300, 300, 64, "float16", causal=True, window=20, documents=3),
                  Shape(2, 8, 512, 512, 64, "float16", causal=True, window=100, kv_heads=2, valid_keys=0.5),
                  Shape(2, 4, 128, 1000, 64, "float16", causal=True, window=200),
                  Shape(2, 4, 1000, 128, 64, "float16", causal=True, window=300),
                  Shape(2, 4, 600, 600, 64, "float16", causal=True, window=700),    # wider than L, narrower than 2L
                  Shape(2, 4, 600, 600, 64, "float16", causal=True, window=1200)):  # dropped: plain causal
        kwargs = shape.attention_kwargs("cpu")
        q, k, v = (torch.empty(shape.input_sizes()[name], dtype=DTYPES[shape.dtype]) for name in "qkv")
        assert shape_key(shape) == problem_key(check_inputs(q, k, v, **kwargs)), shape


@pytest.mark.parametrize("window_size, causal, lk, reach_bucket", [
    ((-1, -1), False, 8192, 8192),      # no window: the keys' length
    ((1024, 0), True, 8192, 1024),      # causal sliding window: its width
    ((256, 0), False, 8192, 256),       # window (256, 0) without is_causal: the right edge is the diagonal
    ((100, 100), False, 8192, 256),     # two-sided: left + right
    ((4096, 0), True, 2048, 2048),      # wider than the sequence: the sequence
    ((1000, -1), False, 8192, 8192),    # right edge unbounded: every key to the right
    ((-1, 0), False, 8192, 8192),       # left edge unbounded
    ((0, 0), True, 8192, 16),           # the diagonal alone: the smallest bucket
    ((1 << 40, 0), True, 4096, 4096),   # a window past the lengths' range
])
def test_a_window_keys_the_entry_by_its_width(window_size, causal, lk, reach_bucket):
    """Lk's bucket is how far a query row's keys reach, so windows of different widths get their own entries
    (the best tile follows the work per query tile) and one width is the same key at every length."""
    from fatune.call import check_inputs
    from fatune.db import problem_key

    q = torch.empty(1, 2, 4096, 64, dtype=torch.float16)
    k = v = torch.empty(1, 2, lk, 64, dtype=torch.float16)
    key = problem_key(check_inputs(q, k, v, is_causal=causal, window_size=window_size))
    assert (key.seqlen_q_bucket, key.seqlen_k_bucket) == (4096, reach_bucket)


# -- files: read-only opening, rollback-journal exports, writability checked first ------------

def test_export_is_in_rollback_journal_mode_and_opens_read_only(tmp_path):
    source = TunedDB(tmp_path / "source.sqlite")  # WAL, as search writes it
    source.upsert(make_entry())
    out = tmp_path / "export.sqlite"
    export_entries(source.entries(), out)
    connection = sqlite3.connect(f"file:{out}?mode=ro", uri=True)
    assert connection.execute("pragma journal_mode").fetchone()[0] == "delete"
    connection.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export.sqlite", "source.sqlite", "source.sqlite-shm",
                                                          "source.sqlite-wal"]
    assert len(read_entries(out)) == 1


def test_a_wal_file_whose_side_files_cannot_be_created_is_read_immutable(tmp_path, monkeypatch):
    """mode=ro fails on a WAL file in a read-only folder; the reader falls back to immutable=1."""
    path = tmp_path / "wal.sqlite"
    with TunedDB(path) as db:  # closed: its WAL is checkpointed into the file, as in a shipped copy
        db.upsert(make_entry())
    uris = []
    real_connect = sqlite3.connect

    class NoSideFiles:  # what SQLite answers there on the first read: it cannot create the -shm file
        def execute(self, *args):
            raise sqlite3.OperationalError("attempt to write a readonly database")

        def close(self):
            pass

    def connect(database, *args, **kwargs):
        uris.append(database)
        return NoSideFiles() if "mode=ro" in database else real_connect(database, *args, **kwargs)

    monkeypatch.setattr(sqlite3, "connect", connect)
    with TunedDB(path, readonly=True) as db:
        assert db.count() == 1
    assert [uri.rsplit("?", 1)[1] for uri in uris] == ["mode=ro", "immutable=1"]


@pytest.mark.parametrize("name", ["a?b.sqlite", "100%.sqlite", "x#y.sqlite", "sp ace.sqlite"])
def test_names_with_uri_characters_open_the_right_file(tmp_path, name):
    path = tmp_path / name
    TunedDB(path).upsert(make_entry())
    with TunedDB(path, readonly=True) as db:
        assert db.count() == 1
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(("-wal", "-shm"))) == [name]


def test_writability_is_checked_before_any_work(tmp_path, monkeypatch):
    """Root-proof: a parent that is a file, a missing DB that must not be created, and os.access
    saying no (what a read-only file or mount gives a non-root user) all fail at once."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(DBError, match="not a directory"):
        TunedDB(blocker / "sub" / "t.sqlite")
    with pytest.raises(DBError, match="no such file"):
        TunedDB(tmp_path / "missing.sqlite", create=False)
    assert not (tmp_path / "missing.sqlite").exists()
    with pytest.raises(DBError, match="is a directory"):
        TunedDB(tmp_path)
    existing = tmp_path / "t.sqlite"
    TunedDB(existing).upsert(make_entry())
    monkeypatch.setattr(os, "access", lambda path, mode: not mode & os.W_OK)
    with pytest.raises(DBError, match="read-only"):
        TunedDB(existing)
    with TunedDB(existing, readonly=True) as db:  # reading needs no write access
        assert db.count() == 1


def run_child(code: str, *args, timeout: float = 120) -> list[dict]:
    """The JSON lines `code` prints, run in a fresh interpreter that is killed if it blocks: a call that
    hangs fails the test (naming what it printed before) instead of hanging the suite."""
    try:
        child = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                               timeout=timeout)
    except subprocess.TimeoutExpired as error:
        printed = error.stdout.decode() if isinstance(error.stdout, bytes) else error.stdout
        pytest.fail(f"blocked: still running after {timeout} s, having printed {printed!r}")
    assert child.returncode == 0, child.stderr[-3000:]
    return [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]


def not_regular_files(tmp_path: Path) -> dict[str, Path]:
    """A path of each kind that is no regular file (those this system lets a test make)."""
    paths = {"fifo": tmp_path / "fifo.sqlite", "directory": tmp_path / "folder.sqlite",
             "symlink to a fifo": tmp_path / "link.sqlite", "side-file fifo": tmp_path / "side.sqlite"}
    os.mkfifo(paths["fifo"])
    paths["directory"].mkdir()
    paths["symlink to a fifo"].symlink_to(paths["fifo"])
    TunedDB(paths["side-file fifo"], wal=False).close()  # a good DB, its rollback journal a FIFO
    os.mkfifo(f"{paths['side-file fifo']}-journal")
    paths["symlink to a DB beside a fifo"] = tmp_path / "side-link.sqlite"  # SQLite opens the target's journal
    paths["symlink to a DB beside a fifo"].symlink_to(paths["side-file fifo"])
    for device in ("/dev/null", "/dev/zero"):
        if os.path.exists(device):
            paths[f"character device {device}"] = Path(device)
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as server:  # AF_UNIX paths are short
        server.bind(str(tmp_path / "socket.sqlite"))
        paths["socket"] = tmp_path / "socket.sqlite"
    return paths


OPEN_CHILD = r"""
import json, sys
from fatune.db import DBError, TunedDB, check_readable, read_entries

for path in sys.argv[1:]:
    for call, open_it in {"read": lambda: TunedDB(path, readonly=True), "write": lambda: TunedDB(path),
                          "write-existing": lambda: TunedDB(path, create=False), "import": lambda: read_entries(path),
                          "check": lambda: check_readable(path)}.items():
        try:
            open_it()
            outcome = "opened"
        except Exception as error:
            outcome = f"{type(error).__name__}: {error}"
        print(json.dumps({"path": path, "call": call, "outcome": outcome}), flush=True)
"""


def test_a_path_that_is_no_regular_file_is_refused_without_blocking(tmp_path):
    """SQLite (and open()) would wait forever for a writer on a FIFO; a directory, device or socket is no DB."""
    paths = not_regular_files(tmp_path)
    json_fifo, no_db = tmp_path / "export.json", tmp_path / "none.sqlite"
    os.mkfifo(json_fifo)
    os.mkfifo(f"{no_db}-wal")  # SQLite would open it on creating the DB there
    results = run_child(OPEN_CHILD, *paths.values(), json_fifo, no_db)
    assert len(results) == 5 * (len(paths) + 2)
    for result in results:
        assert result["outcome"].startswith(f"DBError: {result['path']}"), result
        assert "not a regular file" in result["outcome"], result
    assert (tmp_path / "folder.sqlite").is_dir() and not list((tmp_path / "folder.sqlite").iterdir())


def test_a_symlink_to_a_regular_file_is_a_db(tmp_path):
    target = tmp_path / "real.sqlite"
    with TunedDB(target) as db:
        db.upsert(make_entry())
    link = tmp_path / "link.sqlite"
    link.symlink_to(target)
    with TunedDB(link, readonly=True) as db:
        assert db.count() == 1
    with TunedDB(link, create=False) as db:
        assert db.upsert(make_entry(fwd_bwd_ms=2.0))
    assert [e.fwd_bwd_ms for e in read_entries(link)] == [2.0]


def test_a_read_only_file_fails_when_opened_for_writing(tmp_path):
    """The write lock is taken on open, so a file SQLite can only read fails before any work."""
    path = tmp_path / "t.sqlite"
    TunedDB(path, wal=False).upsert(make_entry())
    db = TunedDB.__new__(TunedDB)
    db.path, db.readonly, db.label = path, False, str(path)
    db.db = sqlite_utils.Database(sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None))
    with pytest.raises(DBError, match="read-only"):
        db._check_write_lock()


def test_a_forward_only_entry_is_valid_round_trips_and_is_compared_by_its_forward(tmp_path):
    inference = make_entry(bwd_ms=math.nan, fwd_bwd_ms=math.nan, fwd_ms=0.5, seqlen_q_bucket=16)
    assert inference.check().forward_only and not make_entry().forward_only
    for half in ({"bwd_ms": math.nan}, {"fwd_bwd_ms": math.nan}):  # one of the two alone is not forward-only
        with pytest.raises(InvalidEntry, match=next(iter(half))):
            make_entry(**half).check()
    for name in ("out.json", "out.sqlite"):
        assert export_entries([inference], tmp_path / name) == 1
        (back,) = read_entries(tmp_path / name)
        assert back.forward_only and back.fwd_ms == 0.5 and back.fwd_config == inference.fwd_config
    with TunedDB(tmp_path / "tuned.sqlite") as db:
        full = replace(inference, bwd_ms=2.0, fwd_bwd_ms=3.0, fwd_ms=1.0)
        assert db.upsert(full)
        assert db.upsert(inference)  # forward 0.5 < 1.0 ms: like with like, not NaN against 3.0
        assert not db.upsert(replace(full, fwd_ms=0.6))  # the forward-only entry's forward is faster
        assert not db.upsert(replace(inference, fwd_ms=0.7))
        assert db.get(inference.key()).forward_only and db.get(inference.key()).fwd_ms == 0.5
        assert db.upsert(replace(full, fwd_ms=0.4))
        assert not db.get(inference.key()).forward_only


@contextlib.contextmanager
def edited_template(tmp_path, monkeypatch, name: str, addition: str):
    """The templates with `addition` appended to `name`, for the duration (kernel hashes recomputed)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    templates = Path(tempfile.mkdtemp(dir=tmp_path)) / "templates"
    shutil.copytree(codegen.TEMPLATES.path, templates)
    (templates / name).write_text((templates / name).read_text() + addition)
    monkeypatch.setattr(codegen, "TEMPLATES", Templates("triton", templates))
    caches = (resolve.kernel_hashes, resolve.search_hash)
    for cache in caches:
        cache.cache_clear()
    try:
        yield
    finally:
        for cache in caches:
            cache.cache_clear()


def test_an_entry_goes_stale_only_when_its_own_kernels_change(tmp_path, monkeypatch):
    """An entry keeps the code hashes of the kernels it measured: a template edit in code only other configs
    render (here: TMA forwards) leaves it current, and so does an edit of comments; the entries whose kernels'
    code it changes go stale."""
    plain = make_entry()
    tma = make_entry(fwd_config={**plain.fwd_config, "tma": 1})
    assert plain.template_hash != tma.template_hash and not is_stale(plain) and not is_stale(tma)
    with edited_template(tmp_path, monkeypatch, "attn_fwd.py.jinja", "# a comment every forward renders\n"):
        assert is_stale(plain) == [] and is_stale(tma) == []
    with edited_template(tmp_path, monkeypatch, "attn_fwd.py.jinja",
                         "{% if TMA %}\nONLY_TMA_FORWARDS = tl.constexpr(1)\n{% endif %}\n"):
        assert is_stale(plain) == []
        (reason,) = is_stale(tma)
        assert reason.startswith(f"kernels that have changed since (kernel hashes {tma.template_hash:.60}")


@pytest.mark.parametrize("num_splits, stale", [(0, True), (4, False)])
def test_an_entry_hashes_every_kernel_a_launch_can_make_of_it(tmp_path, monkeypatch, num_splits, stale):
    """A forward stored with num_splits=0 (chosen per call) runs unsplit on a full grid: an edit in code
    only unsplit forwards render makes it stale, and leaves an entry that always splits current."""
    entry = make_entry(fwd_config={**make_entry().fwd_config, "num_splits": num_splits})
    with edited_template(tmp_path, monkeypatch, "attn_fwd.py.jinja",
                         "{% if not SPLIT_KV %}\nONLY_UNSPLIT_FORWARDS = tl.constexpr(1)\n{% endif %}\n"):
        assert bool(is_stale(entry)) == stale


def test_one_row_per_key_whatever_the_kernels(tmp_path):
    """The kernel hashes are not part of the key: a slower config of the same shape is not added beside the
    faster one, a faster one replaces it, and a stale row loses even to a slower current entry."""
    fast = make_entry(fwd_bwd_ms=3.0)
    other_tiles = make_entry(fwd_config={**fast.fwd_config, "block_n": 32}, fwd_bwd_ms=4.0)
    assert other_tiles.template_hash != fast.template_hash
    with TunedDB(tmp_path / "t.sqlite") as db:
        assert db.upsert(fast) and not db.upsert(other_tiles) and db.count() == 1
        assert db.upsert(replace(other_tiles, fwd_bwd_ms=2.0)) and db.count() == 1
        assert next(db.entries()).fwd_config["block_n"] == 32
        db.delete(db.entries())
        assert db.upsert(replace(fast, template_hash="0123456789abcdef", fwd_bwd_ms=1.0))
        assert db.upsert(other_tiles) and db.count() == 1 and next(db.entries()).fwd_bwd_ms == 4.0


@pytest.mark.parametrize("same_problem", [True, False])
def test_a_stale_entry_never_replaces_a_current_one(tmp_path, same_problem):
    """Faster on the same problem or newer on another, an entry whose kernels changed (imported with --force, say)
    loses to the current entry in place: the dispatcher would not run it."""
    current = make_entry(fwd_bwd_ms=5.0, created_at="2026-11-01T00:00:00+00:00")
    stale = make_entry(template_hash="fwd:feedfacefeedface", fwd_bwd_ms=1.0, created_at="2026-11-30T00:00:00+00:00",
                       **({} if same_problem else {"batch": 8}))
    with TunedDB(tmp_path / "t.sqlite") as db:
        assert db.upsert(current)
        assert not db.upsert(stale) and not db.upsert(stale, keep_faster=False)
        assert [e.fwd_bwd_ms for e in db.entries()] == [5.0]


def test_prune_drops_invalid_rows_and_export_counts_what_it_wrote(tmp_path):
    path = tmp_path / "t.sqlite"
    with TunedDB(path) as db:
        db.upsert(make_entry())
    raw_insert(path, fwd_config='{"block_m": 7, "block_n": 64, "num_warps": 4, "num_stages": 3}', seqlen_q_bucket=64)
    result = CliRunner().invoke(cli, ["db", "prune", "--db", str(path)])
    assert result.exit_code == 0 and "dropped 0 entries and 1 invalid rows" in result.output, result.output
    with TunedDB(path, readonly=True) as db:
        assert db.count() == 1
        kept = next(db.entries())
    twice = [kept, replace(kept, template_hash="fwd:feedfacefeedface")]  # one key: the export merges them
    assert export_entries(twice, tmp_path / "out.sqlite") == 1 and export_entries(twice, tmp_path / "out.json") == 2


def test_between_two_stale_rows_the_faster_stays(tmp_path):
    old = make_entry(triton_version="3.0.0", fwd_bwd_ms=3.0)
    with TunedDB(tmp_path / "t.sqlite") as db:
        assert db.upsert(old)
        assert not db.upsert(replace(old, fwd_config={**old.fwd_config, "num_stages": 2}, fwd_bwd_ms=9.0))
        assert db.count() == 1 and next(db.entries()).fwd_bwd_ms == 3.0


@pytest.mark.parametrize("mask_variant, valid", [("causal", True), ("causal+varlen", False),
                                                 ("causal+bottom-right+seqlens-k", False)])
def test_a_persistent_gluon_forward_entry_is_refused_where_it_cannot_run(mask_variant, valid):
    """A persistent program makes no sequence descriptors again per tile: an entry pairing one with key lengths
    or packed sequences is invalid, named, not a silent fallback at launch."""
    entry = make_entry(mask_variant=mask_variant, fwd_config={**GLUON_CONFIG, "persistent": 1})
    if valid:
        assert entry.check().attention_config().fwd.persistent == 1
    else:
        with pytest.raises(InvalidEntry, match="fwd_config.persistent: the persistent forward takes no"):
            entry.check()


@pytest.mark.parametrize("group_size, parts, valid", [(8, 8, True), (8, 2, True), (6, 2, True), (6, 4, False),
                                                      (1, 2, False), (1, 8, False)])
def test_a_group_split_entry_must_split_its_group_evenly(group_size, parts, valid):
    """The search splits a group of query heads into parts that divide it: an untrusted entry that splits a lone
    head or a group unevenly (programs with no heads, each still loading its key tile) is invalid, named."""
    entry = make_entry(group_size=group_size, bwd_config={"dkdv": {**GLUON_BACKWARD, "group_split": parts},
                                                          "dq": GOOD_CONFIG})
    if valid:
        assert entry.check().attention_config().dkdv.group_split == parts
    else:
        with pytest.raises(InvalidEntry, match=f"bwd_config.dkdv.group_split: expected 1 or a divisor of the "
                                               f"group size {group_size}, got {parts}"):
            entry.check()
