"""fatune.attention as torch custom ops, so torch.compile(fullgraph=True) traces it without graph breaks.

`fatune::attention_forward` returns (out, lse, a mask tensor's key spans: int32, empty without
one, handed to the backward so that it does not scan the mask for them again) and
`fatune::attention_backward` the three gradients; both have fake (meta) implementations, and
the backward is registered as the forward's autograd formula. The ops' schemas are made from the call's
argument table (fatune.call.ARGUMENTS). The ops' real implementations prepare their plan (checks, dispatch,
kernel arguments; fatune.runtime.plans) when they run, so a compiled graph picks its configs per call shape,
and `dynamic=True` does not recompile for a new sequence length.

torch.compile traces `fatune::attention`, a composite of the two: the one thing decided while tracing is
whether a tuned entry routes the call to a torch SDPA backend (fatune.runtime.plans.traced_route, for sizes the
trace holds fixed); the graph then calls that backend, whose autograd formula is torch's, as an eager routed
call would. Eager calls do not come here: their autograd.Function costs less on the host (fatune.api).
"""

from __future__ import annotations

import dataclasses

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.utils.flop_counter import register_flop_formula

from fatune.call import ARGUMENTS, DOUBLE_BACKWARD, PAGED_GRADIENTS, Call, check_options
from fatune.kernel.layout import layout_like
from fatune.kernel.mask_spans import SPAN, compact, is_prepared
from fatune.kernel.spec import KERNELS, AttentionConfig, GluonBackwardConfig, GluonConfig, LaunchConfig, lse_dtype
from fatune.kernel.triton import dropout
from fatune.runtime import plans, routes

Tensor = torch.Tensor
_CONFIG_KINDS = (LaunchConfig, GluonConfig, GluonBackwardConfig)  # a kernel's config, by its index in the op's list
# the forward op's inputs: q, k, v, the call's arguments (ARGUMENTS, in order), the dropout seed, a config
_CALL = tuple(argument.name for argument in ARGUMENTS)
_INPUTS = ("q", "k", "v", *_CALL, "seed", "config", "strict")
_ARGUMENT_SCHEMA = ", ".join(f"{argument.op_type} {argument.name}" for argument in ARGUMENTS)
_TAIL_SCHEMA = "Tensor? seed, int[]? config, bool? strict) -> (Tensor, Tensor, Tensor)"
FORWARD_SCHEMA = f"(Tensor q, Tensor k, Tensor v, {_ARGUMENT_SCHEMA}, {_TAIL_SCHEMA}"
BACKWARD_SCHEMA = (f"(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor key_spans, "
                   f"{_ARGUMENT_SCHEMA}, {_TAIL_SCHEMA}")
_TAIL = 3  # the ops' arguments after the call's: seed, config, strict


def config_to_list(config: AttentionConfig | None) -> list[int] | None:
    """The op's flat form of a config (None for none: the op dispatches when it runs): per kernel, the index of its
    config's class in _CONFIG_KINDS, then the config's fields."""
    if config is None:
        return None
    if not isinstance(config, AttentionConfig):
        raise TypeError(f"config: expected a fatune.AttentionConfig or None, got {type(config).__name__}")
    values = []
    for name in KERNELS:
        launch = getattr(config, name)
        kind = next(i for i, kind in enumerate(_CONFIG_KINDS) if isinstance(launch, kind))
        values += [kind, *dataclasses.astuple(launch)]
    return values


def config_from_list(values: list[int] | None) -> AttentionConfig | None:
    """The config of an op's flat form (config_to_list; an op's argument: untrusted, checked as config_to_list
    writes it). Three LaunchConfigs' fields without their classes (what the op took before configs named their
    class: a saved exported program's, say) are read as such."""
    if not values:
        return None
    launches, at = [], 0
    for _ in KERNELS:
        kind = values[at] if at < len(values) else None
        if type(kind) is not int or not 0 <= kind < len(_CONFIG_KINDS):
            break
        size = len(dataclasses.fields(_CONFIG_KINDS[kind]))
        if at + 1 + size > len(values):
            break
        launches.append(_CONFIG_KINDS[kind](*values[at + 1:at + 1 + size]))
        at += 1 + size
    else:
        if at == len(values):
            return AttentionConfig(*launches)
    size = len(dataclasses.fields(LaunchConfig))
    if len(values) == len(KERNELS) * size:  # the untagged form
        return AttentionConfig(*(LaunchConfig(*values[i:i + size]) for i in range(0, len(values), size)))
    raise ValueError(f"config: expected a launch config list as fatune.ops.config_to_list writes it, got "
                     f"{len(values)} values starting {list(values[:4])}")


def _call(arguments: tuple) -> Call:
    """The Call of an op's arguments (its schema's types: a window as a list)."""
    call = Call(*arguments)
    return call._replace(window_size=tuple(call.window_size))


def _lse_rows(q: Tensor, packed: bool) -> tuple:
    return (1, q.shape[1], q.shape[0]) if packed else (q.shape[0], q.shape[1], q.shape[2])


def _lse_dtype(q: Tensor, attn_mask: Tensor | None) -> torch.dtype:
    return lse_dtype(q.dtype, attn_mask is not None and attn_mask.dtype != torch.bool)


def _no_key_spans(q: Tensor, attn_mask: Tensor | None) -> Tensor:
    """The key-spans output where no kernel made them: shaped as the kernels' would be (fatune.kernel.mask_spans),
    empty without a mask tensor."""
    if attn_mask is None:
        return q.new_empty((0,), dtype=torch.int32)
    return q.new_zeros((*compact(attn_mask).shape[:3], SPAN), dtype=torch.int32)


def _forward(q, k, v, *rest):
    *arguments, seed, config, strict = rest
    call = _call(arguments)
    prepared = plans.prepare(q, k, v, call, config_from_list(config), strict)
    if prepared.plan is None:
        out = plans.run_without_kernels(prepared, q, k, v, call)
        lse = q.new_zeros(_lse_rows(q, call.cu_seqlens_q is not None), dtype=_lse_dtype(q, call.attn_mask))
        return out, lse, _no_key_spans(q, call.attn_mask)
    out, lse, key_spans = prepared.plan.forward_with_spans(q, k, v, call.extras, seed, fresh_workspace=True)
    if key_spans is None:
        return out, lse, _no_key_spans(q, call.attn_mask)
    return out, lse, key_spans.clone() if is_prepared(key_spans) else key_spans  # an output of its own


def _forward_fake(q, k, v, *rest):
    call = _call(rest[:-_TAIL])
    out = torch.empty_strided(*layout_like(q.shape, q.stride(), v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = q.new_empty(_lse_rows(q, call.cu_seqlens_q is not None), dtype=_lse_dtype(q, call.attn_mask))
    return out, lse, torch.empty_like(_no_key_spans(q, call.attn_mask))


def _backward_op(grad_out, q, k, v, out, lse, key_spans, *rest):
    *arguments, seed, config, strict = rest
    call = _call(arguments)
    if call.block_table is not None:
        raise ValueError(PAGED_GRADIENTS)
    prepared = plans.prepare(q, k, v, call, config_from_list(config), strict)
    if prepared.plan is None:
        return plans.dense_gradients(prepared, q, k, v, call, grad_out)
    spans = key_spans if call.attn_mask is not None and key_spans.numel() else None  # none made: made again
    return prepared.plan.backward(grad_out, q, k, v, out, lse, call.extras, seed, spans)


def _backward_fake(grad_out, q, k, v, *rest):
    return tuple(torch.empty_strided(*layout_like(t.shape, t.stride()), dtype=t.dtype, device=t.device)
                 for t in (q, k, v))


attention_forward = torch.library.custom_op("fatune::attention_forward", _forward, mutates_args=(),
                                            schema=FORWARD_SCHEMA)
attention_forward.register_fake(_forward_fake)
attention_backward = torch.library.custom_op("fatune::attention_backward", _backward_op, mutates_args=(),
                                             schema=BACKWARD_SCHEMA)
attention_backward.register_fake(_backward_fake)


def _traced(tensor: Tensor) -> bool:
    """Whether `tensor` holds no data: torch.compile's tracing, where the formula is recorded, not run."""
    return isinstance(tensor, (FakeTensor, FunctionalTensor)) or tensor.is_meta


def _setup_context(ctx, inputs, output):
    q, k, v, *rest = inputs
    if rest[_CALL.index("block_table")] is not None and any(t.requires_grad for t in (q, k, v)):
        raise ValueError(PAGED_GRADIENTS)
    # the mask and index tensors are saved too: an in-place write to one before the backward raises torch's
    # "modified by an inplace operation" error instead of changing the gradients
    tensors = [i for i, value in enumerate(rest) if isinstance(value, Tensor)]
    ctx.save_for_backward(q, k, v, *output, *(rest[i] for i in tensors))
    ctx.rest, ctx.tensors = rest, tensors


def _backward(ctx, grad_out, grad_lse, grad_key_spans):
    q, k, v, out, lse, key_spans, *saved = ctx.saved_tensors
    if torch.is_grad_enabled() and not _traced(grad_out) and any(t.requires_grad for t in (grad_out, q, k, v)):
        raise RuntimeError(DOUBLE_BACKWARD)  # (an eager call under a dispatch mode; torch.compile traces on)
    rest = list(ctx.rest)
    for index, tensor in zip(ctx.tensors, saved):
        rest[index] = tensor
    dq, dk, dv = attention_backward(grad_out, q, k, v, out, lse, key_spans, *rest)
    grads = {"q": dq, "k": dk, "v": dv}
    return tuple(grads.get(name) for name in _INPUTS)


attention_forward.register_autograd(_backward, setup_context=_setup_context)


def _attention(q, k, v, *rest):
    """fatune::attention, composed of the ops or of an SDPA backend's: the output. Traced, the route is decided
    for the trace (fatune.runtime.plans.traced_route); on tensors with data (an exported program's call), as an
    eager call's: by its plan."""
    *arguments, seed, config, strict, state = rest
    call = _call(arguments)
    if _traced(q):
        routed = plans.traced_route(q, k, v, call, config_from_list(config), strict, state)
        if routed is not None:
            backend, how, layout = routed
            try:
                out = routes.run(backend, q, k, v, call.dropout_p, call.is_causal, call.scale, call.enable_gqa, how,
                                 layout)
            except routes.Refused:  # said once: fatune's ops run
                out = None
            if out is not None:
                return out
    else:
        prepared = plans.prepare(q, k, v, call, config_from_list(config), strict)
        if prepared.route and routes.taken(prepared.host_bound, q, k, v):
            out = plans.run_route(prepared, q, k, v, call.dropout_p, call.is_causal, call.scale, call.enable_gqa)
            if out is not None:
                return out
    return attention_forward(q, k, v, *rest[:-1])[0]


# `state`: what the route depends on besides the call when it was traced (plans.traced_state), an argument so
# that it is part of the traced graph, and so of the key under which torch.compile caches the graph on disk: a
# process whose tuned DBs differ traces the call again instead of loading another's route
_LIBRARY = torch.library.Library("fatune", "FRAGMENT")
_LIBRARY.define(f"attention(Tensor q, Tensor k, Tensor v, {_ARGUMENT_SCHEMA}, Tensor? seed, int[]? config, "
                f"bool? strict, str state) -> Tensor")
_LIBRARY.impl("attention", _attention, "CompositeImplicitAutograd")


@torch.compiler.assume_constant_result
def _traced_state() -> str:
    """plans.traced_state, read once while torch.compile traces a call (a constant of the graph)."""
    return plans.traced_state()


def _sequence_pairs(q: Tensor, k: Tensor, call: Call) -> int:
    """Σ L_q·L_k over the call's sequences, per query head: every (query, key) pair of the tensors' sequences, as
    torch's FLOP counter counts SDPA (masks, windows, causality and key lengths not subtracted); packed sequences
    each on their own, a paged cache at its table's width."""
    if call.cu_seqlens_q is not None:
        lengths_q, lengths_k = (cu[1:] - cu[:-1] for cu in (call.cu_seqlens_q, call.cu_seqlens_k))
        if isinstance(lengths_q, (FakeTensor, FunctionalTensor)) or lengths_q.is_meta:  # no lengths: their maxima
            longest_q, longest_k = (min(given or total, total) for given, total in
                                    ((call.max_seqlen_q, q.shape[0]), (call.max_seqlen_k, k.shape[0])))
            return min(lengths_q.shape[0] * longest_q * longest_k, q.shape[0] * k.shape[0])
        return int((lengths_q.long() * lengths_k.long()).sum())
    keys = call.block_table.shape[1] * k.shape[2] if call.block_table is not None else k.shape[2]
    return q.shape[0] * q.shape[2] * keys


def _forward_flops(q, k, v, *rest, out_val=None, **kwargs) -> int:
    """The forward's FLOPs for torch's FlopCounterMode: Q·Kᵀ and P·V, 2·pairs·(D + D_v) per query head."""
    heads = q.shape[-2] if q.dim() == 3 else q.shape[1]
    return 2 * heads * _sequence_pairs(q, k, _call(rest[:-_TAIL])) * (q.shape[-1] + v.shape[-1])


def _backward_flops(grad_out, q, k, v, out, lse, key_spans, *rest, out_val=None, **kwargs) -> int:
    """The backward's: S recomputed, dP, dV, dQ and dK, 2·pairs·(3·D + 2·D_v) per query head (2.5 forwards)."""
    heads = q.shape[-2] if q.dim() == 3 else q.shape[1]
    return 2 * heads * _sequence_pairs(q, k, _call(rest[:-_TAIL])) * (3 * q.shape[-1] + 2 * v.shape[-1])


register_flop_formula(torch.ops.fatune.attention_forward, get_raw=True)(_forward_flops)
register_flop_formula(torch.ops.fatune.attention_backward, get_raw=True)(_backward_flops)


def attention(q: Tensor, k: Tensor, v: Tensor, call: Call, config: AttentionConfig | None,
              strict: bool | None = None, traced: bool = False) -> Tensor:
    """fatune.attention through the custom ops: `traced` (torch.compile, torch.export) through fatune::attention,
    which may route it to an SDPA backend. The options are checked here, before they become the ops' typed
    arguments (where is_causal="False" would read as True and a window of 1.5 as 1)."""
    check_options(call.dropout_p, call.is_causal, call.scale, call.enable_gqa, call.window_size,
                  call.causal_alignment)
    seed = dropout.draw_seed(q.device) if call.dropout_p > 0 else None
    window = [min(int(size), 2**62) for size in call.window_size]  # beyond any sequence
    arguments = call._replace(dropout_p=float(call.dropout_p), scale=None if call.scale is None else float(call.scale),
                              window_size=window)
    if traced:
        return torch.ops.fatune.attention(q, k, v, *arguments, seed, config_to_list(config), strict, _traced_state())
    out, _, _ = attention_forward(q, k, v, *arguments, seed, config_to_list(config), strict)
    return out
