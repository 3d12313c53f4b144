"""Choose the launch config for a call, and say why.

Layers, most specific first: the `config` argument; the user's tuned DB ($FATUNE_DB, else
~/.cache/fatune/tuned.sqlite); the tuned DBs shipped in fatune/tuned_db for this GPU; a
built-in heuristic. fatune.db owns the key: an entry must match the GPU, dtype, head dims,
mask variant and GQA group; the nearest sequence-length bucket (log scale) of the call's regime
(decode or prefill, fatune.db.nearest) wins. A DB or
entry that cannot be used (unreadable, corrupt, foreign, stale, invalid) is skipped with
one log line naming the file and the reason, and the nearest usable entry of the file, else the next
layer, answers; strict mode raises DispatchError instead.

The first call for a key reads the DBs; later calls for the same key are a dictionary
lookup (a per-process memo, filled under a lock).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fatune.db import CallKey, DBError, Entry, TunedDB, default_path, label, problem_key
from fatune.db.store import shipped_dbs
from fatune.hardware import Arch, device_arch, device_identity, sm_count
from fatune.kernel.family import builtin_choice, builtin_config
from fatune.kernel.problem import AttentionProblem
from fatune.kernel.spec import AttentionConfig
from fatune.kernel.triton.heuristics import decode_shares
from fatune.logs import warn_once

log = logging.getLogger("fatune")
LAYERS = ("argument", "user-db", "shipped-db", "heuristic")


class DispatchError(RuntimeError):
    """Strict mode: no usable tuned entry for this call, and falling back is not allowed."""


@dataclass(frozen=True)
class Decision:
    """Which config a call uses, from which layer, and why (what fatune.explain returns)."""

    config: AttentionConfig
    layer: str
    reason: str
    db_path: str | None = None
    entry: dict | None = field(default=None, hash=False, compare=False)
    skipped: tuple[str, ...] = ()  # entries passed over, and why
    # the config that runs instead if this one's kernels cannot be built on this GPU, or are not the ones a tuned
    # entry measured (fatune.kernel.triton.launch: KernelBuildError, StaleKernels; an untrusted DB costs speed,
    # never the call): the heuristic's, for a tuned entry and the heuristic alike (where it is the config that
    # failed, Plan.fall_back runs its tiles unpipelined); None: no fallback
    fallback: AttentionConfig | None = field(default=None, compare=False)
    # a tuned entry's kernel sources (fatune.db.entry.Entry.sources), which the launched kernels must be among
    sources: frozenset[str] | None = field(default=None, compare=False)
    # the torch SDPA backend the entry measured faster than fatune's kernels ("" if none: fatune.db.entry.Entry.route),
    # and by how much (fatune's time over the backend's)
    route: str = ""
    margin: float = 1.0

    def describe(self) -> str:
        lines = [f"layer: {self.layer}", f"reason: {self.reason}"]
        if self.db_path:
            lines.append(f"db: {self.db_path}")
        if self.route:
            lines.append(f"route: torch SDPA's {self.route} backend, measured {self.margin:.2f}x faster than "
                         f"fatune's kernels (which run where it cannot)")
        lines.append(f"config: {self.config}")
        lines += [f"skipped: {line}" for line in self.skipped]
        return "\n".join(lines)


class Dispatcher:
    """Looks configs up through the layers; one instance per process (see `dispatcher()`).

    A DB problem (unreadable, corrupt, foreign, stale or invalid file or entry) never raises:
    it is logged once per process and the next layer answers. In strict mode the call raises
    DispatchError instead of falling past it.
    """

    def __init__(self, user_db: Path | None = None, shipped: list[Path] | None = None):
        self.user_db = user_db
        self.shipped = shipped
        self._memo: dict[tuple, tuple[Decision, str | None]] = {}
        self._lock = threading.Lock()

    def decide(self, problem: AttentionProblem, device: torch.device, config: AttentionConfig | None = None,
               strict: bool = False, fresh: bool = False) -> Decision:
        """The decision for `problem` on `device`, memoised per call key (`fresh`: read from the DBs as they are now,
        neither from nor into the memo, which keeps what the process saw first)."""
        if config is not None:
            if not isinstance(config, AttentionConfig):
                raise TypeError(f"config: expected a fatune.AttentionConfig or None, got {type(config).__name__}")
            return Decision(config, "argument", "config passed to fatune.attention")
        call = problem_key(problem)
        # the decode heuristic depends on how many programs the call's tiles give each multiprocessor, and the
        # built-in config on which kernels it takes (batch, heads, exact lengths), which its key does not say
        key = (device, call, decode_shares(problem, sm_count(device)),
               builtin_choice(problem, device_arch(device), sm_count(device)))
        found = self._lookup(problem, *device_identity(device), device_arch(device), sm_count(device)) if fresh \
            else self._memo.get(key)
        if found is None:
            with self._lock:
                found = self._memo.get(key)
                if found is None:
                    found = self._lookup(problem, *device_identity(device), device_arch(device), sm_count(device))
                    self._memo[key] = found
        decision, trouble = found
        if strict and (decision.layer == "heuristic" or trouble):
            why = f"a tuned DB could not be used ({trouble})" if trouble else "no tuned entry"
            raise DispatchError(f"{why} for {problem.spec.mask_variant} {problem.spec.dtype} d{problem.spec.head_dim} "
                                f"on {device_identity(device)[0]} (strict mode: strict=True or $FATUNE_STRICT); "
                                f"run `fatune search` for this shape or fix the DB\n{decision.describe()}")
        return decision

    def lookup(self, problem: AttentionProblem, gpu: str, capability: str, arch: Arch | None,
               sms: int | None = None) -> Decision:
        """The decision for `problem` on the GPU named `gpu` of compute capability `arch` and `sms`
        multiprocessors (None: unknown; no memo, `decide` memoises)."""
        return self._lookup(problem, gpu, capability, arch, sms)[0]

    def _lookup(self, problem: AttentionProblem, gpu: str, capability: str, arch: Arch | None,
                sms: int | None) -> tuple[Decision, str | None]:
        """The decision, and the first DB problem met on the way (None if there was none)."""
        skipped: list[str] = []

        def report(message: str) -> None:
            warn_once(message)
            skipped.append(message)

        key = problem_key(problem)
        heuristic = builtin_config(problem, arch, sms)
        for layer, paths in self._layers(report):
            for path in paths:
                try:
                    found = self._search_file(path, gpu, capability, key, report)
                except Exception as error:  # noqa: BLE001 - any DB problem costs speed, never the call
                    reason = str(error) if isinstance(error, DBError) else f"{label(path)}: {error!r}"
                    report(f"fatune: ignoring tuned DB {reason}")
                    continue
                if found is not None:
                    entry, reason = found
                    route = entry.route()
                    return (Decision(entry.attention_config(), layer, reason, str(path), entry.to_row(),
                                     tuple(skipped), heuristic, entry.sources, route,
                                     entry.time_ms / entry.sdpa_ms if route else 1.0),
                            skipped[0] if skipped else None)
        return (Decision(heuristic, "heuristic", f"no tuned entry matched; built-in heuristic for {f'sm {arch}' if arch else 'no GPU'}", None,
                         None, tuple(skipped), heuristic), skipped[0] if skipped else None)

    def _layers(self, report) -> list[tuple[str, list[Path]]]:
        user = self.user_db
        if user is None:
            try:
                user = default_path()
            except DBError as error:
                report(f"fatune: ignoring tuned DB {error}")
        return [("user-db", [user] if user is not None else []),
                ("shipped-db", self.shipped if self.shipped is not None else shipped_dbs())]

    def state(self) -> str:
        """The tuned DBs this dispatcher reads, as they are on disk now (each file's size and modification time,
        its write-ahead log's too): what a decision taken now depends on besides the call."""
        files = []
        for _, paths in self._layers(lambda message: None):
            for path in paths:
                for name in (str(path), f"{path}-wal"):
                    try:
                        stat = os.stat(name)
                    except (OSError, ValueError):
                        stat = None
                    # (an empty log, which a reader may create, says what no log says)
                    files.append(f"{name}:{stat.st_size}:{stat.st_mtime_ns}" if stat and stat.st_size else f"{name}:-")
        return "|".join(files)

    @staticmethod
    def _search_file(path: Path, gpu: str, capability: str, key: CallKey, report) -> tuple[Entry, str] | None:
        if not os.path.lexists(path):
            return None  # no DB there (yet): nothing to say
        with TunedDB(path, readonly=True) as db:
            return db.match(gpu, capability, key, report)

    def clear(self) -> None:
        with self._lock:
            self._memo.clear()


_dispatcher = Dispatcher()


def dispatcher() -> Dispatcher:
    return _dispatcher


def choose_config(problem: AttentionProblem, device: torch.device, config: AttentionConfig | None,
                  strict: bool = False) -> AttentionConfig:
    """The config to launch `problem` with on `device`."""
    return _dispatcher.decide(problem, device, config, strict).config
