"""The Gluon family's code generation: the options its forward and backward templates (templates/gluon/) render
from."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

from fatune.kernel import codegen
from fatune.kernel.codegen import Templates
from fatune.kernel.spec import GLUON_PRODUCER_REGS, GLUON_SPLIT_M, GluonBackwardConfig, GluonConfig, KernelSpec

TEMPLATES = Templates("gluon")
# the head-dim widths the forward is compiled for (a tile's dims are powers of two); a call's head dim runs at the
# next one up (d96 at 128, d192 at 256): its TMA tiles read zeros past the tensor's last lane and write nothing there
HEAD_DIMS = (64, 128, 256)


def width(head_dim: int) -> int:
    """The compiled head-dim width a call of `head_dim` runs at: the smallest of HEAD_DIMS that holds it."""
    for candidate in HEAD_DIMS:
        if head_dim <= candidate:
            return candidate
    raise ValueError(f"head_dim: expected at most {HEAD_DIMS[-1]} for the Gluon forward, got {head_dim}")


def unpersistent(spec: KernelSpec, config: GluonConfig) -> str | None:
    """Why the forward of `config` cannot run persistent for `spec` (None: it can, or is not persistent): a
    program that made its sequence's descriptors again for its next tile could overwrite one a copy in flight
    still reads."""
    if config.persistent and spec.seqlens != "fixed":
        return f"the persistent forward takes no key lengths or packed sequences (a {spec.seqlens} spec)"
    return None


def template_options(spec: KernelSpec, config: GluonConfig) -> dict[str, Any]:
    """The options the forward template renders from."""
    reason = unpersistent(spec, config)
    if reason is not None:
        raise ValueError(f"persistent: {reason}")
    return {
        "template_name": f"{TEMPLATES.folder}/attn_fwd.py.jinja",
        "spec_json": json.dumps(spec.to_dict(), sort_keys=True),
        "config_json": json.dumps(config.to_dict(), sort_keys=True),
        "HEAD_DIM": width(spec.head_dim), "D": spec.head_dim, "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "STAGES": config.num_stages,
        "CONSUMERS": config.consumers, "CONSUMER_REGS": config.consumer_regs, "OVERLAP": bool(config.overlap),
        "PINGPONG": bool(config.pingpong), "PRODUCER_REGS": GLUON_PRODUCER_REGS,
        # persistent: the partitions take q_empty (the Q buffers free again) and the tile count, the kernel the latter
        "PERSISTENT": bool(config.persistent), "PERSISTENT_PARAMS": ", q_empty, M_TILES, BH" if config.persistent else "",
        "KERNEL_PERSISTENT_PARAMS": ", M_TILES, BH" if config.persistent else "",
        "IS_CAUSAL": spec.causal, "BOTTOM_RIGHT": spec.bottom_right, **sequence_options(spec.seqlens, spec.alibi),
        "ALIBI": spec.alibi,
        "HAS_LEFT": spec.window_left, "HAS_RIGHT": spec.causal or spec.window_right,
        "HAS_BAND": spec.causal or spec.window_left or spec.window_right,
    }


# the kernel's parameters per way a call gives its sequences' lengths (fatune.kernel.spec.KernelSpec.seqlens): the
# bounds' tensors; the K and V (and, packed, Q) pointers the producer makes its sequence's descriptors from; and,
# packed, the O pointer the consumers make theirs from (with ALiBi, the consumers' slopes too)
_SEQUENCE_PARAMS = {"fixed": "", "seqlens_k": ", SEQLENS_K", "varlen": ", CU_Q, CU_K"}
_KV_POINTERS = ", K, V, stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl"
_POINTER_PARAMS = {"fixed": "", "seqlens_k": _KV_POINTERS, "varlen": _KV_POINTERS + ", Q, stride_qh, stride_ql"}
_CONSUMER_PARAMS = {"fixed": "", "seqlens_k": "", "varlen": ", O, stride_oh, stride_ol"}
ALIBI_PARAMS = ", ALIBI, stride_ab, stride_ah"


def sequence_options(seqlens: str, alibi: bool = False) -> dict[str, str]:
    """The template options of the way a call gives its sequences' lengths ("fixed", "seqlens_k", "varlen") and of
    ALiBi; the parameters are passed on under their own names, so each list is both."""
    consumers = _CONSUMER_PARAMS[seqlens] + (ALIBI_PARAMS if alibi else "")
    return {"SEQUENCES": seqlens, "SEQUENCE_PARAMS": _SEQUENCE_PARAMS[seqlens],
            "SEQUENCE_ARGS": _SEQUENCE_PARAMS[seqlens], "POINTER_PARAMS": _POINTER_PARAMS[seqlens],
            "POINTER_ARGS": _POINTER_PARAMS[seqlens], "CONSUMER_PARAMS": consumers, "CONSUMER_ARGS": consumers}


def render(spec: KernelSpec, config: GluonConfig) -> str:
    """Gluon source of the forward kernel for one spec and config."""
    return TEMPLATES.render("attn_fwd.py.jinja", template_options(spec, config))


def source_path(spec: KernelSpec, config: GluonConfig) -> Path:
    return codegen.cache_dir() / f"gluon_fwd_{TEMPLATES.source_key('fwd', template_options(spec, config))}.py"


def load(spec: KernelSpec, config: GluonConfig) -> ModuleType:
    """Import the generated forward for (spec, config), rendering it into the kernel cache if needed."""
    return codegen.load(("gluon", "fwd", spec, config), lambda: source_path(spec, config),
                        lambda: render(spec, config), interpreted=False)


# the backward's rows that see at most this many keys get dS split into two 16-bit parts in masked tiles (the Triton
# family's attn_bwd_prep computes their Delta as sum P dP: see fatune.kernel.triton.codegen)
EXACT_DELTA_KEYS = 128


def backward_head_split(spec: KernelSpec) -> int:
    """How many consumer warpgroups share a key tile, each owning a part of dK's, dV's and dQ's lanes: 2 at 256
    lanes, where one warpgroup's dK and dV (128 + 128 registers per thread) would not fit; else 1."""
    return 2 if width(spec.head_dim) > 128 else 1


def backward_block_n(spec: KernelSpec, config: GluonBackwardConfig) -> int:
    """Key rows per backward program: 64 per group of consumers that share a key tile."""
    return GLUON_SPLIT_M * config.consumers // backward_head_split(spec)


def backward_stores_by_pointers(spec: KernelSpec, config: GluonBackwardConfig) -> bool:
    """Whether the backward stores dK and dV from registers through pointers (a packed sequence's rows, a
    consumer's own lanes where the consumers split the head dim, or float32 sums a group's parts add to) rather
    than by TMA."""
    return spec.seqlens == "varlen" or backward_head_split(spec) > 1 or config.group_split > 1


def unshared_dq(spec: KernelSpec, config: GluonBackwardConfig) -> str | None:
    """Why the consumers of `config` cannot share dQ's reduction for `spec` (None: they can, or do not try): each
    takes an equal share of the lanes, at least 16, and none may split the head dim already."""
    lanes = width(spec.head_dim)
    if not config.shared_dq:
        return None
    if backward_head_split(spec) > 1:
        return f"at head dim {spec.head_dim} the consumers split the head dim already"
    if lanes % (16 * config.consumers):
        return f"{lanes} lanes do not split into {config.consumers} equal shares of 16 or more"
    return None


def backward_dq_lanes(spec: KernelSpec, config: GluonBackwardConfig) -> int:
    """Lanes of dQ each consumer adds up: its share of the head dim where the consumers share dQ's reduction,
    else every lane it owns."""
    lanes = width(spec.head_dim) // backward_head_split(spec)
    return lanes // config.consumers if config.shared_dq else lanes


def backward_dq_slice(spec: KernelSpec, config: GluonBackwardConfig) -> int:
    """Lanes of dQ per product and bulk reduction (the config's slice, at most a consumer's lanes)."""
    return min(config.dq_slice, backward_dq_lanes(spec, config))


def backward_options(spec: KernelSpec, config: GluonBackwardConfig) -> dict[str, Any]:
    """The options the backward template renders from."""
    has_right = spec.causal or spec.window_right
    split_ds = bool(has_right or spec.window_left)  # rows with few keys exist only under a band
    head_split = backward_head_split(spec)
    lanes = width(spec.head_dim)
    if config.consumers % head_split:
        raise ValueError(f"consumers: expected a multiple of {head_split} at head dim {spec.head_dim} (that many "
                         f"consumer warpgroups share each key tile), got {config.consumers}")
    reason = unshared_dq(spec, config)
    if reason is not None:
        raise ValueError(f"shared_dq: {reason}")
    return {
        "template_name": f"{TEMPLATES.folder}/attn_bwd.py.jinja",
        "spec_json": json.dumps(spec.to_dict(), sort_keys=True),
        "config_json": json.dumps(config.to_dict(), sort_keys=True),
        "HEAD_DIM": lanes, "BLOCK_M": config.block_m, "BLOCK_N": backward_block_n(spec, config),
        "SPLIT_N": GLUON_SPLIT_M, "HEAD_SPLIT": head_split, "KEY_GROUPS": config.consumers // head_split,
        "OWN": lanes // head_split, "STAGES": config.num_stages, "DQ_SLICE": backward_dq_slice(spec, config),
        "DQ_LANES": backward_dq_lanes(spec, config), "SHARED_DQ": bool(config.shared_dq),
        "CONSUMERS": config.consumers, "CONSUMER_REGS": config.consumer_regs, "PRODUCER_REGS": GLUON_PRODUCER_REGS,
        "EXACT_DELTA_KEYS": EXACT_DELTA_KEYS, "BOTTOM_RIGHT": spec.bottom_right, "HAS_LEFT": spec.window_left,
        "HAS_RIGHT": has_right, "HAS_BAND": split_ds, "SPLIT_DS": split_ds,
        # dS tiles: each consumer's, or with a head-dim split each key group's, and its P tile (its consumers
        # compute each of them a part of the rows)
        "SHARED_DS": head_split > 1, "ROWS": config.block_m // head_split,
        "DS_BUFFERS": (config.consumers // head_split) * ((2 if split_ds else 1) * (2 if config.shared_dq else 1)
                                                           + (head_split > 1)),
        # without ALiBi only rows that see few keys have a large dS: split where they live (else every masked tile);
        # and from 128 lanes a program whose rows all see more runs a loop without the split (at 64 lanes the two
        # loops measured 10-11% slower than one)
        "COUNTED": split_ds and not spec.alibi, "LEAN_LOOP": split_ds and not spec.alibi and lanes >= 128,
        "ALIBI": spec.alibi, "D": spec.head_dim,
        "STORE_BY_POINTERS": backward_stores_by_pointers(spec, config), "GROUP_PARTS": config.group_split,
        **backward_sequence_options(spec.seqlens, spec.alibi, backward_stores_by_pointers(spec, config)),
    }


# the backward's: the producer's pointers (packed: dO's too); packed, the consumers' to dQ's accumulator; and the
# consumers' to dK and dV where they store them from registers
_BACKWARD_POINTER_PARAMS = {**_POINTER_PARAMS, "varlen": _POINTER_PARAMS["varlen"] + ", DO, stride_doh, stride_dol"}
_BACKWARD_CONSUMER_PARAMS = {"fixed": "", "seqlens_k": "", "varlen": ", DQA, stride_dqah, stride_dqal"}
STORE_PARAMS = ", DK, stride_dkb, stride_dkh, stride_dkl, DV, stride_dvb, stride_dvh, stride_dvl"


def backward_sequence_options(seqlens: str, alibi: bool, stores: bool) -> dict[str, str]:
    """sequence_options for the backward template (`stores`: dK and dV stored through pointers)."""
    consumers = _BACKWARD_CONSUMER_PARAMS[seqlens] + (STORE_PARAMS if stores else "") + (ALIBI_PARAMS if alibi else "")
    return {**sequence_options(seqlens), "POINTER_PARAMS": _BACKWARD_POINTER_PARAMS[seqlens],
            "POINTER_ARGS": _BACKWARD_POINTER_PARAMS[seqlens], "CONSUMER_PARAMS": consumers,
            "CONSUMER_ARGS": consumers}


def render_backward(spec: KernelSpec, config: GluonBackwardConfig) -> str:
    """Gluon source of the backward's dK/dV (and dQ-adding) kernel for one spec and config."""
    return TEMPLATES.render("attn_bwd.py.jinja", backward_options(spec, config))


def backward_source_path(spec: KernelSpec, config: GluonBackwardConfig) -> Path:
    return codegen.cache_dir() / f"gluon_bwd_{TEMPLATES.source_key('bwd', backward_options(spec, config))}.py"


def load_backward(spec: KernelSpec, config: GluonBackwardConfig) -> ModuleType:
    """Import the generated backward for (spec, config), rendering it into the kernel cache if needed."""
    return codegen.load(("gluon", "bwd", spec, config), lambda: backward_source_path(spec, config),
                        lambda: render_backward(spec, config), interpreted=False)
