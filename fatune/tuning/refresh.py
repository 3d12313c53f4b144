"""Refreshing a tuned DB after the kernels changed, without searching again.

A template edit (an accuracy fix, say) changes the kernels every entry was measured with, so every entry
goes stale (fatune.db.is_stale) and the dispatcher falls back to the heuristic. Refreshing an entry times
its stored configs again with today's kernels, beside the heuristic's, on the problem the entry was
measured on, checks both against torch, and writes back the faster under today's kernel hash: seconds
per entry, where a new search takes minutes. It does not look for new configs: a change that moves the
best config needs `fatune search`.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

import fatune
from fatune.db import CallKey, Entry, TunedDB, is_stale, key_columns
from fatune.kernel.spec import AttentionConfig
from fatune.kernel.family import family
from fatune.tuning.precompile import CompilePool, compile_error
from fatune.tuning.search import _interpreted_step, sdpa_best
from fatune.tuning.shape import Shape, make_inputs, shape_key
from fatune.tuning.study import forward_only
from fatune.tuning.target import Checker
from fatune.tuning.timing import KernelRunner, tflops, time_forward, time_training_step
from fatune.tuning.trials import shape_heuristic

# the sizes a key does not store, rebuilt as `fatune search` draws them by default (first tried first)
PADDED_KEYS = (0.25,)  # --valid-keys
PACKED_DOCUMENTS = (5, 2, 16, 64)  # --documents
# the mask-variant parts a searched shape can have (an arbitrary mask, ALiBi or dropout never is one)
SEARCHED_PARTS = {"causal", "window-left", "bottom-right", "seqlens-k", "varlen"}
MAX_ELEMENTS = 1 << 32  # per input tensor: a rebuilt problem larger than this is not timed (8 GiB in 16 bits)
UNBUILT = "skipped: its problem cannot be rebuilt from its sizes and key (or is too large to time)"


@dataclass(frozen=True)
class Refreshed:
    """What refreshing one entry did. `outcome`: 'tuned' (its configs stay, re-timed), 'heuristic' (the
    heuristic's configs were faster or the stored ones failed: they take the entry's place), 'current' (not
    stale), 'superseded' (a current entry of the key it would be written under stays; the stale row goes),
    or 'skipped: why'."""

    old: Entry
    outcome: str
    new: Entry | None = None  # the entry written (or, in a dry run, that would be timed): None if skipped
    shape: Shape | None = None
    tuned_ms: float = math.nan
    heuristic_ms: float = math.nan
    note: str = ""

    def describe(self) -> str:
        timing = ""
        if math.isfinite(self.tuned_ms) or math.isfinite(self.heuristic_ms):
            timing = f" (stored configs {self.tuned_ms:.3f} ms, heuristic {self.heuristic_ms:.3f} ms)"
        shape = f" on {self.shape.label()}" if self.shape else ""
        return f"{self.old.describe()}: {self.outcome}{timing}{shape}{f'; {self.note}' if self.note else ''}"


def entry_key(entry: Entry) -> CallKey:
    return CallKey(*(getattr(entry, field.name) for field in dataclasses.fields(CallKey)))


def entry_shape(entry: Entry) -> Shape | None:
    """The problem `entry` was measured on, from its stored batch, heads and lengths and its key: a window at
    the width its key stores (the bucket a search at that width gets), key padding and packed documents at
    `fatune search`'s defaults (the entry does not store them). The first such shape whose key is the entry's;
    None if there is none (a mask variant no search produces, sizes that do not fit the key)."""
    parts = set(entry.mask_variant.split("+")) - {"none"}
    if not parts <= SEARCHED_PARTS or entry.group_size < 1 or entry.heads % entry.group_size or \
            min(entry.batch, entry.heads, entry.seqlen_q, entry.seqlen_k) < 1:
        return None
    causal = "causal" in parts
    windows = [-1]
    if "window-left" in parts:  # widths narrower than the keys first: a wider one masks nothing past causal
        widths = (entry.seqlen_k_bucket, min(entry.seqlen_k_bucket, entry.seqlen_k - 1), entry.seqlen_k_bucket // 2 + 1)
        windows = sorted(dict.fromkeys(w for w in widths if w >= 0), key=lambda w: w >= entry.seqlen_k)
    elif causal and "bottom-right" in parts:  # a window no narrower than the keys: only its alignment stays
        windows.append(entry.seqlen_q + entry.seqlen_k)
    kept = PADDED_KEYS if "seqlens-k" in parts else (1.0,)
    documents = PACKED_DOCUMENTS if "varlen" in parts else (0,)
    lengths = [(entry.seqlen_q, entry.seqlen_k)]
    if entry.seqlen_q == entry.seqlen_k > 1:
        # a bottom-right key timed at equal lengths (before they took the plain call's key, which is the same
        # mask there): one query fewer keeps the alignment, and the bucket or no shape is found
        lengths.append((entry.seqlen_q - 1, entry.seqlen_k))
    key = entry_key(entry)
    for (seqlen_q, seqlen_k), window, valid_keys, count in itertools.product(lengths, windows, kept, documents):
        try:
            shape = Shape(entry.batch, entry.heads, seqlen_q, seqlen_k, entry.head_dim, entry.dtype,
                          causal=causal, kv_heads=entry.heads // entry.group_size, head_dim_v=entry.head_dim_v,
                          window=window, valid_keys=valid_keys, documents=count)
            if shape_key(shape) == key and max(math.prod(size) for size in shape.input_sizes().values()) \
                    <= MAX_ELEMENTS:
                return shape
        except (ValueError, RuntimeError):  # sizes these inputs cannot have
            continue
    return None


def _check(shape: Shape, config: AttentionConfig, inputs: dict[str, torch.Tensor], checker, backward: bool) -> str:
    """Why `config` is not usable on `shape` (it does not compile or launch, or its output or gradients are
    wrong against torch, outputs poisoned first), or ''."""

    try:
        runner = KernelRunner(shape, config, inputs)
        runner.args.out.fill_(math.nan)
        runner.prepare()
        kernels = ("fwd", "dkdv") if backward else ("fwd",)
        if backward:
            for name in ("grad_q", "grad_k", "grad_v"):
                getattr(runner.args, name).fill_(math.nan)
            runner.run("bwd")()
        if inputs["q"].is_cuda:
            torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - compile errors, OutOfResources, launch failures
        return f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
    for kernel in kernels:
        error = checker.error(kernel, runner)
        if not error <= checker.tolerance:
            return f"{kernel} relative error {error:.3g} > {checker.tolerance}"
    return ""


def _time(shape: Shape, config: AttentionConfig, inputs: dict[str, torch.Tensor], target,
          backward: bool) -> tuple[float, dict[str, float]]:
    """One timing of `config` as a user's call runs it: the training step through autograd (the forward alone
    for a forward-only entry), as `fatune search` times its winners."""

    kwargs = shape.attention_kwargs(target.device)
    if target.interpret:
        step = _interpreted_step(shape, config, inputs, backward=backward)
    else:
        timer = time_training_step if backward else time_forward
        step = timer(lambda q, k, v: fatune.attention(q, k, v, config=config, **kwargs), inputs)
    for name in ("q", "k", "v"):
        inputs[name].grad = None
    return step["fwd_bwd_ms" if backward else "fwd_ms"], step


def refresh_entry(entry: Entry, target, *, rounds: int = 3, seed: int = 0,
                  compiled: Callable[[], None] = lambda: None) -> Refreshed:
    """Time `entry`'s configs and the heuristic's alternately, `rounds` times each (medians), on the problem
    it was measured on, and build the entry to write: the faster of the two that pass the check, with
    today's kernel hash and the timings of this run. `compiled()` waits for a compile pool's work."""

    shape = entry_shape(entry)
    if shape is None:
        return Refreshed(entry, UNBUILT)
    backward = not forward_only(shape)
    tuned = entry.attention_config()
    heuristic = shape_heuristic(shape, target)
    compiled()
    inputs = make_inputs(shape, target.device, seed)
    checker = Checker(shape, inputs, backward=backward)
    failures = {name: _check(shape, config, inputs, checker, backward)
                for name, config in (("tuned", tuned), ("heuristic", heuristic))}
    candidates = {name: config for name, config in (("tuned", tuned), ("heuristic", heuristic))
                  if not failures[name]}
    if not candidates:
        return Refreshed(entry, "skipped: neither its configs nor the heuristic's pass the check", shape=shape,
                         note=f"stored configs: {failures['tuned']}; heuristic: {failures['heuristic']}")
    times: dict[str, list[float]] = {name: [] for name in candidates}
    steps: dict[str, list[dict]] = {name: [] for name in candidates}
    for _ in range(max(1, rounds)):
        for name, config in candidates.items():
            ms, step = _time(shape, config, inputs, target, backward)
            times[name].append(ms)
            steps[name].append(step)
    medians = {name: statistics.median(values) for name, values in times.items()}
    winner = min(medians, key=lambda name: (medians[name], name != "tuned"))  # a tie keeps the stored configs
    config = candidates[winner]
    best = min(steps[winner], key=lambda step: abs(step["fwd_bwd_ms" if backward else "fwd_ms"] - medians[winner]))
    columns = key_columns(target.gpu, target.capability, entry_key(entry),
                          family(config.family).kernel_hashes(shape.spec, config, shape.heads > shape.kv_heads))
    # SDPA's stored timing holds for the same GPU and torch on the same problem (all of it stored in the entry);
    # elsewhere a problem the entry stores whole times torch's backends again (another GPU's entry adopted here:
    # a route to one of them is decided by this GPU's timings)
    same_gpu = (entry.gpu, entry.capability) == (target.gpu, target.capability)
    same_sdpa = entry.torch_version == columns["torch_version"] and entry.sized and same_gpu
    sdpa_backend, sdpa_ms = (entry.sdpa_backend, entry.sdpa_ms) if same_sdpa else ("", math.nan)
    if not same_sdpa and entry.sized:
        sdpa_backend, sdpa_ms = sdpa_best(shape, inputs, target)
    time_ms = best["fwd_bwd_ms" if backward else "fwd_ms"]
    new = dataclasses.replace(
        entry, **columns,
        fwd_config=config.fwd.to_dict(),
        bwd_config={"dkdv": config.dkdv.to_dict(), "dq": config.dq.to_dict()},
        fwd_ms=best["fwd_ms"], bwd_ms=best["bwd_ms"], fwd_bwd_ms=best["fwd_bwd_ms"],
        tflops=_measured(tflops(shape, "fwd+bwd" if backward else "fwd", time_ms)),
        sdpa_backend=sdpa_backend if math.isfinite(sdpa_ms) else "", sdpa_ms=_measured(sdpa_ms),
        speedup=_measured(sdpa_ms / time_ms) if time_ms > 0 else math.nan,
        interpreted=target.interpret, created_at="")
    note = f"the stored configs failed: {failures['tuned']}" if failures["tuned"] else ""
    return Refreshed(entry, winner, new, shape, medians.get("tuned", math.nan), medians.get("heuristic", math.nan),
                     note)


def _measured(value: float) -> float:
    return value if math.isfinite(value) and value > 0 else math.nan


def refreshable(entry: Entry, target, current_too: bool = False, adopt: bool = False) -> str:
    """Why `entry` is not refreshed on `target`, or '' (a stale entry tuned on this GPU, or with `current_too`
    any of its entries; with `adopt` every entry tuned on another GPU; any GPU's with no target, as a dry run on a
    machine without one says)."""
    if target is None and adopt:  # a dry run without the GPU: each entry may be another GPU's
        return ""
    if target is not None and (entry.gpu, entry.capability) != (target.gpu, target.capability):
        return "" if adopt else f"skipped: tuned on {entry.gpu} (sm {entry.capability}); refresh it there"
    if not current_too and not is_stale(entry):
        return "current"
    return ""


def refresh_db(db: TunedDB, target, *, rounds: int = 3, dry_run: bool = False, compile_workers: int = 0,
               current_too: bool = False, adopt: bool = False, on_invalid: Callable[[str], None] | None = None,
               **filters) -> Iterator[Refreshed]:
    """Refresh every stale entry of `db` (matching `filters`: gpu, dtype, head_dim, mask_variant, group_size)
    tuned on `target`'s GPU, and with `current_too` its current ones too (re-timed beside today's heuristic,
    e.g. after the heuristic changed), one at a time, yielding what each came to; written as each finishes
    (an interrupted run keeps what it refreshed). The entry a refresh writes replaces the stale one, unless a
    current entry of its key is already there (a search since): that one stays and the stale row goes. With
    `adopt`, entries tuned on other GPUs are re-timed too and written as `target`'s (their rows replaced): a DB for
    a new GPU, seeded from another GPU's grid. An entry that cannot be timed (its problem too large, a failure) is
    skipped with the reason; invalid rows go to `on_invalid`.
    `dry_run`: only rebuild each entry's problem and say what would be timed (`target` may then be None: no GPU
    here). `compile_workers`: processes compiling the next entries' kernels while one is timed."""
    if target is None and not dry_run:
        raise ValueError("target: expected the GPU (or interpreter) to time on; only a dry run takes None")
    entries = list(db.entries(on_invalid=on_invalid or (lambda message: None), **filters))
    plans: list[tuple[Entry, str]] = [(entry, refreshable(entry, target, current_too, adopt)) for entry in entries]
    work = [entry for entry, reason in plans if not reason]
    timed_on_gpu = not dry_run and not target.interpret
    futures: dict[int, list] = {}
    with CompilePool(compile_workers if timed_on_gpu else 0, "cuda" if timed_on_gpu else "cpu") as pool:
        if pool.processes:

            for entry in work:
                shape = entry_shape(entry)
                if shape is not None:
                    kinds = ("fwd",) if entry.forward_only else ("fwd", "dkdv")
                    futures[id(entry)] = [pool.submit(shape, config, kind)
                                          for config in (entry.attention_config(), shape_heuristic(shape, target))
                                          for kind in kinds]
        for entry, reason in plans:
            if reason:
                yield Refreshed(entry, reason)
            elif dry_run:
                shape = entry_shape(entry)
                yield Refreshed(entry, "would refresh" if shape else UNBUILT, shape=shape)
            else:
                yield _refresh_and_write(db, entry, target, rounds, futures.get(id(entry), []))


# the outcomes of an entry a refresh dealt with: re-timed, or dropped for a current entry of its key
DONE = ("tuned", "heuristic", "superseded")


def none_refreshed(results: list[Refreshed], current_too: bool = False, adopt: bool = False) -> str:
    """Why a refresh that had entries to re-time (the stale ones, any GPU's; with `current_too` or `adopt` all) dealt
    with none of them: each one skipped (tuned on another GPU, no driver, a problem that cannot be rebuilt) or
    failed, counted by outcome, most first; '' if it dealt with one or had none. Not for a dry run's results."""
    if any(result.outcome in DONE for result in results):
        return ""
    pending = collections.Counter(result.outcome for result in results
                                  if result.outcome != "current" and (current_too or adopt or is_stale(result.old)))
    if not pending:
        return ""
    total = sum(pending.values())
    return f"re-timed none of the {total} {'entry' if total == 1 else 'entries'} to refresh: " + \
        " | ".join(f"{count} {outcome}" for outcome, count in pending.most_common())


def _refresh_and_write(db: TunedDB, entry: Entry, target, rounds: int, pending: list) -> Refreshed:
    new_key = tuple(key_columns(target.gpu, target.capability, entry_key(entry), "").values())  # KEY_COLUMNS order
    if _others_current(db, new_key, entry):
        with db.transaction():
            db.delete_in_transaction([entry], exact=True)
        return Refreshed(entry, "superseded", note="a current entry of its key stays; this entry's row was dropped")
    try:
        result = refresh_entry(entry, target, rounds=rounds,
                               compiled=lambda: [compile_error(future) for future in pending])
    except Exception as error:  # noqa: BLE001 - an untrusted entry costs its own refresh, never the run
        if isinstance(error, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
        return Refreshed(entry, f"skipped: {type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}")
    if result.new is None:
        return result
    with db.transaction():
        if _others_current(db, result.new.key(), entry):  # written by a search while this entry was timed
            db.delete_in_transaction([entry], exact=True)
            return dataclasses.replace(result, outcome="superseded", new=None,
                                       note="a current entry of its key was written meanwhile; it stays")
        db.upsert_in_transaction(result.new, keep_faster=False)
        if result.new.key() != entry.key():  # timed under another torch version: a key of its own
            db.delete_in_transaction([entry], exact=True)
    return result


def _others_current(db: TunedDB, key: tuple, entry: Entry) -> bool:
    """Whether a current entry other than `entry` (a current entry refreshed with `current_too`) holds `key`."""
    return any((other.key(), other.created_at) != (entry.key(), entry.created_at) for other in db.current(key))
