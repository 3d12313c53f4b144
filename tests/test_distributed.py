"""Many workers and hosts on one search, against a real PostgreSQL (pgserver), in the interpreter:
`--workers 2` on one host, two `fatune search` commands sharing one storage (two hosts, each
with its own DB), and a worker killed mid-trial while the other finishes the studies."""

from __future__ import annotations

import collections
import dataclasses
import json
import signal
import subprocess
import sys
import time
import uuid

import optuna
import pytest
import torch

from fatune.db import TunedDB
from fatune.kernel.triton.heuristics import default_config
from fatune.tuning.shape import Shape
from fatune.tuning.space import INTERPRETER_SPACE
from fatune.tuning.storage import normalise_url
from fatune.tuning.study import FINISHED
from tests.test_search import finish, interpreter_target, start_searches

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter searches: CPU only")
TRIALS = 4
SEARCH = ["search", "--head-dim", "16", "--dtype", "fp16", "--interpret", "--batch", "1", "--heads", "1",
          "--mask", "causal", "--trials", str(TRIALS)]
SHAPE = Shape(batch=1, heads=1, seqlen_q=32, seqlen_k=32, head_dim=16, dtype="float16", causal=True)


@pytest.fixture(scope="session")
def postgres(tmp_path_factory):
    """A PostgreSQL server for the session (pgserver runs it as its own user when we are root)."""
    import pgserver

    server = pgserver.get_server(tmp_path_factory.mktemp("postgres"), cleanup_mode="stop")
    yield server
    server.cleanup()


@pytest.fixture
def postgres_url(postgres) -> str:
    """A fresh database on the session's server, as the plain postgresql:// URL a user would give."""
    name = f"fatune_{uuid.uuid4().hex[:12]}"
    postgres.psql(f"CREATE DATABASE {name};")
    return postgres.get_uri(name)


def trials_by_study(url: str) -> dict[str, list[optuna.trial.FrozenTrial]]:
    """Each study's trials, by 'lq<seqlen_q>:<kernel>'."""
    url = normalise_url(url)
    return {":".join(s.study_name.split(":")[-4::3]): optuna.load_study(study_name=s.study_name, storage=url).trials
            for s in optuna.get_all_study_summaries(url)}


def check_studies(url: str, lengths: int, processes: int) -> dict[str, list[optuna.trial.FrozenTrial]]:
    """Every study has its trials, over-shooting by at most one per process, and ran the heuristic to
    the end exactly once (a trial of it that died is failed and retried)."""
    heuristic = default_config(SHAPE.spec, None)
    studies = trials_by_study(url)
    assert len(studies) == 3 * lengths
    for name, trials in studies.items():
        finished = [t for t in trials if t.state in FINISHED]
        assert TRIALS <= len(finished) <= TRIALS + processes, (name, [t.state for t in trials])
        kernel = name.split(":")[1]
        axes = INTERPRETER_SPACE.axes(kernel, SHAPE)
        start = {axis: value for axis, value in dataclasses.asdict(getattr(heuristic, kernel)).items() if axis in axes}
        queued = [t.state for t in trials if t.system_attrs.get("fixed_params") == start]
        assert [state for state in queued if state != optuna.trial.TrialState.FAIL] == \
            [optuna.trial.TrialState.COMPLETE], name
    return studies


def entries(db_path) -> dict[int, dict]:
    with TunedDB(db_path, readonly=True) as db:
        return {entry.seqlen_q_bucket: entry.attention_config().to_dict() for entry in db.entries()}


def test_workers_on_one_host_share_its_studies(tmp_path, postgres_url):
    db_path = tmp_path / "tuned.sqlite"
    run = subprocess.run([sys.executable, "-m", "fatune.cli", *SEARCH, "--lengths", "32,48", "--workers", "2",
                          "--storage", postgres_url, "--db", str(db_path), "--json"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(run.stdout)
    assert [row["trials"] >= 3 * TRIALS and row["trials_per_s"] > 0 for row in rows] == [True, True]
    studies = check_studies(postgres_url, lengths=2, processes=2)
    workers = collections.Counter(t.user_attrs["worker"] for trials in studies.values() for t in trials)
    assert len(workers) == 2, workers  # both processes ran trials
    assert entries(db_path) == {32: rows[0]["config"], 64: rows[1]["config"]}


def test_two_hosts_on_one_storage_both_store_the_winners(tmp_path, postgres_url):
    args = [*SEARCH, "--lengths", "32", "--storage", postgres_url]
    processes = [start_searches(tmp_path, [*args, "--db", str(tmp_path / f"host{i}.sqlite")])[0] for i in (1, 2)]
    results = [finish(process) for process in processes]
    assert [rc for rc, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    check_studies(postgres_url, lengths=1, processes=2)
    winners = entries(tmp_path / "host1.sqlite")
    assert list(winners) == [32] and entries(tmp_path / "host2.sqlite") == winners


def test_a_killed_worker_does_not_block_the_others(tmp_path, postgres_url):
    """One search dies (SIGKILL) in a dK/dV trial; the other finishes every study: the dead trial is
    failed once its heartbeat stops, and its config is run again."""
    args = [*SEARCH, "--lengths", "32", "--storage", postgres_url]
    (killed,) = start_searches(tmp_path, [*args, "--db", str(tmp_path / "killed.sqlite")], kill_in="dkdv",
                               signal_name="SIGKILL")
    (survivor,) = start_searches(tmp_path, [*args, "--db", str(tmp_path / "survivor.sqlite")])
    assert finish(killed)[0] == -signal.SIGKILL
    rc, _, err = finish(survivor)
    assert rc == 0, err[-2000:]
    studies = check_studies(postgres_url, lengths=1, processes=2)
    (dead,) = [t for t in studies["lq32:dkdv"] if t.state == optuna.trial.TrialState.FAIL]
    (retried,) = [t for t in studies["lq32:dkdv"] if t.system_attrs.get("failed_trial") == dead.number]
    assert retried.state in FINISHED and retried.params == dead.params
    assert list(entries(tmp_path / "survivor.sqlite")) == [32]


@pytest.mark.parametrize("look", range(1, 6))
def test_a_study_is_finished_only_when_a_look_finds_no_trial_held(postgres_url, monkeypatch, look):
    """Another process fails its trial (a repeated draw, told failed) and asks its next one between two of
    this process's looks at the study, at each point of this process's trials and wait: the study is
    finished only once one look finds the budget met and no trial held (the shape's winners are not
    measured, nor its trials counted, while another process still runs one)."""
    from fatune.tuning import study, trials
    from fatune.tuning.storage import open_storage
    from fatune.tuning.target import Stopwatch

    url = normalise_url(postgres_url)
    storage, other = open_storage(url), open_storage(url)
    target = interpreter_target()
    heuristic = trials.shape_heuristic(SHAPE, target)
    fwd = study.KernelSearch(target, SHAPE, "fwd", heuristic, INTERPRETER_SPACE, storage, seed=0, trials=2,
                             deadline=time.time() + 600)
    study_id = other.get_study_id_from_name(fwd.study.study_name)
    held = other.create_new_trial(study_id)  # the other process's draw: with the heuristic's, the budget of 2
    looks = 0
    census = study.KernelSearch.census

    def looking(self):
        nonlocal looks, held
        looks += 1
        if looks == look:
            other.set_trial_state_values(held, optuna.trial.TrialState.FAIL)
        elif looks == look + 1:
            held = other.create_new_trial(study_id)
        return census(self)

    monkeypatch.setattr(study.KernelSearch, "census", looking)
    clock = Stopwatch()
    fixture = trials.Fixture(SHAPE, target, 0, clock)
    assert not trials.run_trials([fwd], heuristic, fixture, poll=True, clock=clock)  # the other's trial is held
    assert other.get_trial(held).state == optuna.trial.TrialState.RUNNING
    monkeypatch.undo()
    other.set_trial_state_values(held, optuna.trial.TrialState.PRUNED)
    assert trials.run_trials([fwd], heuristic, fixture, poll=True, clock=clock)
    told = other.get_all_trials(study_id)
    assert sum(map(study.counts, told)) >= 2 and optuna.trial.TrialState.RUNNING not in [t.state for t in told]


@pytest.mark.parametrize("args, code, message", [
    (["--workers", "0"], 2, "--workers"),
    (["--compile-workers", "-1"], 2, "--compile-workers"),
    (["--storage", "postgresql://nobody@127.0.0.1:1/none"], 1, "cannot open Optuna storage"),
], ids=["no-workers", "negative-compile-workers", "unreachable-server"])
def test_bad_distributed_options_are_one_line(tmp_path, args, code, message):
    run = subprocess.run([sys.executable, "-m", "fatune.cli", *SEARCH, "--lengths", "32", "--db",
                          str(tmp_path / "t.sqlite"), *args], capture_output=True, text=True, timeout=120)
    assert run.returncode == code and message in run.stderr and "Traceback" not in run.stderr, run.stderr


@pytest.mark.parametrize("cores, workers, requested, interpret, expected", [
    (16, 1, None, False, 8),    # the H200 host: 8 compile processes beside the one that times
    (32, 2, None, False, 8),    # two GPUs, 16 cores each
    (4, 1, None, False, 3),     # a small host: the cores less the timing process
    (2, 2, None, False, 1),     # at least one
    (16, 1, 0, False, 0),       # asked for: as asked
    (16, 1, None, True, 0),     # the interpreter compiles nothing
])
def test_compile_workers_default_to_the_cores_per_worker_less_one(monkeypatch, cores, workers, requested, interpret,
                                                                   expected):
    from fatune.tuning import workers as hosts

    monkeypatch.setattr(hosts.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert hosts.compile_worker_count(requested, workers, interpret) == expected


HELPER = """
import sys, time
from pathlib import Path

import optuna

from fatune.tuning import space, study
from fatune.tuning.shape import Shape
from fatune.tuning.workers import Job, _helper

folder, url = Path(sys.argv[1]), sys.argv[2]
evaluate = study.KernelSearch.evaluate


def holding(self, trial, *args):  # the first trial of the first shape waits until the owner is on the second
    if self.shape.seqlen_q == 32 and not (folder / "held").exists():
        (folder / "held").touch()
        deadline = time.monotonic() + 120
        while not (folder / "owner-on-48").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return evaluate(self, trial, *args)


study.KernelSearch.evaluate = holding
shapes = tuple(Shape(batch=1, heads=1, seqlen_q=length, seqlen_k=length, head_dim=16, dtype="float16", causal=True,
                     kv_heads=1) for length in (32, 48))
_helper(Job(shapes, int(sys.argv[3]), 600.0, url, 0, space.INTERPRETER_SPACE, True, 0), 1, None)
"""


def test_the_owner_starts_the_next_shape_while_others_hold_trials(tmp_path, postgres_url, monkeypatch):
    """A helper holds a trial of the first shape until the owner has started the second shape's trials:
    the owner does not wait for a shape's studies before the next shape's trials, and still measures and
    stores every shape's winners, in order, once their studies are done."""
    from click.testing import CliRunner

    from fatune.cli import cli
    from fatune.tuning import search

    url = normalise_url(postgres_url)
    helper = subprocess.Popen([sys.executable, "-c", HELPER, str(tmp_path), url, str(TRIALS)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "held").exists():
        assert helper.poll() is None and time.monotonic() < deadline, helper.communicate()[1][-2000:]
        time.sleep(0.05)

    events = []
    ask, measure = search.KernelSearch.ask, search.measure_shape

    def asking(self, *args, **kwargs):
        events.append(("ask", self.shape.seqlen_q))
        if self.shape.seqlen_q == 48:
            (tmp_path / "owner-on-48").touch()
        return ask(self, *args, **kwargs)

    def measuring(run, *args, **kwargs):
        events.append(("measure", run.shape.seqlen_q))
        return measure(run, *args, **kwargs)

    monkeypatch.setattr(search.KernelSearch, "ask", asking)
    monkeypatch.setattr(search, "measure_shape", measuring)
    db_path = tmp_path / "tuned.sqlite"
    result = CliRunner().invoke(cli, [*SEARCH, "--lengths", "32,48", "--storage", postgres_url, "--db", str(db_path),
                                      "--workers", "1", "--json"])
    _, err = helper.communicate(timeout=300)
    assert result.exit_code == 0, result.output[-3000:]
    assert helper.returncode == 0, err[-2000:]
    assert events.index(("ask", 48)) < events.index(("measure", 32)) < events.index(("measure", 48))
    rows = json.loads(result.output[result.output.index("["):])
    assert [row["shape"] for row in rows] == [SHAPE.label(), SHAPE.with_(seqlen_q=48, seqlen_k=48).label()]
    for row in rows:  # each shape's time, its trials' in the first pass and its measurement's, adds up
        assert sum(row["breakdown"].values()) == pytest.approx(row["seconds"] + row["breakdown"]["db"], rel=1e-3)
    studies = check_studies(postgres_url, lengths=2, processes=2)
    held = min((t for t in studies["lq32:fwd"] if t.user_attrs["worker"].endswith(f":{helper.pid}")),
               key=lambda t: t.number)  # the helper's first trial, which it held
    assert held.state in FINISHED and held.datetime_complete > min(t.datetime_start for t in studies["lq48:fwd"])
    assert entries(db_path) == {32: rows[0]["config"], 64: rows[1]["config"]}
