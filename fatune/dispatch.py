"""Choose the launch config for a call, and say why.

Layers, most specific first: the `config` argument; the user's tuned DB ($FATUNE_DB, else
~/.cache/fatune/tuned.sqlite); the tuned DBs shipped in fatune/tuned_db for this GPU; a
built-in heuristic. A DB entry must match the GPU, dtype, head dims, mask variant and GQA
group; the nearest sequence-length bucket (log scale) wins. Entries measured with another
Triton version or template hash are skipped, with one log line saying so.

The first call for a key reads the DBs; later calls for the same key are a dictionary
lookup (a per-process memo, filled under a lock).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fatune.heuristics import Arch, default_config
from fatune.inputs import AttentionProblem
from fatune.spec import AttentionConfig

log = logging.getLogger("fatune")
LAYERS = ("argument", "user-db", "shipped-db", "heuristic")


class DispatchError(RuntimeError):
    """Strict mode: no tuned entry for this call, and falling back to the heuristic is not allowed."""


@dataclass(frozen=True)
class Decision:
    """Which config a call uses, from which layer, and why (what fatune.explain returns)."""

    config: AttentionConfig
    layer: str
    reason: str
    db_path: str | None = None
    entry: dict | None = field(default=None, hash=False, compare=False)
    skipped: tuple[str, ...] = ()  # entries passed over, and why

    def describe(self) -> str:
        lines = [f"layer: {self.layer}", f"reason: {self.reason}"]
        if self.db_path:
            lines.append(f"db: {self.db_path}")
        lines.append(f"config: fwd {self.config.fwd} | dkdv {self.config.dkdv} | dq {self.config.dq}")
        lines += [f"skipped: {line}" for line in self.skipped]
        return "\n".join(lines)


@functools.lru_cache(maxsize=None)
def device_arch(device: torch.device) -> Arch | None:
    """Compute capability of a CUDA device; None for the Triton interpreter on CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def device_identity(device: torch.device) -> tuple[str, str]:
    """(GPU name, 'major.minor') as the tuned DB records them."""
    if device.type != "cuda":
        return "triton-interpreter", "cpu"
    props = torch.cuda.get_device_properties(device)
    return props.name, f"{props.major}.{props.minor}"


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def shipped_dbs() -> list[Path]:
    """The tuned DBs installed with the package (fatune/tuned_db, or tuned_db/ in a checkout)."""
    here = Path(__file__).resolve().parent
    for folder in (here / "tuned_db", here.parent / "tuned_db"):
        if folder.is_dir():
            return sorted(folder.glob("*.sqlite"))
    return []


def _user_db() -> Path:
    from fatune.db import default_path

    return default_path()


class Dispatcher:
    """Looks configs up through the layers; one instance per process (see `dispatcher()`)."""

    def __init__(self, user_db: Path | None = None, shipped: list[Path] | None = None):
        self.user_db = user_db
        self.shipped = shipped
        self._memo: dict[tuple, Decision] = {}
        self._lock = threading.Lock()
        self._warned: set[str] = set()

    def _key(self, problem: AttentionProblem, device: torch.device) -> tuple:
        from fatune.db import seqlen_bucket

        return (device, problem.spec, problem.group_size, seqlen_bucket(problem.max_seqlen_q),
                seqlen_bucket(problem.max_seqlen_k))

    def decide(self, problem: AttentionProblem, device: torch.device, config: AttentionConfig | None = None,
               strict: bool = False) -> Decision:
        if config is not None:
            if not isinstance(config, AttentionConfig):
                raise TypeError(f"config: expected a fatune.AttentionConfig or None, got {type(config).__name__}")
            return Decision(config, "argument", "config passed to fatune.attention")
        key = self._key(problem, device)
        decision = self._memo.get(key)
        if decision is None:
            with self._lock:
                decision = self._memo.get(key)
                if decision is None:
                    decision = self.lookup(problem, *device_identity(device), device_arch(device))
                    self._memo[key] = decision
        if strict and decision.layer == "heuristic":
            raise DispatchError(f"no tuned entry for {problem.spec.mask_variant} {problem.spec.dtype} "
                                f"d{problem.spec.head_dim} on {device_identity(device)[0]} (strict mode: strict=True "
                                f"or $FATUNE_STRICT); run `fatune search` for this shape\n{decision.describe()}")
        return decision

    def lookup(self, problem: AttentionProblem, gpu: str, capability: str, arch: Arch | None) -> Decision:
        """The decision for `problem` on the GPU named `gpu` (no memo; `decide` memoises)."""
        skipped: list[str] = []
        user = self.user_db if self.user_db is not None else _user_db()
        for layer, paths in (("user-db", [user]), ("shipped-db", self.shipped if self.shipped is not None
                                                    else shipped_dbs())):
            for path in paths:
                found = self._search_file(path, problem, gpu, capability, skipped)
                if found is not None:
                    entry, reason = found
                    return Decision(entry.attention_config(), layer, reason, str(path), entry.to_row(),
                                    tuple(skipped))
        return Decision(default_config(problem.spec, arch), "heuristic",
                        f"no tuned entry matched; built-in heuristic for sm {arch}", None, None, tuple(skipped))

    def _search_file(self, path: Path, problem: AttentionProblem, gpu: str, capability: str, skipped: list[str]):
        import triton

        from fatune import codegen
        from fatune.db import DBError, TunedDB, seqlen_bucket

        if not path.exists():
            return None
        try:
            db = TunedDB(path, readonly=True)
        except DBError as error:
            self._warn(f"fatune: ignoring tuned DB {error}")
            skipped.append(str(error))
            return None
        spec = problem.spec
        try:
            candidates = list(db.entries(gpu=gpu, capability=capability, dtype=spec.dtype, head_dim=spec.head_dim,
                                         head_dim_v=spec.head_dim_v, mask_variant=spec.mask_variant,
                                         group_size=problem.group_size))
        finally:
            db.close()
        usable = []
        for entry in candidates:
            stale = []
            if entry.triton_version != triton.__version__:
                stale.append(f"Triton {entry.triton_version} (running {triton.__version__})")
            if entry.template_hash != codegen.template_hash():
                stale.append(f"templates {entry.template_hash} (running {codegen.template_hash()})")
            if stale:
                message = f"{path}: entries tuned with {' and '.join(stale)} are not used; run `fatune search` again"
                self._warn(message)
                skipped.append(message)
                continue
            usable.append(entry)
        if not usable:
            return None
        want_q, want_k = seqlen_bucket(problem.max_seqlen_q), seqlen_bucket(problem.max_seqlen_k)

        def distance(entry) -> float:
            return abs(math.log2(entry.seqlen_q_bucket / want_q)) + abs(math.log2(entry.seqlen_k_bucket / want_k))

        best = min(usable, key=lambda e: (distance(e), e.fwd_bwd_ms))
        if distance(best) == 0:
            reason = f"exact bucket Lq<={want_q}, Lk<={want_k}"
        else:
            reason = (f"nearest bucket Lq<={best.seqlen_q_bucket}, Lk<={best.seqlen_k_bucket} "
                      f"(call: Lq<={want_q}, Lk<={want_k})")
        return best, f"tuned entry, {reason}"

    def _warn(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            log.warning(message)

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
