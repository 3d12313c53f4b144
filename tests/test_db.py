"""The tuned DB: keep-the-faster upserts, schema checks, export/import round trips, concurrent writers."""

from __future__ import annotations

import json
import multiprocessing
import shutil
import sqlite3
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import triton

from fatune import codegen
from fatune.db import (SCHEMA_VERSION, DBError, Entry, TunedDB, export_entries, import_entries, read_entries,
                       seqlen_bucket)

ASSETS = Path(__file__).parent / "assets"


def make_entry(**changes) -> Entry:
    entry = Entry(gpu="NVIDIA H200", capability="9.0", triton_version=triton.__version__, torch_version="2.11.0",
                  template_hash=codegen.template_hash(), dtype="bfloat16", head_dim=64, head_dim_v=64,
                  mask_variant="causal", group_size=1, seqlen_q_bucket=4096, seqlen_k_bucket=4096,
                  fwd_config={"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3},
                  bwd_config={"dkdv": {"block_m": 32, "block_n": 128, "num_warps": 4, "num_stages": 3},
                              "dq": {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3}},
                  fwd_ms=1.0, bwd_ms=2.0, fwd_bwd_ms=3.0, tflops=400.0, trials=30)
    return replace(entry, **changes)


@pytest.fixture(params=["flat", "nested"])
def db_path(request, tmp_path) -> Path:
    """Contract tests run against a file at the top of a folder and one in folders created on demand."""
    return tmp_path / "tuned.sqlite" if request.param == "flat" else tmp_path / "a" / "b" / "tuned.sqlite"


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


@pytest.mark.parametrize("content", ["garbage", "json-garbage", "foreign-sqlite", "newer-schema", "stale"])
def test_import_refuses_bad_files_and_leaves_the_db_untouched(tmp_path, content):
    db = TunedDB(tmp_path / "mine.sqlite")
    db.upsert(make_entry())
    before = [asdict(e) for e in db.entries()]
    bad = tmp_path / ("bad.json" if content == "json-garbage" else "bad.sqlite")
    if content == "garbage":
        bad.write_bytes(b"not a database" * 100)
    elif content == "json-garbage":
        bad.write_text(json.dumps({"something": "else"}))
    elif content == "foreign-sqlite":
        connection = sqlite3.connect(bad)
        connection.execute("create table users (name text)")
        connection.commit()
        connection.close()
    elif content == "newer-schema":
        TunedDB(bad).upsert(make_entry(head_dim=128))
        connection = sqlite3.connect(bad)
        connection.execute("update meta set value = ? where key = 'schema_version'", [str(SCHEMA_VERSION + 1)])
        connection.commit()
        connection.close()
    else:
        other = TunedDB(bad)
        other.upsert(make_entry(head_dim=128, template_hash="0123456789abcdef"))
        other.close()
    with pytest.raises(DBError) as raised:
        import_entries(db, bad)
    message = str(raised.value)
    expected = {"garbage": "not a usable SQLite", "json-garbage": "not a fatune tuned-DB export",
                "foreign-sqlite": "not a fatune tuned DB", "newer-schema": "newer", "stale": "template hash"}[content]
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
                                 head_dim=worker + 1, fwd_bwd_ms=float(i)))


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


def test_seqlen_buckets_are_log_scale():
    assert [seqlen_bucket(n) for n in (1, 16, 17, 1000, 1024, 1025, 16384)] == [16, 16, 32, 1024, 1024, 2048, 16384]
