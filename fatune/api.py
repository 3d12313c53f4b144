"""`fatune.attention`: the public call, its autograd Function, `fatune.explain` and the module.

The generated kernels read Q, K, V and dO through their strides, so no input is copied;
outputs and gradients are allocated in the layout of the tensor they mirror. A call's
checks, dispatch and kernel arguments are prepared once per call signature
(fatune.runtime.plans); under torch.compile the call goes through the custom ops instead
(fatune.ops), which prepare the same plans when they run; under torch.func transforms, through a
Function that prepares them in its forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor

from fatune import ops
from fatune.call import DOUBLE_BACKWARD, PAGED_GRADIENTS, Call, alignment_key, check_flag
from fatune.kernel.family import family
from fatune.kernel.spec import AttentionConfig, KernelSpec
from fatune.kernel.triton import dropout
from fatune.kernel.triton.launch import NO_EXTRAS, Plan
from fatune.runtime.dispatch import Decision
from fatune.runtime import routes
from fatune.runtime.plans import dense_gradients, forget, prepare, prepare_plain, run_route, run_without_kernels
from fatune.tuning import first_use

VMAP = ("fatune.attention does not support torch.func.vmap (nor jacrev/jacfwd, which vmap): fold the vmapped dim "
        "into the batch dim (B) of one call, or loop over it; torch.func.grad and vjp are supported")


class _FlashAttention(torch.autograd.Function):
    """Forward saves Q, K, V, O and the per-row LSE; backward recomputes P tile by tile.

    The mask and index tensors (`extras`) are saved too, so that an in-place write to one between the forward and
    the backward raises torch's "modified by an inplace operation" error instead of changing the gradients."""

    @staticmethod
    def forward(ctx, query, key, value, plan: Plan, extras: tuple):
        seed = dropout.draw_seed(query.device) if plan.uses_seed else None
        out, lse, key_spans = plan.forward_with_spans(query, key, value, extras, seed)
        ctx.save_for_backward(query, key, value, out, *(t for t in extras if t is not None))
        ctx.state = plan, lse, extras, seed, key_spans  # LSE and a mask's key spans: not inputs or outputs
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():
            raise RuntimeError(DOUBLE_BACKWARD)
        query, key, value, out, *_ = ctx.saved_tensors  # checks the saved tensors' versions
        plan, lse, extras, seed, key_spans = ctx.state
        grad_query, grad_key, grad_value = plan.backward(grad_out, query, key, value, out, lse, extras, seed,
                                                         key_spans)
        return grad_query, grad_key, grad_value, None, None


def _unwrapped(tensor: torch.Tensor, levels: int = 1 << 30) -> torch.Tensor:
    """The plain tensor inside torch.func's gradient-tracking wrappers (what the kernels read); vmap's batched
    tensors are refused (VMAP), and so are more than `levels` wrappers (an outer transform that would
    differentiate the result: DOUBLE_BACKWARD)."""
    depth = 0
    while torch._C._functorch.is_functorch_wrapped_tensor(tensor):
        if torch._C._functorch.is_batchedtensor(tensor):
            raise NotImplementedError(VMAP)
        depth += 1
        if depth > levels:
            raise RuntimeError(f"{DOUBLE_BACKWARD}: torch.func.grad of a gradient")
        tensor = torch._C._functorch.get_unwrapped(tensor)
    return tensor


class _TransformedAttention(torch.autograd.Function):
    """fatune.attention under torch.func transforms (grad, vjp), which take a Function with setup_context: the
    call is prepared inside the forward, where the transforms have unwrapped the tensors. Outputs: O, and the
    LSE, key spans and dropout seed the backward takes (empty where the call has none)."""

    @staticmethod
    def forward(query, key, value, call: Call, config: AttentionConfig | None, strict: bool | None):
        prepared = prepare(query, key, value, call, config, strict)
        none = query.new_empty((0,))
        if prepared.plan is None:
            return run_without_kernels(prepared, query, key, value, call), none, none, none
        seed = dropout.draw_seed(query.device) if prepared.plan.uses_seed else None
        out, lse, key_spans = prepared.plan.forward_with_spans(query, key, value, call.extras, seed)
        return out, lse, none if key_spans is None else key_spans, none if seed is None else seed

    @staticmethod
    def setup_context(ctx, inputs, output):
        query, key, value, call, config, strict = inputs
        out, lse, key_spans, seed = output
        ctx.mark_non_differentiable(lse, key_spans, seed)
        ctx.save_for_backward(query, key, value, out, lse, key_spans, seed, *(t for t in call.extras if t is not None))
        ctx.call = call, config, strict

    @staticmethod
    @torch.autograd.function.once_differentiable  # torch.func.grad differentiates with create_graph=True
    def backward(ctx, grad_out, *_):
        saved = ctx.saved_tensors
        # one wrapper: the torch.func.grad that runs this backward; more: a transform outside it differentiates too
        grad_out, query, key, value, out, lse, key_spans, seed = (_unwrapped(t, 1) for t in (grad_out, *saved[:7]))
        call, config, strict = ctx.call
        call = Call(*(_unwrapped(x) if isinstance(x, torch.Tensor) else x for x in call))
        with torch._C._DisableFuncTorch():  # the buffers the backward makes: plain tensors, as the kernels take
            prepared = prepare(query, key, value, call, config, strict)
            if prepared.plan is not None:
                grads = prepared.plan.backward(grad_out, query, key, value, out, lse, call.extras,
                                               seed if seed.numel() else None, key_spans if key_spans.numel() else None)
        if prepared.plan is None:  # torch.func differentiates the dense result: not where functorch is disabled
            grads = dense_gradients(prepared, query, key, value, call, grad_out)
        return (*grads, None, None, None)

    @staticmethod
    def vmap(info, in_dims, *args):
        raise NotImplementedError(VMAP)


# `_FlashAttention.apply` is torch's Python wrapper around the C `_FunctionBase.apply`; for a
# Function without setup_context, outside functorch transforms, it only unwraps dead functorch
# wrappers among the tensor arguments. attention() does that itself and calls the C apply.
_apply = super(torch.autograd.Function, _FlashAttention).apply
_functorch_active = torch._C._are_functorch_transforms_active
_dispatch_depth = torch._C._len_torch_dispatch_stack
_dispatch_mode, _FAKE, _PROXY = (torch._C._get_dispatch_mode, torch._C._TorchDispatchModeKey.FAKE,
                                 torch._C._TorchDispatchModeKey.PROXY)
_any_autocast = torch._C._is_any_autocast_enabled
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
# The autograd engine calls the node's `apply`, torch's Python method that looks up the user's
# backward (or vjp) on every call; ours is `backward`, bound once.
_FlashAttention._backward_cls.apply = _FlashAttention.backward


def _autocast(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None) -> tuple:
    """q, k, v and the mask as torch's SDPA takes them under autocast on their device: floating q, k and v other
    than float64 in autocast's dtype; an additive mask too unless float32, which fatune takes with any q (a paged
    cache's pool is not copied: its calls are left as they are)."""
    if not isinstance(query, torch.Tensor) or not torch.is_autocast_enabled(query.device.type):
        return query, key, value, attn_mask
    dtype = torch.get_autocast_dtype(query.device.type)

    def cast(tensor):
        eligible = isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.dtype != torch.float64
        return tensor.to(dtype) if eligible and tensor.dtype != dtype else tensor

    mask = cast(attn_mask) if isinstance(attn_mask, torch.Tensor) and attn_mask.dtype != torch.float32 else attn_mask
    return cast(query), cast(key), cast(value), mask


def _without_data(query: torch.Tensor, observed: bool) -> bool:
    """Whether the call is traced on tensors that hold no data: under FakeTensorMode or make_fx (`observed`: some
    dispatch mode is on), or on meta or fake tensors. fatune's custom op takes such calls, as under torch.compile:
    its fake implementation gives the outputs' sizes and strides, its autograd formula their gradients."""
    return isinstance(query, FakeTensor) or (isinstance(query, torch.Tensor) and query.is_meta) or \
        observed and (_dispatch_mode(_FAKE) is not None or _dispatch_mode(_PROXY) is not None)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    window_size: tuple[int, int] = (-1, -1),
    causal_alignment: str | None = None,
    alibi_slopes: torch.Tensor | None = None,
    seqlens_k: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    block_table: torch.Tensor | None = None,
    config: AttentionConfig | None = None,
    strict: bool | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention through fatune's generated FlashAttention kernels.

    Shaped like ``torch.nn.functional.scaled_dot_product_attention``; differentiable in
    query, key and value. See README.md ("fatune.attention") for the full table.

    - query (B, H, L_q, D), key (B, H_kv, L_k, D), value (B, H_kv, L_k, D_v): any strides,
      float16 / bfloat16 / float32, one device; H % H_kv == 0 with enable_gqa=True.
      Packed variable-length batches: (total, H, D) tensors with cu_seqlens_q/k (int32).
    - attn_mask: bool (True = keep) or additive float, broadcastable to (B, H, L_q, L_k).
    - is_causal: key j visible to query i when j <= i + offset; window_size=(left, right)
      keeps i + offset - left <= j <= i + offset + right (-1 = unbounded). offset is 0
      for causal_alignment="top_left" (torch SDPA; default for is_causal alone) and
      L_k - L_q for "bottom_right" (flash-attn; default with a window or packed inputs).
      For L_q = 2, L_k = 4::

          top_left      bottom_right
          1 0 0 0       1 1 1 0
          1 1 0 0       1 1 1 1

    - alibi_slopes: float32 (H,) or (B, H); adds -slope * |i + offset - j| to the scores.
    - seqlens_k: int32 (B,) keys per batch element; later keys are skipped, not computed.
    - block_table: int32 (B, pages per sequence) for a paged K/V cache (inference, no gradients):
      key and value are (pages, H_kv, page size, D) and sequence b's keys are the pages
      block_table[b] names, in order (with seqlens_k: its first seqlens_k[b] keys).
    - dropout_p: dropout on the attention probabilities (seeded from torch's generator on
      the tensors' device).
    - Rows that see no key return 0 (torch SDPA returns NaN there) and get zero gradients.
    - config: force launch configs; strict (or $FATUNE_STRICT=1): raise instead of falling back.

    On CPU tensors the kernels run in Triton's interpreter when TRITON_INTERPRET=1;
    otherwise the call falls back to a dense torch implementation and logs why, once.
    """
    if block_table is not None and torch.is_grad_enabled() and \
            (query.requires_grad or key.requires_grad or value.requires_grad):
        raise ValueError(PAGED_GRADIENTS)
    if _any_autocast() and block_table is None:
        query, key, value, attn_mask = _autocast(query, key, value, attn_mask)
    transformed = _functorch_active()
    # under another dispatch mode (a FLOP counter, selective activation checkpointing) fatune's kernels run as its
    # custom ops, which the mode sees as one op with its FLOP formula (fatune.ops); a route's SDPA op it sees anyway
    compiling = torch.compiler.is_compiling()
    observed = not compiling and _dispatch_depth() > 0
    compiling = compiling or (not transformed and _without_data(query, observed))
    plain = attn_mask is None and alibi_slopes is None and seqlens_k is None and cu_seqlens_q is None and \
        cu_seqlens_k is None and block_table is None
    prepared, plain_prepared, routed_already = None, None, False
    if plain and not (compiling or transformed):  # the common call: no Call object, a shorter key
        prepared = prepare_plain(query, key, value, dropout_p, is_causal, scale, enable_gqa, window_size,
                                 causal_alignment, max_seqlen_q, max_seqlen_k, config, strict)
        if not prepared.settled and \
                first_use.tune_call(prepared, query, key, value, _wants_grad(query, key, value), attention) or \
                prepared.route_deferred and _decidable(prepared):
            prepared = prepare_plain(query, key, value, dropout_p, is_causal, scale, enable_gqa, window_size,
                                     causal_alignment, max_seqlen_q, max_seqlen_k, config, strict)
        if prepared.route and routes.taken(prepared.host_bound, query, key, value):
            routed = run_route(prepared, query, key, value, dropout_p, is_causal, scale, enable_gqa)
            if routed is not None:
                return routed
        if prepared.plan is not None and not observed:
            alignment = alignment_key(query, key, value)
            if prepared.alignment == alignment:
                return _run(prepared.plan, query, key, value, NO_EXTRAS)
            # its plan was built for data aligned otherwise: the full key's plan runs (its route was tried),
            # remembered beside it for the next such call
            plain_prepared, prepared, routed_already = prepared, prepared.aligned_otherwise.get(alignment), True
            if prepared is not None:  # (only plans that run kernels are remembered)
                return _run(prepared.plan, query, key, value, NO_EXTRAS)
    call = Call(attn_mask, dropout_p, is_causal, scale, enable_gqa, window_size, causal_alignment, alibi_slopes,
                seqlens_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table)
    if compiling:
        check_flag("strict", strict, optional=True)
        return ops.attention(query, key, value, call, config, strict, traced=True)
    if transformed:
        return _TransformedAttention.apply(query, key, value, call, config, strict)[0]
    if prepared is None:
        prepared = prepare(query, key, value, call, config, strict)
        if prepared.route_deferred and _decidable(prepared):
            prepared = prepare(query, key, value, call, config, strict)
        if routed_already and prepared.plan is not None and len(plain_prepared.aligned_otherwise) < 8:
            plain_prepared.aligned_otherwise[alignment] = prepared
    if prepared.route and not routed_already and routes.taken(prepared.host_bound, query, key, value):
        routed = run_route(prepared, query, key, value, call.dropout_p, call.is_causal, call.scale,
                           call.enable_gqa)
        if routed is not None:
            return routed
    if observed and prepared.plan is not None:  # (without kernels the mode sees torch's ops as they run)
        return ops.attention(query, key, value, call, config, strict)
    if prepared.plan is None:
        return run_without_kernels(prepared, query, key, value, call)
    return _run(prepared.plan, query, key, value, call.extras)


def _decidable(prepared) -> bool:
    """Whether the route `prepared` left undecided (built under deterministic algorithms) can be decided now: its
    plan is then forgotten, to be built again."""
    if routes.deferred(prepared.route_deferred):
        return False
    forget(prepared)
    return True


def _wants_grad(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)


def _run(plan: Plan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, extras: tuple) -> torch.Tensor:
    """A prepared call's kernels: through the autograd Function where a gradient is wanted."""
    if _wants_grad(query, key, value):
        return _apply(_unwrap_if_dead(query), _unwrap_if_dead(key), _unwrap_if_dead(value), plan, extras)
    seed = dropout.draw_seed(query.device) if plan.uses_seed else None
    return plan.forward(query, key, value, extras, seed)[0]


class FlashAttention(torch.nn.Module):
    """Drop-in attention module: forward(query, key, value, **kwargs) = fatune.attention(..., **defaults, **kwargs).
    A default dropout_p applies in training mode only, as nn.Dropout's (eval() turns it off); one passed to forward
    applies as passed."""

    def __init__(self, **defaults):
        super().__init__()
        self.defaults = defaults

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs) -> torch.Tensor:
        defaults = self.defaults if self.training else {**self.defaults, "dropout_p": 0.0}
        return attention(query, key, value, **{**defaults, **kwargs})


@dataclass(frozen=True)
class Explanation:
    """What fatune.attention would run for a call, and why."""

    backend: str  # the kernel family that runs ("triton", "gluon"), "triton-interpreter", "torch-fallback", or the
    # torch SDPA backend a tuned entry routes the call to ("sdpa-cudnn", "sdpa-flash", "sdpa-efficient")
    spec: KernelSpec
    decision: Decision | None
    sources: dict[str, str]  # kernel module -> generated source file
    reason: str
    launched: AttentionConfig | None = None  # the config with its launch-time choices made (launch.resolve)

    def __str__(self) -> str:
        lines = [f"backend: {self.backend}", f"mask variant: {self.spec.mask_variant} ({self.spec.dtype}, "
                 f"d={self.spec.head_dim}, dv={self.spec.head_dim_v})", f"why: {self.reason}"]
        if self.decision is not None:
            lines.append(self.decision.describe())
            if self.launched is not None and self.launched != self.decision.config:
                lines.append(f"launched: fwd {self.launched.fwd} | dkdv {self.launched.dkdv} | dq {self.launched.dq} "
                             f"(choices made for these tensors, this GPU and torch's deterministic mode)")
        lines += [f"source ({kind}): {path}" for kind, path in self.sources.items()]
        return "\n".join(lines)


def explain(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args, config: AttentionConfig | None = None,
            strict: bool | None = None, **kwargs) -> Explanation:
    """Which tuned entry, config, generated source file and DB layer fatune.attention(same arguments) would use."""
    if _any_autocast() and kwargs.get("block_table") is None:  # as attention() casts them
        query, key, value, mask = _autocast(query, key, value, kwargs.get("attn_mask", args[0] if args else None))
        if args:
            args = (mask, *args[1:])
        elif "attn_mask" in kwargs:
            kwargs["attn_mask"] = mask
    unknown = sorted(set(kwargs) - set(Call._fields))
    if unknown or len(args) > len(Call._fields):
        raise TypeError(f"explain: takes fatune.attention's arguments, got {unknown[0] if unknown else 'more'!r:.80}"
                        + (f" (expected one of {', '.join(Call._fields)})" if unknown else " positional arguments"))
    call = Call(*args, **kwargs)
    spec = call.check(query, key, value).spec
    prepared = prepare(query, key, value, call, config, strict)
    if prepared.route_deferred and _decidable(prepared):
        prepared = prepare(query, key, value, call, config, strict)
    if prepared.plan is None:
        backend = "torch-fallback" if prepared.mode == "fallback" else prepared.mode
        return Explanation(backend, spec, None, {}, prepared.reason)
    grad = _wants_grad(query, key, value)
    host_bound = prepared.host_bound and not grad
    unrouted = ("autocast is on" if routes.autocasting() else
                "deterministic algorithms are on" if torch.are_deterministic_algorithms_enabled() else
                f"its op does not take these tensors {'with' if grad else 'without'} gradients"
                if prepared.paths[grad] == routes.KERNELS else "")
    if prepared.route and not host_bound and not unrouted:
        return Explanation(f"sdpa-{prepared.route}", spec, prepared.decision, {}, prepared.reason)
    plan = prepared.plan
    launched = plan.config if plan.adds_dq_atomically() else plan.deterministic_config()  # torch's mode now
    sources = {kind: str(family(launched.family).source_path(kind, plan.spec, launched)) for kind in ("fwd", "bwd")}
    backend = launched.family if query.device.type == "cuda" else "triton-interpreter"
    reason = prepared.reason + (f"; {plan.build_failure}" if plan.build_failure else "")
    if prepared.route and unrouted:
        reason += f"; not routed to SDPA's {prepared.route} backend: {unrouted}"
    elif prepared.route_deferred:
        reason += f"; not routed to SDPA's {prepared.route_deferred} backend: deterministic algorithms are on"
    elif prepared.route and host_bound:
        reason += (f"; not routed to SDPA's {prepared.route} backend without gradients: a call this small is "
                   f"host-bound, and fatune's launch costs the host less")
    return Explanation(backend, spec, prepared.decision, sources, reason, launched)
