"""The Triton family's code generation: the options its templates (templates/triton/) render from.

Flow: (KernelSpec, AttentionConfig) -> options dict -> template -> source file in the kernel cache ->
imported module (fatune.kernel.codegen). `render` gives the source of the forward ('fwd'), backward ('bwd')
or dropout keep-mask ('dropout_mask') kernels of one spec and config; `load` imports it.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from fatune.kernel import codegen
from fatune.kernel.codegen import Templates, TritonExpr
from fatune.kernel.interpreter import patch_interpreter
from fatune.kernel.mask_spans import NO_SPAN
from fatune.kernel.spec import AttentionConfig, KernelSpec, lanes, lse_dtype_name
from fatune.kernel.triton import signature
from fatune.settings import interpreting

TEMPLATES = Templates("triton")
Kind = Literal["fwd", "bwd", "dropout_mask"]
TEMPLATE_FILES: dict[str, str] = {
    "fwd": "attn_fwd.py.jinja",
    "bwd": "attn_bwd.py.jinja",
    "dropout_mask": "attn_dropout_mask.py.jinja",
}
MERGE_SPLITS = 4  # split-KV partial results a merge loads at once (decode B=1, L_k=32k on an H200: 16 splits)
_TITLES = {
    "fwd": "FlashAttention forward: O = softmax(Q K^T * sm_scale) V and the per-row LSE.",
    "bwd": "FlashAttention backward: Delta = rowsum(dO * O), dK/dV and dQ, P recomputed tile by tile from the LSE.",
    "dropout_mask": "The dropout keep-mask of the attention kernels, materialised for tests and debugging.",
}


def spec_constants(spec: KernelSpec) -> dict[str, Any]:
    """Upper-case constants the templates turn into `tl.constexpr` values."""
    return {
        "HEAD_DIM": spec.head_dim,
        "HEAD_DIM_V": spec.head_dim_v,
        "BLOCK_D": lanes(spec.head_dim),
        "BLOCK_DV": lanes(spec.head_dim_v),
        "DOT_PRECISION": "ieee" if spec.dtype == "float32" else "tf32",
        # Delta = rowsum(dO * O) is later subtracted from dP (cancellation): for float32
        # inputs it is summed in float64 so its rounding stays below dP's.
        "DELTA_ACC": TritonExpr("tl.float64" if spec.dtype == "float32" else "tl.float32"),
        # the per-row LSE (log2 units): P = exp2(S - LSE) loses the LSE's rounding at |LSE|'s magnitude
        # (4e-6 at 40), a float32 S's own size: float64 for float32 inputs (float32 dV's errors past 2x
        # torch's on 12 of 88 random calls, 6 with it); 16-bit rounding is far coarser
        "LSE_DTYPE": TritonExpr(lse_dtype_name(spec.dtype, spec.attn_mask)),
        # at head dims up to 32 the tile products are cheap next to the rest of a tile's work, and
        # dS's 16-bit rounding dominates dQ's error: split dS into hi + lo in every tile, not just
        # the masked ones (fp16 d16 causal dQ was 2.06x torch's error, over the 2x rule)
        "SPLIT_DS_EVERYWHERE": spec.dtype != "float32" and max(spec.head_dim, spec.head_dim_v) <= 32,
        # dQ tiles whose rows see at most this many keys take Delta as sum P dP, not rowsum(dO * O): O's
        # rounding would reach their large dS (a row with one key gets dS = 0 exactly, as softmax's backward)
        "EXACT_DELTA_KEYS": 128,
    }

def spec_switches(spec: KernelSpec) -> dict[str, Any]:
    """Compile-time code-path switches: Jinja uses these to include or leave out code."""
    has_right = spec.causal or spec.window_right
    return {
        "HAS_RIGHT": has_right,
        "HAS_LEFT": spec.window_left,
        "HAS_BAND": has_right or spec.window_left,
        "IS_CAUSAL": spec.causal,
        # the query tiles further down see more keys (a band's right edge; most mask tensors: causal, prefix
        # LM, documents): the forward and dQ kernels launch them first, so the last wave is short
        "LATE_ROWS_FIRST": bool(has_right) or spec.attn_mask != "none",
        "BOTTOM_RIGHT": spec.bottom_right,
        "MASK_KIND": spec.attn_mask,
        "SEQLENS": spec.seqlens,
        "ALIBI": spec.alibi,
        "DROPOUT": spec.dropout,
        "PAGED": spec.paged,
        # Rows can end with every key masked (and -inf scores) in any tile, not just band tiles.
        "ANY_TILE_MASKS": spec.attn_mask != "none",
        # a boolean mask is applied with the band's, in masked tiles only (fatune.kernel.mask_spans' full tiles skip it)
        "HAS_SCORE_MOD": spec.attn_mask == "additive" or spec.alibi,
        # 16-bit dS is split into hi + lo parts in masked tiles (see attn_bwd.py.jinja)
        "SPLIT_DS": spec.dtype != "float32",
        # ... and with only a band to mask (no mask tensor or ALiBi, which can leave a row few keys anywhere),
        # only in masked tiles where some row sees at most EXACT_DELTA_KEYS keys: the rows whose dS is large.
        # A row that sees many keys has most of them in unmasked tiles, which never split (window 1024,
        # L = 8192: 2 of every ~17 tiles are masked; causal dQ took 10% less time without the splits)
        "SPLIT_DS_COUNTED": spec.dtype != "float32" and max(spec.head_dim, spec.head_dim_v) > 32 and
                            bool(has_right or spec.window_left) and spec.attn_mask == "none" and not spec.alibi,
        # float32 gradients are summed with Kahan compensation (see _common.py.jinja)
        "COMPENSATED": spec.dtype == "float32",
        "PAD_D": lanes(spec.head_dim) != spec.head_dim,
        "PAD_DV": lanes(spec.head_dim_v) != spec.head_dim_v,
    }


def template_options(kind: Kind, spec: KernelSpec, config: AttentionConfig) -> dict[str, Any]:
    """The one options dict a template renders from: constexpr constants, switches, parameter lists."""
    constants = spec_constants(spec)
    structure = {"PACK_GQA": False, "SPLIT_KV": False, "TMA": False, "ATOMIC_DQ": False, "TMA_DQ": False,
                 "TMA_BWD": False, "SPLIT_D": False, "CONCURRENT_DQ": False}
    if kind == "fwd":
        constants.update(BLOCK_M=config.fwd.block_m, BLOCK_N=config.fwd.block_n)
        structure.update({"PACK_GQA": bool(config.fwd.pack_gqa), "SPLIT_KV": config.fwd.num_splits != 1,
                          "TMA": bool(config.fwd.tma) and not spec.paged})  # no descriptor spans pages
        if structure["SPLIT_KV"]:
            constants["MERGE_SPLITS"] = MERGE_SPLITS
        used = {"fwd": config.fwd.to_dict()}
    elif kind == "dropout_mask":
        used = {}
    else:
        constants.update(
            DKDV_BLOCK_M=config.dkdv.block_m,
            DKDV_BLOCK_N=config.dkdv.block_n,
            DQ_BLOCK_M=config.dq.block_m,
            DQ_BLOCK_N=config.dq.block_n,
        )
        used = {"dkdv": config.dkdv.to_dict(), "dq": config.dq.to_dict()}
        # float32 gradients are Kahan-summed, which atomics cannot do (resolve drops it too)
        structure["ATOMIC_DQ"] = bool(config.dkdv.atomic_dq) and spec.dtype != "float32"
        structure["TMA_DQ"] = structure["ATOMIC_DQ"] and config.dkdv.atomic_dq == 2
        structure["TMA_BWD"] = bool(config.dkdv.tma)
        structure["SPLIT_D"] = config.dkdv.split_d == 2
        # the dQ kernel reads Delta from a pass of its own, so it can run beside the dK/dV kernel
        structure["CONCURRENT_DQ"] = bool(config.dq.concurrent) and not structure["ATOMIC_DQ"]
        if structure["SPLIT_D"]:  # the head-dim half of dK, dV (and atomic dQ) each program owns
            constants.update(OWN_D=lanes(spec.head_dim) // 2, OWN_DV=lanes(spec.head_dim_v) // 2)
    return {
        "template_name": f"{TEMPLATES.folder}/{TEMPLATE_FILES[kind]}",
        "title": _TITLES[kind],
        "spec_json": json.dumps(spec.to_dict(), sort_keys=True),
        "config_json": json.dumps(used, sort_keys=True),
        "constants": constants,
        "signature": {name: signature.render(name, spec) for name in signature.PARAMS},
        "no_span": NO_SPAN,
        **spec_switches(spec),
        **structure,
    }


def render(kind: Kind, spec: KernelSpec, config: AttentionConfig) -> str:
    """Triton source of the forward ('fwd'), backward ('bwd') or dropout-mask kernels for one spec and config."""
    if kind not in TEMPLATE_FILES:
        raise ValueError(f"kind: expected one of {sorted(TEMPLATE_FILES)}, got {kind!r}")
    return TEMPLATES.render(TEMPLATE_FILES[kind], template_options(kind, spec, config))


def source_key(kind: Kind, spec: KernelSpec, config: AttentionConfig) -> str:
    """Cache key: template text + parameters + Triton version."""
    return TEMPLATES.source_key(kind, template_options(kind, spec, config))


def source_path(kind: Kind, spec: KernelSpec, config: AttentionConfig) -> Path:
    """The cache file that holds (or will hold) this kernel's source."""
    return codegen.cache_dir() / f"attn_{kind}_{source_key(kind, spec, config)}.py"


def load(kind: Kind, spec: KernelSpec, config: AttentionConfig) -> ModuleType:
    """Import the generated module for (kind, spec, config), rendering it into the cache if needed (its code
    hash: fatune.kernel.codegen.CODE_HASH)."""
    interpreted = interpreting()
    if interpreted:
        patch_interpreter()
    return codegen.load(("triton", kind, spec, config), lambda: source_path(kind, spec, config),
                        lambda: render(kind, spec, config), interpreted)
