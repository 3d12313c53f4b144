"""Tuning on first use (opt-in: `fatune.autotune(True)` or FATUNE_AUTOTUNE=1), as
`torch.backends.cudnn.benchmark` does for convolutions.

The first eager call of a key that no tuned DB answers (the dispatcher's heuristic layer) times a short list on
random inputs of its shape: the built-in config of each kernel family that serves the call, and each torch SDPA
backend that can run it as fatune would (fatune.runtime.routes). The winner goes into the user's tuned DB as an
entry like a search's (fatune's faster config, SDPA's best backend and both times), so this call, later calls
and later processes run it. A training call (inputs requiring grad) is timed as a training step, any other as
a forward. Timings use short budgets (TIMING_MS); compiles are reported apart.

It never runs while torch.compile traces or a CUDA graph captures, nor in Triton's interpreter; each key at most
once per process. Only calls without mask or index tensors, windows or dropout are tuned (a search covers
those). A failure (a DB that cannot be written, a candidate that does not build) is one log line; the call
goes on with what the dispatcher chose.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Callable

import torch

from fatune.call import Call
from fatune.db import TunedDB, default_path
from fatune.kernel.family import FAMILIES, builtin_config
from fatune.kernel.problem import AttentionProblem
from fatune.logs import warn_once
from fatune.runtime import plans, routes
from fatune.settings import AUTOTUNE_ENV, interpreting, switch
from fatune.tuning.competitors import sdpa
from fatune.tuning.shape import Shape, make_inputs, shape_key
from fatune.tuning.target import Target
from fatune.tuning.timing import time_forward, time_step_only, time_training_step

log = logging.getLogger("fatune")
TIMING_MS = (3, 15)  # warm-up and timed milliseconds per candidate (triton.testing.do_bench)
TUNED_VARIANTS = ("none", "causal", "causal+bottom-right")

_enabled: bool | None = None  # None: $FATUNE_AUTOTUNE decides
_tried: set[tuple] = set()
_lock = threading.Lock()


def autotune(enabled: bool = True) -> None:
    """Tune each new key on its first eager call (see fatune.tuning.first_use); False turns it off again,
    whatever $FATUNE_AUTOTUNE says."""
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected True or False, got {enabled!r:.80}")
    _enabled = enabled
    plans.clear()  # every call signature decides again


def enabled() -> bool:
    return switch(AUTOTUNE_ENV) if _enabled is None else _enabled


def tune_call(prepared: plans.Prepared, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, training: bool,
              attend: Callable[..., torch.Tensor]) -> bool:
    """Tune a call the dispatcher had no tuned entry for (`prepared`, its heuristic's), if autotuning is on and
    the call is an eager one on a GPU; True if a winner was stored (prepare the call again). Decided once per
    call signature (`prepared.settled`), but asked again after a call under torch.compile or a CUDA graph."""
    if not enabled() or query.device.type != "cuda" or interpreting() or prepared.plan is None:
        prepared.settled = True
        return False
    if not _quiet_moment():
        return False
    prepared.settled = True
    return tune(prepared.plan.problem, query, key, value, training, attend)


def _quiet_moment() -> bool:
    """Whether timing now would stay the tuner's business: not while torch.compile or torch.jit traces, a CUDA
    graph captures, or a torch dispatch mode (a FLOP counter, fake tensors) watches every op."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or torch.cuda.is_current_stream_capturing():
        return False
    try:
        from torch.utils._python_dispatch import is_in_torch_dispatch_mode

        return not is_in_torch_dispatch_mode()
    except ImportError:  # another torch: no dispatch mode to ask about
        return True


def shape_of(problem: AttentionProblem) -> Shape | None:
    """The Shape of a call first-use tuning covers (TUNED_VARIANTS); None for any other."""
    spec = problem.spec
    if spec.mask_variant not in TUNED_VARIANTS or problem.packed:
        return None
    return Shape(problem.batch, problem.heads, problem.seqlen_q, problem.seqlen_k, spec.head_dim, spec.dtype,
                 causal=spec.causal, kv_heads=problem.kv_heads, head_dim_v=spec.head_dim_v,
                 bottom_right=spec.bottom_right)


def tune(problem: AttentionProblem, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, training: bool,
         attend: Callable[..., torch.Tensor]) -> bool:
    """Time the candidates for `problem` (fatune's through `attend`, fatune.attention) and store the winner in the
    user DB; True if it stored one (the caller prepares the call again). At most once per key and process."""
    shape = shape_of(problem)
    if shape is None:
        return False
    memo = (query.device, shape_key(shape), training)  # the DB's key: one attempt per key, whatever its lengths
    with _lock:
        if memo in _tried:
            return False
        _tried.add(memo)
    try:
        # the user's saved-tensor hooks (activation checkpointing, offloading) must not see the timed steps
        with torch.autograd.graph.saved_tensors_hooks(lambda tensor: tensor, lambda tensor: tensor):
            return _tune(shape, problem, query, key, value, training, attend)
    except Exception as error:  # noqa: BLE001 - tuning may fail; the call it was for must not
        warn_once(f"fatune: tuning on first use failed ({type(error).__name__}: {error}); built-in configs run "
                  f"where no tuned entry answers")
        return False


def _tune(shape: Shape, problem: AttentionProblem, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          training: bool, attend: Callable[..., torch.Tensor]) -> bool:
    from fatune.tuning.search import ShapeResult, to_entry  # the search's entry format (and Optuna): when tuning

    started = time.perf_counter()
    target = Target.detect(interpret=False)
    device = query.device
    timer = time_training_step if training else time_forward
    kwargs = shape.attention_kwargs(device)
    inputs = make_inputs(shape, device, seed=0)
    configs = {builtin_config(problem, target.arch_or_none, target.sms)} | {
        family.heuristic(problem, target.arch_or_none, target.sms) for family in FAMILIES.values()
        if family.serves(problem.spec, device) is None}
    timed, compile_s = [], 0.0
    candidates_started = time.perf_counter()
    for config in configs:
        try:
            times = timer(lambda q, k, v, c=config: attend(q, k, v, config=c, **kwargs), inputs, *TIMING_MS)
        except Exception as error:  # noqa: BLE001 - a config that does not build here is not a candidate
            log.info("fatune: first-use candidate %s does not run here: %s", config, error)
            continue
        compile_s += times["compile_s"]
        plan = plans.prepare(inputs["q"], inputs["k"], inputs["v"], Call(**kwargs), config, None).plan
        if plan is not None and plan.build_failure:  # another config ran in its place: its time is not this one's
            log.info("fatune: first-use candidate %s does not run here: %s", config, plan.build_failure)
            continue
        timed.append((times["fwd_bwd_ms" if training else "fwd_ms"], times, config))
    if not timed:
        return False
    best_ms, best_times, best = min(timed, key=lambda item: item[0])
    backends_started = time.perf_counter()
    backend, sdpa_ms = "", math.nan
    for name in routes.BACKENDS:
        if routes.unroutable(name, problem, query, key, value) is not None:
            continue
        runner = sdpa(name, shape)
        try:
            times = time_step_only(runner, inputs, *TIMING_MS) if training else time_forward(runner, inputs, *TIMING_MS)
        except Exception:  # noqa: BLE001 - a backend that fails here is not a candidate
            continue
        compile_s += times["compile_s"]  # its first call builds the backend's plan (cuDNN's graphs)
        ms = times["fwd_bwd_ms" if training else "fwd_ms"]
        if not ms >= sdpa_ms:  # the first, or faster
            backend, sdpa_ms = name, ms
    backends_done = time.perf_counter()
    result = ShapeResult(shape, best, {}, best_times["fwd_ms"], best_times["bwd_ms"], best_times["fwd_bwd_ms"],
                         trials=len(timed) + (backend != ""), sdpa_backend=backend, sdpa_ms=sdpa_ms)
    entry = to_entry(result, target)
    path = default_path()
    with TunedDB(path) as db:
        db.upsert(entry)
    plans.clear()
    runs = f"torch SDPA's {backend} backend" if entry.route() else f"fatune {best}"
    # where the time went: builds and first calls, then the timings of fatune's candidates and of SDPA's backends
    # (builds apart), and the rest (inputs, the entry, the DB)
    total = time.perf_counter() - started
    candidates_s, backends_s = backends_started - candidates_started, backends_done - backends_started
    warn_once(f"fatune: tuned {shape.label()} on first use in {total:.2f} s (compiles {compile_s:.2f} s; timing "
              f"fatune's configs ({len(timed)}) and SDPA's backends {candidates_s + backends_s - compile_s:.2f} s, "
              f"the rest {total - candidates_s - backends_s:.2f} s): {runs} ({best_ms:.3f} ms against SDPA's best "
              f"{sdpa_ms:.3f} ms); stored in {path}")
    return True
