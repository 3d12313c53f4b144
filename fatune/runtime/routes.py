"""Calls routed whole to one of torch SDPA's backends, where a tuned entry measured that backend faster.

A search times torch's best SDPA backend beside fatune's winners on the same inputs and stores both in the
entry (its `sdpa_backend`, `sdpa_ms`). Where that backend was faster (fatune.db.entry.Entry.route), the call's
forward and backward run on it, through torch's own autograd: fatune is then never slower than the call it
replaced. A route is taken only where SDPA computes exactly what fatune would:

- no mask tensor, no ALiBi, window, key lengths, packed or paged inputs, and causal (if at all) aligned
  top-left (SDPA's is_causal): the mask variants "none" and "causal", with dropout or without;
- an eager call, or one traced by torch.compile or torch.export with fixed sizes (decided while tracing:
  fatune.runtime.plans.traced_route; torch.func transforms run fatune's kernels), not under autocast nor with
  deterministic algorithms on (fatune's kernels then take their deterministic paths; the backends' do not all);
- on a GPU whose torch has the backend and takes these tensors (torch.backends.cuda.can_use_*).

Anywhere else fatune's kernels run, said once per reason. How a routed call reaches its backend is decided when
its plan is built, apart for calls with gradients and without (`paths`): SDPA as it is, where SDPA picks that
backend itself for such tensors; else the backend's own op, as SDPA calls it once it has chosen it; else (a torch
without that op) SDPA with torch's switches of the other backends turned off around the call, which costs the most
host time and flips switches that are the process's. The output takes the layout fatune's kernels give it (the
query's), copied where the backend's differs. A backend that raises on a call hands its call signature to
fatune's kernels for good, said once; running out of memory, a failed device or an error during CUDA-graph capture
is the caller's to know.
A call without gradients so small that its time is the host's runs fatune's kernels, whose launch costs the host
less than any route (`host_bound`), except while a CUDA graph captures it (a replay costs no host time).
"""

from __future__ import annotations

import contextlib
import math
import threading

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fatune.db.entry import ROUTABLE_VARIANTS
from fatune.kernel.layout import layout_like
from fatune.kernel.problem import AttentionProblem
from fatune.logs import warn_once

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}
_CAN_USE = {"cudnn": "can_use_cudnn_attention", "flash": "can_use_flash_attention",
            "efficient": "can_use_efficient_attention"}


def unroutable(backend: str, problem: AttentionProblem, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor) -> str | None:
    """Why the call `problem` on these tensors cannot run on SDPA's `backend` as fatune would run it (None:
    it can)."""
    if backend not in BACKENDS:
        return f"torch SDPA has no backend {backend!r} (expected one of {sorted(BACKENDS)})"
    spec = problem.spec
    if spec.mask_variant not in ROUTABLE_VARIANTS or problem.alibi_slopes is not None:
        return f"SDPA does not compute the {spec.mask_variant} variant as fatune does"
    if query.device.type != "cuda":
        return f"SDPA's {backend} backend runs on CUDA GPUs"
    try:
        usable = _takes(backend, problem, query, key, value)
    except (RuntimeError, TypeError) as error:
        return f"SDPA's {backend} backend: {error}"
    if usable is None:
        return f"this torch ({torch.__version__}) cannot say whether SDPA's {backend} backend takes a call"
    return None if usable else f"SDPA's {backend} backend does not take these tensors here"


def _takes(backend: str, problem: AttentionProblem, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           grad: bool | None = None) -> bool | None:
    """Whether SDPA's `backend` takes these tensors (with `grad`: as if they required gradients or not); None where
    this torch cannot say."""
    can_use = getattr(torch.backends.cuda, _CAN_USE[backend], None)
    params = getattr(torch.backends.cuda, "SDPAParams", None)
    if can_use is None or params is None:
        return None
    if grad is not None:
        query, key, value = (t.detach().requires_grad_(grad) for t in (query, key, value))
    with _all_switched_on():  # (torch's can_use_* refuse a backend switched off: a plan built in sdpa_kernel, say)
        return can_use(params(query, key, value, None, problem.dropout_p, problem.spec.causal, problem.group_size > 1))


def _flash_op(op):
    def call(query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, return_debug_mask, *, scale):
        return op(query, key, value, dropout_p, is_causal, False, scale=scale)  # its log-sum-exp always
    return call


def _efficient_op(op):
    def call(query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, return_debug_mask, *, scale):
        return op(query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, scale=scale)
    return call


# the backends' own ops, called as SDPA calls them once it has chosen the backend (those this torch has), each
# with cuDNN's op's arguments; their outputs' first is the attention's
_OPS = {name: wrap(op) for name, op, wrap in (
    ("cudnn", getattr(torch, "_scaled_dot_product_cudnn_attention", None), lambda op: op),
    ("flash", getattr(torch, "_scaled_dot_product_flash_attention", None), _flash_op),
    ("efficient", getattr(torch, "_scaled_dot_product_efficient_attention", None), _efficient_op)) if op is not None}
_sdpa_choice = getattr(torch, "_fused_sdp_choice", None)  # the backend SDPA picks for a call (an SDPBackend value)

# whether autocast is on for any device (no route then: see `run`)
autocasting = getattr(torch._C, "_is_any_autocast_enabled", None) or (
    lambda: torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu"))

# How a routed call reaches its backend (`paths`, `run`)
SDPA = "sdpa"  # SDPA as it is: it picks the backend itself
OP = "op"  # the backend's own op
SWITCHED = "switched"  # SDPA with the other backends switched off
KERNELS = "kernels"  # none: the backend's op does not take such tensors (nor would SDPA): fatune's kernels run
# A call without gradients whose forward is predicted this short on the GPU, with little GPU time at stake, is
# host-bound: its time is the host's, and a routed call costs the host more than fatune's own launch (measured on an
# H100, B1 H8 L128 D64 causal bf16: 21.3 us a routed forward, 17.5 us fatune's kernels, 16.4 us SDPA). Calls with
# gradients keep the route at any size: there torch's C++ autograd costs the host less than fatune's Function does
# (131 against 152 us a training step, same shape). The prediction scales the entry's measured forward by the work,
# which underestimates the smallest problems (a launch's fixed cost): they count as host-bound all the more.
HOST_BOUND_US = 10.0  # fatune's forward, predicted
AT_STAKE_US = 1.0  # the GPU time the route would save, predicted from the margin it was measured faster by


def host_bound(entry: dict | None, margin: float, problem: AttentionProblem) -> bool:
    """Whether a call of `problem` without gradients is host-bound: fatune's forward predicted under HOST_BOUND_US,
    and under AT_STAKE_US of it saved by a route `margin` times faster (fatune's time over the backend's). The
    forward is the tuned `entry`'s (a DB row: untrusted) scaled by the scores computed (batch x heads x queries x
    keys) from the problem it timed to this one. False where the entry cannot say."""
    if not isinstance(entry, dict):
        return False
    sizes = [entry.get(name) for name in ("batch", "heads", "seqlen_q", "seqlen_k")]
    forward_ms = entry.get("fwd_ms")
    if not all(type(size) is int and size > 0 for size in sizes) or \
            type(forward_ms) is not float or not 0 < forward_ms < math.inf or not 1 <= margin < math.inf:
        return False
    timed = sizes[0] * sizes[1] * sizes[2] * sizes[3]
    work = problem.batch * problem.heads * problem.max_seqlen_q * problem.max_seqlen_k
    forward_us = forward_ms * 1e3 * work / timed
    return forward_us < HOST_BOUND_US and forward_us * (1 - 1 / margin) < AT_STAKE_US


def paths(backend: str, problem: AttentionProblem, query: torch.Tensor, key: torch.Tensor,
          value: torch.Tensor) -> tuple[str, str]:
    """How a call routed to `backend` reaches it, for a call without gradients and one with (which the call's key
    does not say): SDPA as it is where SDPA, with every backend switched on (torch's defaults), picks `backend`
    itself for such tensors; else the backend's op where it exists and takes them; else fatune's kernels where
    the op exists (SDPA would refuse such tensors too); else SDPA switched (see `run`). Inference tensors cannot
    require gradients: a call with them says nothing of one that does, which takes SDPA switched."""
    def path(grad: bool) -> str:
        try:
            tensors = tuple(t.detach().requires_grad_(grad) for t in (query, key, value))
            with torch.set_grad_enabled(grad):  # SDPA asks both: a plan may be built under no_grad
                if _default_choice(problem, *tensors) == int(BACKENDS[backend]):
                    return SDPA
                if backend not in _OPS:
                    return SWITCHED
                takes = _takes(backend, problem, *tensors)
                return OP if takes else KERNELS if takes is False else SWITCHED  # (None: SDPA decides per call)
        except (RuntimeError, TypeError):
            return SWITCHED

    return path(False), path(True)


def _default_choice(problem: AttentionProblem, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor) -> int | None:
    """The backend (an SDPBackend value) SDPA picks for these tensors with all its backends switched on, whatever
    the switches are now (a plan built inside the caller's sdpa_kernel context, say); None where this torch
    cannot say."""
    if _sdpa_choice is None or not _ALL_SWITCHES:
        return None
    with _all_switched_on():
        try:
            return _sdpa_choice(query, key, value, None, problem.dropout_p, problem.spec.causal,
                                scale=problem.scale, enable_gqa=problem.group_size > 1)
        except TypeError:  # another signature: the backend's op may still serve
            return None


@contextlib.contextmanager
def _all_switched_on():
    """torch's SDPA backends all switched on (its defaults) for a plan's questions to SDPA, as they were after.
    The switches are the process's: another thread's SDPA call meanwhile sees them on (once per new plan)."""
    with _switching:
        before = [(setter, getter()) for getter, setter in _SWITCHES.values()]
        try:
            for _, setter in _SWITCHES.values():
                setter(True)
            yield
        finally:
            for setter, enabled in before:
                setter(enabled)


def choose(backend: str, problem: AttentionProblem, query: torch.Tensor, key: torch.Tensor,
           value: torch.Tensor) -> str:
    """`backend` if the call can be routed to it, else "" (fatune's kernels), the reason logged once."""
    if not backend:
        return ""
    reason = unroutable(backend, problem, query, key, value)
    if reason is None:
        return backend
    warn_once(f"fatune: a tuned entry measured torch SDPA's {backend} backend faster, but {reason}: fatune's "
              f"kernels run")
    return ""


# torch's switches of its SDPA backends, (getter, setter) by backend (those this torch has): flipped around a
# routed call, a few microseconds where torch.nn.attention.sdpa_kernel costs about 20 (a call's host cost counts)
_SWITCHES = {name: (getattr(torch._C, f"_get_{flag}_sdp_enabled"), getattr(torch._C, f"_set_sdp_use_{flag}"))
             for name, flag in (("flash", "flash"), ("efficient", "mem_efficient"), ("math", "math"),
                                ("cudnn", "cudnn"), ("overrideable", "overrideable"))
             if hasattr(torch._C, f"_get_{flag}_sdp_enabled") and hasattr(torch._C, f"_set_sdp_use_{flag}")}
_ALL_SWITCHES = set(BACKENDS) <= set(_SWITCHES)


class Refused(RuntimeError):
    """A backend's op raised on a call routed to it: the caller runs fatune's kernels for this call signature from
    now on (the op would build and fail again on every call)."""


_DEVICE_ERRORS = tuple(error for error in (torch.OutOfMemoryError, getattr(torch, "AcceleratorError", None))
                       if error is not None)
# how SDPA says that no backend it may use takes a call (on CUDA tensors; on others)
_REFUSALS = ("No available kernel", "No viable backend")
_deterministic = torch._C._get_deterministic_algorithms
_switching = threading.RLock()  # the switches are the process's: one routed call flips them at a time


def deferred(backend: str) -> bool:
    """Whether a plan built now leaves its route to `backend` undecided: with deterministic algorithms on, where
    torch's can_use_* refuse cuDNN's attention and no route is taken anyway (`taken`); a plan built then is built
    again once they are off (fatune.api), instead of losing its route for good."""
    return bool(backend) and _deterministic()


def taken(host_bound: bool, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether a call whose plan has a route takes it: not under autocast (its routes were not measured there:
    fatune's kernels run), nor with deterministic algorithms on, warnings only too (fatune's kernels take their
    deterministic paths then; cuDNN's attention has none), nor (`host_bound`: its plan's) without gradients
    outside CUDA-graph capture."""
    if autocasting() or _deterministic():
        return False
    if not host_bound or torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return True
    return _capturing(query)


def _capturing(query: torch.Tensor) -> bool:
    return query.is_cuda and torch.cuda.is_current_stream_capturing()


def run(backend: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float,
        is_causal: bool, scale: float | None, enable_gqa: bool,
        how: tuple[str, str] = (SWITCHED, SWITCHED), layout: tuple = ()) -> torch.Tensor | None:
    """The whole call on SDPA's `backend` (its autograd computes the gradients), in the layout fatune's kernels
    give it; None where SDPA refuses it after all (its backend's switch turned off since the route was chosen,
    say): the caller runs fatune's kernels, said once. Refused where the backend raises otherwise: the caller runs
    fatune's kernels for this call signature from now on. Never under autocast or deterministic algorithms, nor
    for a host-bound call: the caller does not route there (`taken`). `how` (see `paths`), without gradients and
    with: SDPA as it is, the backend's op, or SDPA switched to the backend alone. `layout`: the output's
    (`output_layout`, computed once per plan; else here). SDPA as it is only while the
    backend's switch is on (the caller's sdpa_kernel context leaves the route its backend)."""
    # SDPA computes the log-sum-exp the backward needs only where autograd records the call
    wants_lse = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    path = how[wants_lse]
    if path == KERNELS:
        return None
    if path == SDPA and not _SWITCHES[backend][0]():  # the backend switched off since: the route still runs it
        path = SWITCHED if backend not in _OPS else OP
    dropout_p, scale = float(dropout_p), None if scale is None else float(scale)  # SDPA takes Python floats only
    try:
        out = _call(backend, path, query, key, value, wants_lse, dropout_p, is_causal, scale, enable_gqa)
    except (RuntimeError, TypeError) as error:
        # out of memory, a failed device or a CUDA graph being captured: fatune's kernels would fare no better
        if isinstance(error, _DEVICE_ERRORS) or (query.is_cuda and torch.cuda.is_current_stream_capturing()):
            raise
        if path != OP and any(refusal in str(error) for refusal in _REFUSALS):
            warn_once(f"fatune: torch SDPA's {backend} backend refused a call routed to it ({str(error)[:120]}): "
                      f"fatune's kernels run")
            return None
        warn_once(f"fatune: torch SDPA's {backend} backend raised on a call routed to it ({type(error).__name__}: "
                  f"{str(error)[:120]}): fatune's kernels run for this call signature")
        raise Refused(backend) from error
    return in_layout(out, layout or output_layout(query, value))


def output_layout(query: torch.Tensor, value: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, strides) of the output fatune's kernels give a call (the query's layout,
    fatune.kernel.layout.layout_like)."""
    return layout_like(query.shape, query.stride(), value.shape[-1])


def in_layout(out: torch.Tensor, layout: tuple[tuple[int, ...], tuple[int, ...]]) -> torch.Tensor:
    """`out` in `layout` (output_layout): as it is where it has it, else copied (autograd passes the gradient
    through the copy)."""
    shape, strides = layout
    if out.stride() == strides or tuple(out.shape) != shape or all(
            stride == want for size, stride, want in zip(shape, out.stride(), strides) if size > 1):
        return out
    return torch.empty_strided(shape, strides, dtype=out.dtype, device=out.device).copy_(out)


def _call(backend: str, path: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, wants_lse: bool,
          dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool) -> torch.Tensor | None:
    """The call on `backend` by `path` (see `run`), as the backend returns it."""
    if path == OP:
        return _OPS[backend](query, key, value, None, wants_lse, dropout_p, is_causal, False, scale=scale)[0]
    if path == SDPA:  # (a switched call in another thread meanwhile: SDPA may pick another backend, or refuse)
        return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout_p, is_causal=is_causal,
                                              scale=scale, enable_gqa=enable_gqa)
    if not _ALL_SWITCHES or backend not in _SWITCHES:  # a torch without these switches
        with sdpa_kernel(BACKENDS[backend]):
            return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout_p, is_causal=is_causal,
                                                  scale=scale, enable_gqa=enable_gqa)
    with _switching:
        before = [(setter, getter()) for getter, setter in _SWITCHES.values()]
        try:
            for name, (_, setter) in _SWITCHES.items():
                setter(name == backend)
            return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout_p, is_causal=is_causal,
                                                  scale=scale, enable_gqa=enable_gqa)
        finally:
            for setter, enabled in before:
                setter(enabled)
