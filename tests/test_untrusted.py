"""A tuned DB is untrusted input: fuzzed exports thrown at `fatune db import` and fuzzed rows and files
at the dispatcher (none accepted, none crashes a call), forged times, $FATUNE_DB naming no regular file
(never waited on), and read-only deployments run for real in a child process without root's power to
ignore file permissions."""

from __future__ import annotations

import copy
import ctypes
import json
import logging
import math
import os
import random
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import fatune
from fatune import hardware
from fatune.call import check_inputs
from fatune.cli import cli
from fatune.db import SCHEMA_VERSION, TunedDB, export_entries
from fatune.runtime.dispatch import Dispatcher
from tests.conftest import DEVICE, use_dispatcher
from tests.test_db import make_entry, not_regular_files, raw_insert, run_child

GPU, CAPABILITY = hardware.device_identity(torch.device(DEVICE))
CASES = 300

# -- values no entry may hold, per field (each one invalid whatever the rest of the entry) --------

WRONG_TYPES = [None, [], {}, True, 1.5, "x", 7]
NOT_TEXT = [v for v in WRONG_TYPES if not isinstance(v, str)] + ["", "H100\nError: forged", "a\x1bb", "x" * 201]
NOT_COUNT = [-1, 1.5, "3", None, True, 2**70, [], {}]
NOT_TIME = [0, 0.0, -1.0, -1e-9, 1e-300, math.nan, math.inf, -math.inf, "1.0", None, True, [], {}]
NOT_OPTIONAL_TIME = [0, -1.0, 1e-300, math.inf, -math.inf, "1.0", None, True, []]
BAD_TILES = [7, 0, -16, 8, 512, 48, 64.0, "64", True, None, []]
BAD_WARPS = [0, 3, 32, -4, 4.0, "4", True, None]
BAD_STAGES = [0, 9, -1, 2.0, "2", True, None]
INVALID = {
    "gpu": NOT_TEXT, "triton_version": NOT_TEXT, "torch_version": NOT_TEXT, "template_hash": NOT_TEXT,
    "capability": NOT_TEXT + ["abc", "9", "9.0.1", "-1.5", "9.x"],
    "dtype": WRONG_TYPES + ["int8", "float64", "FLOAT16", "fp16", ""],
    "head_dim": [0, -1, 257, 10**30, 64.0, "64", True, None, []],
    "head_dim_v": [0, -64, 999, 2**63, 64.5, "64", False, None],
    "mask_variant": WRONG_TYPES + ["window", "", "none+causal", "causal+causal", "causal+window", "Causal"],
    "group_size": [0, -2, 1.0, "1", True, None, 2**70],
    "seqlen_q_bucket": [0, 8, 17, 1000, -16, 2**32, 64.0, "64", True, None],
    "seqlen_k_bucket": [0, 15, 24, 4095, -4096, 2**40, 4096.0, "4096", None],
    "fwd_ms": NOT_TIME, "fwd_bwd_ms": NOT_TIME,
    "bwd_ms": [-1.0, 0.0, 1e-300, math.nan, math.inf, "1", None, True, []],
    "tflops": [-1.0, 1e9, math.inf, "400", None, True, []],
    "sdpa_ms": NOT_OPTIONAL_TIME, "speedup": NOT_OPTIONAL_TIME,
    "sdpa_backend": [5, None, [], True, "cudnn\nforged line"],
    "batch": NOT_COUNT, "heads": NOT_COUNT, "seqlen_q": NOT_COUNT, "seqlen_k": NOT_COUNT, "trials": NOT_COUNT,
    "interpreted": [0, 1, "true", None, [], 2.0],
    "created_at": [5, None, [], True, "2999-01-01T00:00:00+00:00", "yesterday"],
}
CONFIG_INVALID = {"block_m": BAD_TILES, "block_n": BAD_TILES, "num_warps": BAD_WARPS, "num_stages": BAD_STAGES}


def mutate_config(rng: random.Random, config: dict) -> object:
    """A launch config the kernels cannot take: a field dropped, added or out of range, or not an object."""
    if not isinstance(config, dict) or not config:
        return rng.choice([None, [], "64x64/w4/s3", 64, True])
    config = dict(config)
    choice = rng.randrange(4)
    if choice == 0:
        del config[rng.choice(sorted(config))]
    elif choice == 1:
        config[rng.choice(["block_k", "warps", "", "BLOCK_M"])] = 1
    elif choice == 2:
        name = rng.choice(sorted(CONFIG_INVALID))
        config[name] = rng.choice(CONFIG_INVALID[name])
    else:
        return rng.choice([None, [], "64x64/w4/s3", 64, True])
    return config


def mutate_entry(rng: random.Random, row: dict) -> object:
    """An export's entry with one to three faults: a field deleted, added, wrongly typed or out of range."""
    row = copy.deepcopy(row)
    for _ in range(rng.randint(1, 3)):
        kind = rng.randrange(6)
        if kind == 0 and row:
            del row[rng.choice(sorted(row))]
        elif kind == 1:
            row[rng.choice(["extra", "block_m", "id", "Gpu"])] = rng.choice(WRONG_TYPES)
        elif kind == 2 and isinstance(row.get("fwd_config"), dict):
            row["fwd_config"] = mutate_config(rng, row["fwd_config"])
        elif kind == 3 and isinstance(row.get("bwd_config"), dict):
            bwd = row["bwd_config"]
            part = rng.choice(["dkdv", "dq", "both", "whole"])
            if part == "both" and bwd:
                del bwd[rng.choice(sorted(bwd))]
            elif part == "whole":
                row["bwd_config"] = rng.choice([{}, None, [], "dkdv", {"dkdv": None, "dq": None}])
            elif part in bwd:
                bwd[part] = mutate_config(rng, bwd[part])
        else:
            name = rng.choice(sorted(INVALID))
            row[name] = rng.choice(INVALID[name])
    return row if rng.random() > 0.03 else rng.choice([None, [], "entry", 3])


def malformed_export(rng: random.Random, good: dict) -> str:
    """The text of an export that must be refused as a whole."""
    entries = [copy.deepcopy(good), mutate_entry(rng, good)]
    rng.shuffle(entries)
    payload: object = {"fatune_tuned_db": SCHEMA_VERSION, "entries": entries}
    damage = rng.random()
    if damage < 0.05:
        payload = rng.choice([entries, 1, "fatune", None, {"entries": entries}, {"fatune_tuned_db": 1}])
    elif damage < 0.1:
        payload = {"fatune_tuned_db": rng.choice([2, 0, "1", True, None, 1.0]), "entries": [good]}
    elif damage < 0.15:
        payload = {"fatune_tuned_db": SCHEMA_VERSION, "entries": rng.choice([good, "x", None, 5])}
    text = json.dumps(payload)
    if rng.random() < 0.05:
        text = text[:rng.randrange(len(text))] if rng.random() < 0.5 else "[" * 100000
    return text


def test_fuzzed_exports_are_all_refused_by_db_import(tmp_path):
    target = tmp_path / "mine.sqlite"
    with TunedDB(target) as db:
        db.upsert(make_entry(fwd_bwd_ms=50.0))
        before = [asdict(e) for e in db.entries()]
    good = asdict(make_entry(fwd_bwd_ms=1.0))  # faster: importing it would change the DB
    rng = random.Random(1234)
    source = tmp_path / "export.json"
    for case in range(CASES):
        source.write_text(malformed_export(rng, good))
        result = CliRunner().invoke(cli, ["db", "import", "--db", str(target), str(source)])
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (case, source.read_text()[:500],
                                                                                     result.output)
        assert "Traceback" not in result.output and result.output.startswith("Error: "), (case, result.output)
    with TunedDB(target, readonly=True) as db:
        assert [asdict(e) for e in db.entries()] == before


# -- the dispatcher: fuzzed rows (past fatune's checks) and damaged files ------------------------

def _call():
    q = torch.randn(1, 2, 24, 16, device=DEVICE)
    return q, check_inputs(q, q, q)


SQLITE_INVALID = {  # values that stay invalid once stored (SQLite's column affinity may convert others), in
    # every column but those a call must match (a row that does not match is never looked at)
    "seqlen_q_bucket": [0, 8, 17, 1000, -16, 2**32, "abc"], "seqlen_k_bucket": [0, 24, 4095, "x"],
    "fwd_ms": [0.0, -1.0, 1e-300, None, math.inf, "fast"], "fwd_bwd_ms": [0.0, -3.0, 1e-7, None, -math.inf, "x"],
    "bwd_ms": [-1.0, 0.0, None, math.inf, "x"], "tflops": [-1.0, 1e9, math.inf, "x"],
    "sdpa_ms": [0.0, -1.0, 1e-300, math.inf, "x"],
    "trials": [-1, "x", 2.5], "interpreted": [2, -1, "yes"], "triton_version": [None, ""],
    "template_hash": [None, ""], "torch_version": [None, ""],
}


def _bad_row(rng: random.Random) -> dict:
    row = {}
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.5:
            name = rng.choice(sorted(SQLITE_INVALID))
            row[name] = rng.choice(SQLITE_INVALID[name])
        else:
            name = rng.choice(["fwd_config", "bwd_config"])
            value = {"fwd_config": make_entry().fwd_config, "bwd_config": make_entry().bwd_config}[name]
            if name == "bwd_config" and rng.random() < 0.5:
                value = {**value, rng.choice(["dkdv", "dq"]): mutate_config(rng, value["dkdv"])}
            elif name == "fwd_config":
                value = mutate_config(rng, value)
            else:
                value = rng.choice([{}, None, [], {"dkdv": value["dkdv"]}])
            row[name] = rng.choice([json.dumps(value), json.dumps(value)[:-1], "{", "null", ""])
    return row


def _call_key() -> dict:
    """The key columns of _call()'s problem on this GPU."""
    return {"gpu": GPU, "capability": CAPABILITY, "dtype": "float32", "head_dim": 16, "head_dim_v": 16,
            "mask_variant": "none", "seqlen_q_bucket": 32, "seqlen_k_bucket": 32}


def _shipped_16x16(tmp_path) -> Path:
    """A shipped DB whose one entry, of _call()'s key, runs 16x16 tiles: the layer a bad user DB falls back to."""
    tiles = {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1}
    shipped = tmp_path / "shipped.sqlite"
    export_entries([make_entry(**_call_key(), fwd_config=tiles, bwd_config={"dkdv": tiles, "dq": tiles})], shipped)
    return shipped


def test_fuzzed_rows_and_files_never_break_a_call(tmp_path, monkeypatch, caplog):
    q, problem = _call()
    match, shipped = _call_key(), _shipped_16x16(tmp_path)
    rng = random.Random(99)
    expected = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    for case in range(CASES // 3):
        user = tmp_path / f"user-{case}.sqlite"
        with caplog.at_level(logging.WARNING, logger="fatune"):
            if case % 3 == 2:  # a damaged file: bytes flipped or cut off
                with TunedDB(user, wal=False) as db:
                    db.upsert(make_entry(**match))
                data = bytearray(user.read_bytes())
                for _ in range(rng.randint(1, 20)):
                    data[rng.randrange(len(data))] = rng.randrange(256)
                user.write_bytes(bytes(data[:rng.randrange(len(data) + 1)] if rng.random() < 0.3 else data))
                decision = Dispatcher(user_db=user, shipped=[shipped]).lookup(problem, GPU, CAPABILITY, None)
                assert decision.layer in ("user-db", "shipped-db"), (case, decision)
            else:
                TunedDB(user).close()
                raw_insert(user, **{**match, **_bad_row(rng)})
                decision = Dispatcher(user_db=user, shipped=[shipped]).lookup(problem, GPU, CAPABILITY, None)
                assert decision.layer == "shipped-db" and decision.config.fwd.block_m == 16, (case, decision)
                assert any(str(user) in r.getMessage() for r in caplog.records), case
        if case < 4:  # and the call itself still gives the right result
            use_dispatcher(monkeypatch, Dispatcher(user_db=user, shipped=[shipped]))
            assert torch.allclose(fatune.attention(q, q, q), expected, atol=1e-5)


def test_a_forged_fast_entry_is_refused_by_db_import_and_skipped_by_the_dispatcher(tmp_path, caplog):
    """A time no GPU can measure would win every upsert (the faster entry stays), and every call of its key."""
    target = tmp_path / "mine.sqlite"
    with TunedDB(target) as db:
        db.upsert(make_entry(fwd_bwd_ms=50.0))
        before = [asdict(e) for e in db.entries()]
    for changes, named in (({"fwd_bwd_ms": 1e-300}, "fwd_bwd_ms"),
                           ({"batch": 8, "heads": 32, "seqlen_q": 4096, "seqlen_k": 4096, "fwd_ms": 0.01}, "fwd_ms")):
        source = tmp_path / "forged.json"
        source.write_text(json.dumps({"fatune_tuned_db": SCHEMA_VERSION, "entries": [asdict(make_entry(**changes))]}))
        result = CliRunner().invoke(cli, ["db", "import", "--db", str(target), str(source)])
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output
        assert result.output.startswith("Error: ") and f"entry 0: {named}: " in result.output, result.output
    with TunedDB(target, readonly=True) as db:
        assert [asdict(e) for e in db.entries()] == before
    q, problem = _call()
    match, shipped = _call_key(), _shipped_16x16(tmp_path)
    current = make_entry(**match).template_hash  # otherwise usable: current, of the call's key
    sized = {"batch": 1 << 16, "heads": 64, "seqlen_q": 32, "seqlen_k": 32, "fwd_ms": 0.01}  # 27 PFLOP/s
    for number, changes in enumerate(({"fwd_ms": 1e-300}, sized)):
        user = tmp_path / f"user-{number}.sqlite"
        TunedDB(user).close()
        raw_insert(user, **match, template_hash=current, **changes)
        with caplog.at_level(logging.WARNING, logger="fatune"):
            decision = Dispatcher(user_db=user, shipped=[shipped]).lookup(problem, GPU, CAPABILITY, None)
        assert decision.layer == "shipped-db" and decision.config.fwd.block_m == 16, decision
        logged = [r.getMessage() for r in caplog.records if str(user) in r.getMessage()]
        assert len(logged) == 1 and ": fwd_ms: " in logged[0], logged


# -- $FATUNE_DB naming no regular file: refused at once, never opened and waited on ------------------

NOT_REGULAR_CHILD = r"""
import json, logging, os, sys, torch
import fatune
from click.testing import CliRunner
from fatune.cli import cli
from fatune.runtime.dispatch import Dispatcher
from fatune.call import check_inputs

gpu, capability, device, shipped, source, *paths = sys.argv[1:]
logged = []
handler = logging.Handler()
handler.emit = lambda record: logged.append(record.getMessage())
logging.getLogger("fatune").addHandler(handler)
q = torch.randn(1, 2, 24, 16, device=device)
os.environ["FATUNE_DB"] = paths[0]
right = torch.allclose(fatune.attention(q, q, q), torch.nn.functional.scaled_dot_product_attention(q, q, q), atol=1e-5)
print(json.dumps({"path": paths[0], "call": "attention", "right": bool(right), "logged": logged[:]}), flush=True)
for path in paths:
    os.environ["FATUNE_DB"] = path
    logged.clear()
    decision = Dispatcher(shipped=[shipped]).lookup(check_inputs(q, q, q), gpu, capability, None)
    print(json.dumps({"path": path, "call": "dispatch", "layer": decision.layer, "block_m": decision.config.fwd.block_m,
                      "skipped": decision.skipped, "logged": logged[:]}), flush=True)
    for args in (["db", "list"], ["db", "import", source]):
        result = CliRunner().invoke(cli, args)
        print(json.dumps({"path": path, "call": " ".join(args[:2]), "exit_code": result.exit_code,
                          "output": result.output}), flush=True)
"""


def test_a_fatune_db_that_is_no_regular_file_costs_a_log_line_never_a_hang(tmp_path):
    """A FIFO would block SQLite (and open()) forever, waiting for a writer; a directory, device or socket is
    no DB either: the dispatcher falls to the next layer with one log line, `fatune db` says so on one line."""
    paths = not_regular_files(tmp_path)
    match = {"gpu": GPU, "capability": CAPABILITY, "dtype": "float32", "head_dim": 16, "head_dim_v": 16,
             "mask_variant": "none", "seqlen_q_bucket": 32, "seqlen_k_bucket": 32}
    tiles = {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1}
    shipped, source = tmp_path / "shipped.sqlite", tmp_path / "source.json"
    export_entries([make_entry(**match, fwd_config=tiles, bwd_config={"dkdv": tiles, "dq": tiles})], shipped)
    export_entries([make_entry()], source)
    results = run_child(NOT_REGULAR_CHILD, GPU, CAPABILITY, DEVICE, shipped, source, *paths.values())
    assert [r["call"] for r in results] == ["attention"] + ["dispatch", "db list", "db import"] * len(paths)
    for result in results:
        named = f"{result['path']} ($FATUNE_DB): "
        if result["call"] == "attention":  # the user DB fails, the shipped DBs have no entry: the heuristic's
            assert result["right"], result
            (line,) = [line for line in result["logged"] if named in line]
            assert "not a regular file" in line, result
        elif result["call"] == "dispatch":
            assert result["layer"] == "shipped-db" and result["block_m"] == 16, result
            (line,) = result["skipped"]
            assert named in line and "not a regular file" in line, result
            # logged once per process: the attention call logged the first path's line
            assert result["logged"] == ([] if result["path"] == results[0]["path"] else [line]), result
        else:
            assert result["exit_code"] == 1 and "Traceback" not in result["output"], result
            (line,) = result["output"].splitlines()
            assert line.startswith(f"Error: {named}") and "not a regular file" in line, result


# -- read-only deployments, for real: the child runs without root's permission override ----------

CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, PR_CAPBSET_DROP = 1, 2, 24


def _unprivileged() -> None:
    """preexec_fn: as root, drop the capabilities that ignore file permissions (the child then obeys
    chmod like any user); as another user there is nothing to drop."""
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
            if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                os._exit(77)


CHILD = r"""
import json, os, sys, torch
from click.testing import CliRunner
from fatune.cli import cli
from fatune.runtime.dispatch import Dispatcher
from fatune.call import check_inputs

deploy, work = sys.argv[1:]
if os.access(deploy, os.W_OK):
    sys.exit(77)  # permissions are not enforced here: nothing to test
out = {}
run = lambda *args: CliRunner().invoke(cli, [a.format(deploy=deploy, work=work) for a in args])
search = ["search", "--head-dim", "16", "--dtype", "fp16", "--interpret", "--lengths", "16", "--mask", "none",
          "--trials", "1"]
for name, args in {
    "list-exported": ["db", "list", "--db", "{deploy}/exported.sqlite"],
    "list-wal": ["db", "list", "--db", "{deploy}/wal.sqlite"],
    "which-wal": ["db", "which", "--head-dim", "64", "--seqlen", "4096", "--causal", "--gpu", "NVIDIA H200",
                  "--capability", "9.0", "--db", "{deploy}/wal.sqlite"],
    "import": ["db", "import", "--db", "{deploy}/exported.sqlite", "{work}/source.json"],
    "prune": ["db", "prune", "--all", "--db", "{deploy}/exported.sqlite"],
    "search": [*search, "--db", "{deploy}/exported.sqlite"],
    "export": ["db", "export", "--db", "{deploy}/exported.sqlite", "{deploy}/new.json"],
    "storage": [*search, "--db", "{work}/new.sqlite", "--storage", "sqlite:///{deploy}/studies.sqlite"],
}.items():
    result = run(*args)
    out[name] = [result.exit_code, result.output]
q = torch.empty(1, 16, 1, 64, dtype=torch.bfloat16).expand(1, 16, 4096, 64)
decision = Dispatcher(user_db=os.path.join(deploy, "unreadable.sqlite"),
                      shipped=[os.path.join(deploy, "exported.sqlite")]).lookup(
    check_inputs(q, q, q, is_causal=True), "NVIDIA H200", "9.0", (9, 0))
out["unreadable"] = [decision.layer, list(decision.skipped)]
print(json.dumps(out))
"""


def test_read_only_deployment_reads_and_refuses_writes_at_once(tmp_path):
    deploy, work = tmp_path / "deploy", tmp_path / "work"
    deploy.mkdir()
    work.mkdir()
    entries = [make_entry()]
    export_entries(entries, deploy / "exported.sqlite")
    export_entries(entries, work / "source.json")
    with TunedDB(deploy / "wal.sqlite") as db:  # WAL mode, as `fatune search` writes it
        db.upsert(make_entry())
    export_entries(entries, deploy / "unreadable.sqlite")
    for path in deploy.iterdir():
        path.chmod(0o000 if path.name == "unreadable.sqlite" else 0o444)
    deploy.chmod(0o555)
    before = sorted(p.name for p in deploy.iterdir())
    try:
        child = subprocess.run([sys.executable, "-c", CHILD, str(deploy), str(work)], capture_output=True, text=True,
                               timeout=300, preexec_fn=_unprivileged)
    finally:
        deploy.chmod(0o755)
    if child.returncode == 77:
        pytest.skip("cannot run a child that obeys file permissions here")
    assert child.returncode == 0, child.stderr[-3000:]
    out = json.loads(child.stdout.strip().splitlines()[-1])
    assert out["list-exported"][0] == 0 and "1 entries" in out["list-exported"][1]
    assert out["list-wal"][0] == 0 and "1 entries" in out["list-wal"][1]
    assert out["which-wal"][0] == 0 and "layer: user-db" in out["which-wal"][1]
    for name in ("import", "prune", "search", "export"):
        code, output = out[name]
        assert code == 1 and output.count("\n") == 1, (name, output)
        assert "read-only" in output or "Permission denied" in output, (name, output)
    assert out["storage"][0] == 2 and "--storage" in out["storage"][1]
    layer, skipped = out["unreadable"]
    assert layer == "shipped-db" and "unreadable.sqlite" in skipped[0] and "Permission denied" in skipped[0]
    assert sorted(p.name for p in deploy.iterdir()) == before  # nothing written, not even side files


# -- folders and cached files named by the environment ---------------------------------------------

NO_HOME_CHILD = """
import json, os, sys, torch
import fatune
from fatune.kernel import codegen
from fatune.tuning import compile_log

q, k, v = (torch.randn(1, 2, 33, 16, dtype=torch.float32, requires_grad=True) for _ in range(3))
out = fatune.attention(q, k, v, is_causal=True)
out.sum().backward()
reference = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
print(json.dumps({"error": (out.double() - reference).abs().max().item(), "cache": str(codegen.cache_dir()),
                  "log": str(compile_log.write("title", "text"))}))
"""


@pytest.mark.parametrize("variable", ["FATUNE_CACHE_DIR", "FATUNE_LOG_DIR", "XDG_CACHE_HOME"])
def test_a_folder_variable_naming_no_folder_falls_back_never_breaks_a_call(tmp_path, monkeypatch, variable):
    """'~user' of no user (Path.expanduser raises): the call runs and is right, its sources (with a warning) and a
    search's log go to a temporary folder. A relative XDG_CACHE_HOME is ignored, as the XDG spec says (~/.cache is
    used). Nothing lands in the working folder."""
    value = "~no-such-user-of-fatune/x" if variable != "XDG_CACHE_HOME" else "relative-cache"
    for name in ("FATUNE_CACHE_DIR", "FATUNE_LOG_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, value)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (result,) = run_child(NO_HOME_CHILD)
    assert result["error"] < 1e-4
    assert "~no-such-user" not in result["cache"] + result["log"] and not (tmp_path / "relative-cache").exists()
    assert not any(p.name.startswith("~") for p in tmp_path.iterdir())


def test_a_damaged_cached_source_is_written_again(tmp_path):
    """A cached kernel source that is not the rendered text (not even UTF-8) is replaced, not read as an error."""
    from fatune.kernel import codegen

    path = tmp_path / "attn_fwd_damaged.py"
    path.write_bytes(b"\xff\xfe")
    assert codegen._write_source(path, "x = 1\n") == path
    assert path.read_text() == "x = 1\n"
