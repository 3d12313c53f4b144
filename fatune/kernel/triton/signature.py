"""The generated kernels' parameter lists, written once.

Each kernel's parameters are listed here, in order: its pointers first, then run-time
scalars, then strides. The same list is rendered into the kernel's `def` line in the
templates, selects the launch arguments in `fatune.kernel.triton.launch`, and gives the argument types
`fatune.kernel.triton.offline` compiles with, so the three can never disagree on the order.

Pointers name tensors of one call (Q, K, V, O, ...); a pointer a variant does not use is
passed as a dummy the kernel never reads. Strides are element strides along batch, head,
sequence and head dim (b, h, l, d) of the tensor named by their middle letters.
"""

from __future__ import annotations

from fatune.kernel.problem import OPTIONAL_TENSORS
from fatune.kernel.spec import KernelSpec, lse_dtype_name

# pointer name -> element type ("io": the inputs' dtype; "mask": the mask's; "lse": the LSE's, float64 for
# float32 inputs and additive masks (fatune.kernel.spec.lse_dtype_name))
POINTERS: dict[str, str] = {
    "Q": "io", "K": "io", "V": "io", "O": "io", "LSE": "lse",
    "MASK": "mask", "ALIBI": "fp32", "CU_Q": "i32", "CU_K": "i32", "SEQLENS_K": "i32", "SEED": "i64", "BLOCK_TABLE": "i32",
    "DO": "io", "DELTA": "fp32", "DQ": "io", "DK": "io", "DV": "io",
    "O_PART": "fp32", "LSE_PART": "lse", "SPLIT_COUNT": "i32", "OUT": "i8", "DQ_ACC": "fp32",
    "KEY_SPANS": "i32", "QUERY_SPANS": "i32",
}
FLOAT_SCALARS = frozenset({"sm_scale", "dropout_p"})


def strides(*tensors: str, dims: str = "bhld") -> tuple[str, ...]:
    """('q',) -> ('stride_qb', 'stride_qh', 'stride_ql', 'stride_qd')."""
    return tuple(f"stride_{t}{d}" for t in tensors for d in dims)


# the pointer each optional tensor of a call is passed as, in the call's order (fatune.kernel.problem.OPTIONAL_TENSORS)
POINTER_OF = {"attn_mask": "MASK", "alibi_slopes": "ALIBI", "cu_seqlens_q": "CU_Q", "cu_seqlens_k": "CU_K",
              "seqlens_k": "SEQLENS_K", "block_table": "BLOCK_TABLE"}
CALL_POINTERS = tuple(POINTER_OF[name] for name in OPTIONAL_TENSORS)
# every kernel's optional pointers (the dropout seed last); a paged K/V cache (forward only): the block table
# (B, pages per sequence) maps a sequence's logical pages to the cache's pages (K, V: (NUM_PAGES, H_kv, PAGE_SIZE,
# D)); passed as None without one
OPTIONAL_INPUTS = (*CALL_POINTERS[:-1], "SEED")
PAGED_INPUTS = CALL_POINTERS[-1:]
PAGED_VALUES = ("PAGE_SIZE", "NUM_PAGES")
RUN_TIME = ("sm_scale", "window_left", "window_right", "dropout_p", "H", "GROUP", "L_Q", "L_K")
STAT_STRIDES = ("stride_lb", "stride_lh")  # LSE and Delta: (B, H, L) with contiguous rows
MASK_AND_ALIBI_STRIDES = ("stride_mb", "stride_mh", "stride_mq", "stride_mk", "stride_ab", "stride_ah")

PARAMS: dict[str, tuple[str, ...]] = {
    # split-KV: the partial results (float32, one more dim (s) per split) and the per-tile arrival counts
    # (zeros; the last split of a tile merges and resets its count); None without it
    "attn_fwd": ("Q", "K", "V", "O", "LSE", *OPTIONAL_INPUTS, *PAGED_INPUTS, "O_PART", "LSE_PART", "SPLIT_COUNT",
                 *RUN_TIME, "num_splits", *PAGED_VALUES, *strides("q", "k", "v", "o"), *STAT_STRIDES,
                 *MASK_AND_ALIBI_STRIDES, *strides("op", dims="sbhld"), *strides("lp", dims="sbh"),
                 *strides("bt", dims="bp")),
    # atomic dQ: DQ_ACC is dQ's float32 accumulator (B, H, L_Q, HEAD_DIM); the plain kernel gets None
    "attn_bwd_dkdv": ("Q", "K", "V", "DO", "LSE", "DELTA", "DK", "DV", "DQ_ACC", *OPTIONAL_INPUTS, *RUN_TIME,
                      *strides("q", "k", "v", "do", "dk", "dv", "dqa"), *STAT_STRIDES, *MASK_AND_ALIBI_STRIDES),
    "attn_bwd_dq": ("Q", "K", "V", "O", "DO", "LSE", "DELTA", "DQ", *OPTIONAL_INPUTS, *RUN_TIME,
                    *strides("q", "k", "v", "o", "do", "dq"), *STAT_STRIDES, *MASK_AND_ALIBI_STRIDES),
    "attn_bwd_prep": ("Q", "K", "V", "O", "DO", "LSE", "DELTA", "DQ_ACC", *OPTIONAL_INPUTS, *RUN_TIME,
                      *strides("q", "k", "v", "o", "do", "dqa"), *STAT_STRIDES, *MASK_AND_ALIBI_STRIDES),
    "attn_bwd_dq_store": ("DQ_ACC", "DQ", "sm_scale", "L_Q", *strides("dqa", "dq")),
    "dropout_mask_kernel": ("OUT", "SEED", "dropout_p", "H", "L_Q", "L_K", *strides("out", dims="bhqk")),
}


# An attn_mask tensor's spans (fatune.kernel.mask_spans), int32 (B, H, rows, SPAN) by strides (b, h, l): the [first, end) of
# the keys each query row sees (KEY_SPANS: the kernels that stream keys past a query tile) or of the queries that
# see each key (QUERY_SPANS: dK/dV, which streams queries). Parameters of a masked spec's kernels only, so no
# other kernel's source changes.
SPAN_INPUTS = {"attn_fwd": "KEY_SPANS", "attn_bwd_dq": "KEY_SPANS", "attn_bwd_prep": "KEY_SPANS",
               "attn_bwd_dkdv": "QUERY_SPANS"}
SPAN_STRIDES = {"KEY_SPANS": strides("ks", dims="bhl"), "QUERY_SPANS": strides("qs", dims="bhl")}


def params(kernel: str, spec: KernelSpec | None = None) -> tuple[str, ...]:
    """`kernel`'s parameters for kernels of `spec` (None: an unmasked spec's): PARAMS, with a masked spec's span
    pointer after the other pointers and its strides last."""
    names = PARAMS[kernel]
    span = SPAN_INPUTS.get(kernel)
    if span is None or spec is None or spec.attn_mask == "none":
        return names
    count = _pointer_count(names)
    return names[:count] + (span,) + names[count:] + SPAN_STRIDES[span]


def _pointer_count(names: tuple[str, ...]) -> int:
    return next(i for i, name in enumerate(names) if name not in POINTERS)


def pointers(kernel: str, spec: KernelSpec | None = None) -> tuple[str, ...]:
    """The leading pointer parameters of `kernel` (of `spec`'s kernels: params)."""
    names = params(kernel, spec)
    return names[:_pointer_count(names)]


def values(kernel: str, spec: KernelSpec | None = None) -> tuple[str, ...]:
    """The scalar and stride parameters of `kernel` (everything after its pointers)."""
    names = params(kernel, spec)
    return names[_pointer_count(names):]


def render(kernel: str, spec: KernelSpec | None = None, indent: int = 8) -> str:
    """The parameter list as it stands in the kernel's `def` line: pointers, scalars, then one
    line of strides per tensor."""
    scalars = [name for name in values(kernel, spec) if not name.startswith("stride_")]
    stride_names = [name for name in values(kernel, spec) if name.startswith("stride_")]
    by_tensor: dict[str, list[str]] = {}
    for name in stride_names:
        by_tensor.setdefault(name[len("stride_"):-1], []).append(name)
    lines = [", ".join(pointers(kernel, spec)), ", ".join(scalars)] + [", ".join(group) for group in by_tensor.values()]
    return (",\n" + " " * indent).join(line for line in lines if line)


def optional_inputs_used(spec: KernelSpec) -> set[str]:
    """The optional pointers that kernels of `spec` read; the others are passed as None."""
    used = {"MASK": spec.attn_mask != "none", "ALIBI": spec.alibi, "CU_Q": spec.seqlens == "varlen",
            "CU_K": spec.seqlens == "varlen", "SEQLENS_K": spec.seqlens == "seqlens_k", "SEED": spec.dropout,
            "BLOCK_TABLE": spec.paged}
    return {name for name, on in used.items() if on}


def triton_types(kernel: str, spec: KernelSpec, absent: frozenset[str] = frozenset(),
                 mask_dtype: str | None = None) -> dict[str, str]:
    """Triton argument types of `kernel` for `spec`, as `triton.compile` takes them in an ASTSource
    signature ("constexpr" for the optional pointers it does not read and the `absent` ones, which
    are passed as None); `mask_dtype`: an additive mask's Triton type ("fp32"; default: the inputs')."""
    dtype = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}[spec.dtype]
    used = optional_inputs_used(spec)
    types = {}
    for name in params(kernel, spec):
        kind = POINTERS.get(name)
        if kind is None:
            types[name] = "fp32" if name in FLOAT_SCALARS else "i32"
        elif (name in OPTIONAL_INPUTS + PAGED_INPUTS and name not in used) or name in absent:
            types[name] = "constexpr"
        elif kind == "io":
            types[name] = "*" + dtype
        elif kind == "mask":
            types[name] = "*i1" if spec.attn_mask == "bool" else "*" + (mask_dtype or dtype)
        elif kind == "lse":
            types[name] = "*fp64" if lse_dtype_name(spec.dtype, spec.attn_mask) == "tl.float64" else "*fp32"
        else:
            types[name] = "*" + kind
    return types
