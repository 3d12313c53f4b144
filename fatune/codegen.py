"""Render the Jinja2 templates into Triton source, cache it on disk and import it.

Flow: (KernelSpec, AttentionConfig) -> options dict -> template -> source file in the
cache directory -> imported module exposing `launch*` functions. The file name is a
hash of the template text, the parameters and the Triton version, so a changed
template or a Triton upgrade never reuses stale code; within one process each module
is imported once.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import jinja2
import triton

from fatune import signature
from fatune.mask_spans import NO_SPAN
from fatune.spec import AttentionConfig, KernelSpec, TritonExpr, lanes

Kind = Literal["fwd", "bwd", "dropout_mask"]
TEMPLATE_FILES: dict[str, str] = {
    "fwd": "attn_fwd.py.jinja",
    "bwd": "attn_bwd.py.jinja",
    "dropout_mask": "attn_dropout_mask.py.jinja",
}
CACHE_ENV = "FATUNE_CACHE_DIR"
MERGE_SPLITS = 4  # split-KV partial results a merge loads at once (decode B=1, L_k=32k on an H200: 16 splits)
log = logging.getLogger("fatune")

_TITLES = {
    "fwd": "FlashAttention forward: O = softmax(Q K^T * sm_scale) V and the per-row LSE.",
    "bwd": "FlashAttention backward: Delta = rowsum(dO * O), dK/dV and dQ, P recomputed tile by tile from the LSE.",
    "dropout_mask": "The dropout keep-mask of the attention kernels, materialised for tests and debugging.",
}


def template_dir() -> Path:
    """The templates folder: packaged as fatune/templates in a wheel, ./templates in a checkout."""
    packaged = Path(__file__).resolve().parent / "templates"
    if packaged.is_dir():
        return packaged
    checkout = Path(__file__).resolve().parent.parent / "templates"
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError(f"fatune templates not found in {packaged} or {checkout}")


@functools.lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["pyrepr"] = lambda value: str(value) if isinstance(value, TritonExpr) else repr(value)
    return env


@functools.lru_cache(maxsize=1)
def template_hash() -> str:
    """Hash of every template's text: changes whenever any generated code could change."""
    digest = hashlib.sha256()
    for path in sorted(template_dir().glob("*.jinja")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def template_options(kind: Kind, spec: KernelSpec, config: AttentionConfig) -> dict[str, Any]:
    """The one options dict a template renders from: constexpr constants, switches, parameter lists."""
    constants = spec.options()
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
        # float32 gradients are Kahan-summed, which atomics cannot do (launch.resolve drops it too)
        structure["ATOMIC_DQ"] = bool(config.dkdv.atomic_dq) and spec.dtype != "float32"
        structure["TMA_DQ"] = structure["ATOMIC_DQ"] and config.dkdv.atomic_dq == 2
        structure["TMA_BWD"] = bool(config.dkdv.tma)
        structure["SPLIT_D"] = config.dkdv.split_d == 2
        # the dQ kernel reads Delta from a pass of its own, so it can run beside the dK/dV kernel
        structure["CONCURRENT_DQ"] = bool(config.dq.concurrent) and not structure["ATOMIC_DQ"]
        if structure["SPLIT_D"]:  # the head-dim half of dK, dV (and atomic dQ) each program owns
            constants.update(OWN_D=lanes(spec.head_dim) // 2, OWN_DV=lanes(spec.head_dim_v) // 2)
    return {
        "template_name": TEMPLATE_FILES[kind],
        "title": _TITLES[kind],
        "spec_json": json.dumps(spec.to_dict(), sort_keys=True),
        "config_json": json.dumps(used, sort_keys=True),
        "constants": constants,
        "signature": {name: signature.render(name, spec) for name in signature.PARAMS},
        "no_span": NO_SPAN,
        **spec.switches(),
        **structure,
    }


def render(kind: Kind, spec: KernelSpec, config: AttentionConfig) -> str:
    """Triton source of the forward ('fwd') or backward ('bwd') kernels for one spec and config."""
    if kind not in TEMPLATE_FILES:
        raise ValueError(f"kind: expected one of {sorted(TEMPLATE_FILES)}, got {kind!r}")
    return _environment().get_template(TEMPLATE_FILES[kind]).render(template_options(kind, spec, config))


def user_path(env: str, name: str) -> Path:
    """$env if set, else `name` in fatune's folder of the user's cache dir ($XDG_CACHE_HOME or ~/.cache)."""
    configured = os.environ.get(env)
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fatune" / name


def cache_dir() -> Path:
    """Where rendered sources go: $FATUNE_CACHE_DIR, else ~/.cache/fatune/kernels."""
    return user_path(CACHE_ENV, "kernels")


def source_key(kind: Kind, spec: KernelSpec, config: AttentionConfig) -> str:
    """Cache key: template text + parameters + Triton version."""
    options = template_options(kind, spec, config)
    payload = json.dumps(
        {"templates": template_hash(), "kind": kind, "options": options, "triton": triton.__version__},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def source_path(kind: Kind, spec: KernelSpec, config: AttentionConfig) -> Path:
    """The cache file that holds (or will hold) this kernel's source."""
    return cache_dir() / f"attn_{kind}_{source_key(kind, spec, config)}.py"


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


_modules: dict[tuple, ModuleType] = {}
_lock = threading.Lock()
_fallback_dir: Path | None = None


def _write_source(path: Path, source: str) -> Path:
    """Put `source` at `path` (unless it is there already) and return where it is.

    A cache folder that cannot be written (read-only home, a file in the way) costs one
    warning naming $FATUNE_CACHE_DIR; the sources then go to a private temporary folder.
    """
    global _fallback_dir
    try:
        if not path.exists() or path.read_text() != source:
            _write_atomically(path, source)
        return path
    except OSError as error:
        if _fallback_dir is None:
            _fallback_dir = Path(tempfile.mkdtemp(prefix="fatune-kernels-"))
            log.warning("fatune: cannot write generated kernels to %s (%s); set $%s to a writable folder. "
                        "Using %s in this process.", path.parent, error, CACHE_ENV, _fallback_dir)
        fallback = _fallback_dir / path.name
        _write_atomically(fallback, source)
        return fallback


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def patch_interpreter() -> None:
    """Fill two gaps of Triton 3.6's interpreter that the kernels meet, once per process.

    - `tl.dot` on bfloat16: the interpreter stores bfloat16 as uint16 bit patterns and multiplies those
      (results near 1e9 where the true ones are near 1); the operands are widened to float32 first, the
      products a tensor core makes from bfloat16 inputs.
    - float32 to bfloat16: the interpreter truncates, a bias every rounded P carries the same way (a GPU rounds
      to nearest even, as this patch does).
    - `tl.fma` on float32: the interpreter rounds the product and then the sum; a GPU's FMA rounds once.
    - TMA reductions (`tensor_descriptor.atomic_add`, which the TMA-dQ backward uses): the same adds,
      element by element.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_fatune_patched", False):
        return
    ir = interpreter._ir
    dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 in (a.dtype.scalar, b.dtype.scalar):
            a, b = (interpreter.TensorHandle(
                interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32), tl.float32)
                if x.dtype.scalar == tl.bfloat16 else x for x in (a, b))
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def create_descriptor_reduce(self, kind, desc, value, indices):
        if kind != ir.DESCRIPTOR_REDUCE_KIND.ADD:
            raise NotImplementedError(f"TMA reduction {kind} in Triton's interpreter (fatune emulates ADD only)")
        pointers, mask = desc.materialize_pointers(indices)
        op = ir.ATOMIC_OP.FADD if np.issubdtype(value.data.dtype, np.floating) else ir.ATOMIC_OP.ADD
        return self.create_atomic_rmw(op, pointers, value, mask, ir.MEM_SEMANTIC.RELAXED, None)

    cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return cast(self, src, dst_type)
        bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # to nearest, ties to even
        nan = np.isnan(src.data)
        rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)  # a quiet NaN, its sign kept
        return interpreter.TensorHandle(rounded, tl.bfloat16)

    def create_fma(self, x, y, z):
        if z.data.dtype != np.float32:
            return interpreter.TensorHandle(x.data * y.data + z.data, z.dtype.scalar)
        exact = x.data.astype(np.float64) * y.data.astype(np.float64) + z.data.astype(np.float64)
        return interpreter.TensorHandle(exact.astype(np.float32), z.dtype.scalar)

    builder.create_dot = create_dot
    builder.create_fma = create_fma
    builder.cast_impl = cast_impl
    if not hasattr(builder, "create_descriptor_reduce"):
        builder.create_descriptor_reduce = create_descriptor_reduce
    builder._fatune_patched = True


def load(kind: Kind, spec: KernelSpec, config: AttentionConfig) -> ModuleType:
    """Import the generated module for (kind, spec, config), rendering it into the cache if needed.

    After the first call for a key this is one dictionary lookup (it sits on every call's path).
    """
    memo_key = (kind, spec, config, interpreting())  # interpreted and compiled kernels are different objects
    module = _modules.get(memo_key)
    if module is not None:
        return module
    if memo_key[-1]:
        patch_interpreter()
    with _lock:
        module = _modules.get(memo_key)
        if module is None:
            path = _write_source(source_path(kind, spec, config), render(kind, spec, config))
            name = f"fatune_generated.{path.stem}{'_interp' if memo_key[-1] else ''}"
            module_spec = importlib.util.spec_from_file_location(name, path)
            assert module_spec is not None and module_spec.loader is not None
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module
            module_spec.loader.exec_module(module)
            _modules[memo_key] = module
    return module
