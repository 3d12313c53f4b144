"""Which plan a call of fatune.attention runs, decided once per call signature.

A call's key holds every property that the argument checks, the dispatcher and the
kernels' specialisation read: shapes, strides, dtypes and devices of all tensors, the 16-byte
alignment of their data, the scalar options -- but no tensor values. The first call with a
key runs the full checks (fatune.call), asks the dispatcher for launch configs and builds
a `Plan` (fatune.kernel.triton.launch); later calls with that key are one dictionary lookup. The values of
seqlens_k / cu_seqlens are still checked on every call that passes them (a host read),
except under torch.compile and CUDA-graph capture, where the kernels clamp them.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from dataclasses import dataclass, field

import torch
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from fatune.call import Call, alignment_key, check_contents, check_flag, contents_readable, plan_key
from fatune.kernel import reference
from fatune.kernel.family import family
from fatune.kernel.layout import layout_like
from fatune.kernel.problem import NO_EXTRAS
from fatune.kernel.spec import AttentionConfig
from fatune.kernel.triton.launch import Plan, new_buffer
from fatune.logs import warn_once
from fatune.runtime import routes
from fatune.runtime.dispatch import Decision, dispatcher
from fatune.settings import STRICT_ENV, interpreting, strict_from_env

MAX_PLANS = 4096  # distinct call signatures kept per process (the cache starts over past this)


class FallbackError(RuntimeError):
    """Strict mode: fatune would have fallen back to another implementation."""


def strict_mode(strict: bool | None) -> bool:
    """The `strict` argument, or else $FATUNE_STRICT (1/true/yes/on)."""
    if check_flag("strict", strict, optional=True) is not None:
        return strict
    return strict_from_env()


@dataclass
class Prepared:
    """What a call signature runs: `plan` (the kernels), or `mode` 'empty', 'meta' or 'fallback'."""

    mode: str
    plan: Plan | None = None
    decision: Decision | None = None
    reason: str = ""
    lengths: tuple[int, int] = (0, 0)  # longest packed sequences (q, k) it was built for
    route: str = ""  # the torch SDPA backend an eager call runs instead of `plan` (fatune.runtime.routes)
    # how the route reaches its backend, without and with gradients (fatune.runtime.routes.paths)
    paths: tuple[str, str] = (routes.SWITCHED, routes.SWITCHED)
    alignment: tuple[int, int, int] = (0, 0, 0)  # of the tensors `plan` was built for (fatune.call.alignment_key)
    # whether a call without gradients runs `plan` rather than `route` (fatune.runtime.routes.host_bound)
    host_bound: bool = False
    # whether tuning on first use has had its say (fatune.tuning.first_use), or has none: a tuned entry decided
    settled: bool = True
    # the backend a route was left undecided for (fatune.runtime.routes.deferred): built again once it can decide
    route_deferred: str = ""
    # the routed output's layout (fatune.runtime.routes.output_layout), where there is a route
    out_layout: tuple = ()
    # a plain key's Prepared: those of its calls whose data is aligned otherwise than `alignment` (api.attention)
    aligned_otherwise: dict[tuple[int, int, int], Prepared] = field(default_factory=dict)


_BY_VALUES = Prepared("by-values")  # a cache entry saying: extend the key by the index tensors' values
_plans: dict[tuple, Prepared] = {}  # by plan_key, and prepare_plain's shorter keys (never equal to one)
_lock = threading.Lock()


def clear() -> None:
    """Forget every plan and dispatch decision (after the tuned DBs changed, say)."""
    with _lock:
        _plans.clear()
    dispatcher().clear()


def forget(prepared: Prepared) -> None:
    """Forget `prepared` under every key it is cached by (its next call builds its plan again)."""
    with _lock:
        for cache_key in [cache_key for cache_key, cached in _plans.items() if cached is prepared]:
            del _plans[cache_key]


def prepare(query, key, value, call: Call, config: AttentionConfig | None, strict: bool | None) -> Prepared:
    """The Prepared for this call: cached per plan key (fatune.call.plan_key), built (and fully checked) on the
    first call.

    With seqlens_k / cu_seqlens the values are checked on every call, and the longest packed
    sequences (which size the grid) extend the key.
    """
    try:
        base = plan_key(query, key, value, call, config, strict)
        prepared = _plans.get(base)
    except (TypeError, AttributeError, RuntimeError):  # odd arguments: the full checks say what is wrong
        return _build(query, key, value, call, config, strict)
    cache_key = base
    if prepared is _BY_VALUES:
        cache_key = base + _index_values(query, key, call)
        prepared = _plans.get(cache_key)
    if prepared is None:
        prepared = _build(query, key, value, call, config, strict)
        if prepared.mode != "fallback":
            with _lock:
                if len(_plans) >= MAX_PLANS:
                    _plans.clear()
                if call.seqlens_k is not None or call.cu_seqlens_q is not None:
                    _plans[base] = _BY_VALUES
                    cache_key = base + prepared.lengths
                _plans[cache_key] = prepared
    return prepared


def prepare_plain(query, key, value, dropout_p, is_causal, scale, enable_gqa, window_size, causal_alignment,
                  max_seqlen_q, max_seqlen_k, config: AttentionConfig | None, strict: bool | None) -> Prepared:
    """prepare() for a call without optional tensors (attn_mask, alibi_slopes, seqlens_k, cu_seqlens_q/k),
    the common call, without building its Call: looked up by a key holding what plan_key holds for
    such a call less the tensors' part (window_size as given; a list is not hashable and takes prepare()) and
    the data's alignment: its plan may have been built for another (Prepared.alignment; the caller compares).
    A key seen for the first time goes through prepare(), so its first call is fully checked. The keys share
    prepare()'s cache: a plan_key has more elements, so the two kinds never match each other.
    """
    try:  # the key, built flat on every such call (its host cost counts)
        base = (query.shape, query.stride(), query.dtype, query.device,
                key.shape, key.stride(), key.dtype, key.device,
                value.shape, value.stride(), value.dtype, value.device,
                type(dropout_p), dropout_p, type(is_causal), is_causal, type(scale), scale, type(enable_gqa),
                enable_gqa, window_size, causal_alignment, max_seqlen_q, max_seqlen_k, config, strict)
        prepared = _plans.get(base)
    except (TypeError, AttributeError, RuntimeError):  # odd arguments: prepare() deals with them
        base = prepared = None
    if prepared is None:
        call = Call(dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                    window_size=window_size, causal_alignment=causal_alignment, max_seqlen_q=max_seqlen_q,
                    max_seqlen_k=max_seqlen_k)
        prepared = prepare(query, key, value, call, config, strict)
        if base is not None and prepared.mode != "fallback":
            with _lock:
                if len(_plans) >= MAX_PLANS:
                    _plans.clear()
                _plans[base] = prepared
    return prepared


# Index tensors whose values were read and checked, by identity and version counter (what autograd relies on
# to see in-place writes): an unchanged tensor is not read again, so the layers of a model that share one
# cu_seqlens tensor cost one device-to-host copy (a sync of the GPU's queue) per step, not one per call.
# Only where a stale check cannot size a grid wrongly: seqlens_k (the kernels clamp its values), and packed
# sequences with max_seqlen_q/k given (they size the grid). A write the version counter does not see (through
# .data, a raw pointer, a CUDA-graph replay) then skips the values' check, never the grid's cover.
_checked: dict[tuple, tuple[tuple, tuple[int, int]]] = {}


def _index_values(query, key, call: Call) -> tuple[int, int]:
    """Check the seqlens_k / cu_seqlens values (a host read, unless these very tensors were checked and
    not written since); the longest packed sequences, for the key."""
    packed = call.cu_seqlens_q is not None
    tensors = [t for t in (call.seqlens_k, call.cu_seqlens_q, call.cu_seqlens_k) if t is not None]
    # a paged cache's keys: pages per sequence x page size (check_inputs has checked the table's shape)
    seqlen_k = key.shape[-2] * (call.block_table.shape[-1] if call.block_table is not None else 1)
    memo = None
    if contents_readable() and (not packed or (call.max_seqlen_q is not None and call.max_seqlen_k is not None)):
        try:
            memo = (*((id(t), t._version) for t in tensors), seqlen_k, query.shape[0], key.shape[0],
                    call.max_seqlen_q, call.max_seqlen_k)
        except RuntimeError:  # inference tensors have no version counter: read every time
            memo = None
    seen = _checked.get(memo) if memo is not None else None
    if seen is not None and all(ref() is t for ref, t in zip(seen[0], tensors)):
        return seen[1]
    lengths = check_contents(call.seqlens_k, seqlen_k, call.cu_seqlens_q, call.cu_seqlens_k,
                             query.shape[0] if packed else 0, key.shape[0] if packed else 0,
                             call.max_seqlen_q, call.max_seqlen_k)
    if memo is not None and all(t.device.type != "meta" for t in tensors):
        if len(_checked) >= MAX_PLANS:
            _checked.clear()
        _checked[memo] = (tuple(weakref.ref(t) for t in tensors), lengths)
    return lengths


def _build(query, key, value, call: Call, config: AttentionConfig | None, strict: bool | None) -> Prepared:
    strict = strict_mode(strict)  # $FATUNE_STRICT is read once per call signature
    problem = call.check(query, key, value)
    device = query.device
    lengths = (problem.max_seqlen_q, problem.max_seqlen_k) if problem.packed else (0, 0)
    if device.type == "meta":
        return Prepared("meta", reason="meta tensors: shapes only", lengths=lengths)
    if device.type != "cuda" and not interpreting():
        reason = f"{device.type} tensors need a CUDA GPU (or TRITON_INTERPRET=1)"
        if strict:
            raise FallbackError(f"fatune.attention would fall back to a dense torch implementation: {reason} "
                                f"(strict mode: strict=True or ${STRICT_ENV})")
        return Prepared("fallback", reason=reason)
    if problem.seqlen_q == 0 or problem.batch == 0 or problem.heads == 0 or problem.max_seqlen_k == 0:
        return Prepared("empty", reason="no keys or no queries", lengths=lengths)
    decision = dispatcher().decide(problem, device, config, strict)
    # strict mode promises the tuned entry or an error: no quiet fallback past it
    plan = family(decision.config.family).plan(problem, decision.config, device, query, key, value,
                                               None if strict else decision.fallback, decision.sources, strict)
    deferred = decision.route if routes.deferred(decision.route) else ""
    route = "" if deferred else routes.choose(decision.route, problem, query, key, value)
    paths = routes.paths(route, problem, query, key, value) if route else (routes.SWITCHED, routes.SWITCHED)
    # the entry's forward says nothing of a fallback config's kernels
    host_bound = bool(route) and not plan.build_failure and routes.host_bound(decision.entry, decision.margin, problem)
    return Prepared("kernels", plan, decision, decision.reason, lengths, route, paths, alignment_key(query, key, value),
                    settled=decision.layer != "heuristic", host_bound=host_bound, route_deferred=deferred,
                    out_layout=routes.output_layout(query, value) if route else ())


def traced_state() -> str:
    """What a route decided while tracing depends on besides the call (the tuned DBs on disk, $FATUNE_STRICT,
    fatune's version), as a short digest: an argument of the traced call (fatune.ops), so that torch.compile's
    on-disk caches, keyed by the graph, hand no process a route that its own state would not take."""
    from fatune import __version__

    state = f"{__version__}|{strict_from_env()}|{dispatcher().state()}"
    return hashlib.sha256(state.encode()).hexdigest()[:16]


def traced_route(query, key, value, call: Call, config: AttentionConfig | None, strict: bool | None,
                 state: str) -> tuple | None:
    """(backend, paths, output layout) of the SDPA backend a call traced by torch.compile or torch.export runs on
    instead of fatune's ops (fatune.runtime.routes), decided while tracing from the tuned DBs as they are now:
    the traced graph calls the backend as an eager routed call would. Only for sizes and strides the trace holds
    fixed: with symbolic ones (dynamic shapes) the decision would hold for every size, and fatune's ops decide per
    call when they run; and only where `state` is this process's traced_state() (a graph traced elsewhere or
    earlier, an exported program's say, says what another state decided). None: no route (a config argument,
    a call with optional tensors, autocast or deterministic algorithms on, no queries or keys, no tuned entry
    that routes, a backend that does not take these tensors; anything amiss, such as arguments the ops will
    refuse or a strict call without its tuned entry: the ops say so when the graph runs, as before)."""
    if config is not None or call.extras != NO_EXTRAS or not routes.taken(False, query, key, value):
        return None
    # the questions asked of these tensors are not the graph's: make_fx would record them
    with disable_proxy_modes_tracing():
        if not all(is_concrete_int(size) for t in (query, key, value) for size in (*t.shape, *t.stride())):
            _say_if_dynamic_sizes_lose_a_route(query, key, value, call)
            return None
        try:
            if state != traced_state():
                return None
            problem = call.check(query, key, value)
            if problem.seqlen_q == 0 or problem.batch == 0 or problem.heads == 0 or problem.max_seqlen_k == 0:
                return None
            decision = dispatcher().decide(problem, query.device, None, strict_mode(strict), fresh=True)
            backend = routes.choose(decision.route, problem, query, key, value)
            if not backend:
                return None
            return backend, routes.paths(backend, problem, query, key, value), routes.output_layout(query, value)
        except Exception:  # noqa: BLE001 - (a fake tensor on a GPU this host lacks, say) fatune's ops run, as before
            return None


def _say_if_dynamic_sizes_lose_a_route(query, key, value, call: Call) -> None:
    """One log line where torch.compile traced a call with symbolic sizes that would have been routed at the sizes
    of the example it was traced with: fatune's kernels run it at every size."""
    fake_mode = detect_fake_mode((query,))
    if fake_mode is None or not torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return
    try:
        def hint(size):
            return size if is_concrete_int(size) else size.node.hint  # (None for a size no example gave)

        with fake_mode:  # the example's sizes, on the tensors' device
            examples = [torch.empty_strided([hint(n) for n in t.shape], [hint(n) for n in t.stride()],
                                            dtype=t.dtype, device=t.device) for t in (query, key, value)]
        problem = call.check(*examples)
        decision = dispatcher().decide(problem, query.device)
        if not decision.route or routes.unroutable(decision.route, problem, *examples) is not None:
            return
    except Exception:  # noqa: BLE001 - a hint is all this is
        return
    warn_once(f"fatune: torch.compile traced a call with dynamic sizes, which runs fatune's kernels at every size; "
              f"a tuned entry routes calls of the sizes it was traced with to torch SDPA's {decision.route} backend, "
              f"measured {decision.margin:.2f}x faster. torch.compile(dynamic=False) keeps the routes")


def run_route(prepared: Prepared, query, key, value, dropout_p, is_causal, scale, enable_gqa) -> torch.Tensor | None:
    """The call on the torch SDPA backend its plan routes it to (fatune.runtime.routes.run); None: fatune's kernels
    run (where the backend's op raised, for this call signature from now on)."""
    try:
        return routes.run(prepared.route, query, key, value, dropout_p, is_causal, scale, enable_gqa, prepared.paths,
                          prepared.out_layout)
    except routes.Refused:
        prepared.route = ""
        return None


def dense_gradients(prepared: Prepared, query, key, value, call: Call, grad_out: torch.Tensor) -> tuple:
    """dQ, dK, dV of a call whose Prepared has no plan: its result recomputed and differentiated by torch.func.vjp,
    which also works inside the custom op's backward (where autograd's dispatch keys are excluded, and
    torch.autograd.grad would find nothing recorded)."""
    _, pullback = torch.func.vjp(lambda q, k, v: run_without_kernels(prepared, q, k, v, call), query, key, value)
    return pullback(grad_out)


def run_without_kernels(prepared: Prepared, query, key, value, call: Call) -> torch.Tensor:
    """The result of a call whose Prepared has no plan: empty, meta or the dense fallback."""
    if prepared.mode == "fallback":
        warn_once(f"fatune.attention falls back to a dense torch implementation: {prepared.reason}")
        problem = call.check(query, key, value)
        keep = None
        if problem.spec.dropout:
            shape = (problem.batch, problem.heads, problem.max_seqlen_q, problem.max_seqlen_k)
            keep = torch.rand(shape, device=query.device) >= problem.dropout_p
        return reference.attention(query, key, value, problem, precision="float32", dropout_keep=keep)
    out = new_buffer(*layout_like(query.shape, query.stride(), value.shape[-1]), query.dtype, query.device)
    if prepared.mode == "meta":
        return out
    if call.block_table is not None:  # a paged cache's pool is not this call's keys (nor differentiable)
        return out.zero_()
    # no keys anywhere: every row is a row that sees no key (0), still connected to the inputs through sums of
    # no elements (exactly 0 whatever the inputs hold: an inf times 0 would be NaN), whose gradients are 0
    return out.zero_() + (query[..., :0].sum() + key[..., :0].sum() + value[..., :0].sum())
