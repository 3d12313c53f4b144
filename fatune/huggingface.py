"""Hugging Face transformers models on fatune: ``attn_implementation="fatune"``.

`register()` adds fatune to transformers' public registries: the attention function (`AttentionInterface`) and
the mask function the models build their masks with (`AttentionMaskInterface`). `import fatune` registers it
without importing transformers: at once when transformers' modeling code is already loaded, else right after it
loads (an import hook that removes itself), so `import fatune` costs nothing where transformers is unused.

The mask function makes transformers' own boolean mask (SDPA's `sdpa_mask`), except where a cheaper form says
exactly the same; it remembers what each tensor it returns stands for (`form_of`), so the attention function
runs that form, and the window comes with the mask, never from a layer's arguments (as in SDPA). A model that
changes the mask on its way (adds a bias to it, say) passes on a new tensor, which runs as the mask it is.

- a causal or sliding-window layer without padding: no mask (is_causal, window_size);
- right-padded batches without a cache: the (B, L) padding mask, run as key lengths (seqlens_k);
- left-padded batches without a cache (a generation's prefill) and any padding that keeps one run of tokens per
  row: the kept tokens gathered into packed variable-length sequences, and put back;
- packed batches (DataCollatorWithFlattening's position_ids): transformers' block-diagonal mask, run as packed
  variable-length sequences (cu_seqlens) when it reaches the attention unchanged;
- everything else (padding with holes, a KV cache's offsets, a model's own mask functions, a model that asks for
  the mask as a tensor): the (B, 1, L_q, L_k) boolean mask.

What fatune cannot express (attention-logit soft-capping, attention sinks, T5's relative position bias, a sparse
indexer's selected keys, a head mask, any tensor argument the attention function does not know) raises an error
naming it; it never runs a call it would get wrong. A model whose class does not declare SDPA support (its layers
may run its own attention on the mask) gets eager's additive mask; one that slices its masks' query rows
(Gemma-4's KV-shared layers) gets them as tensors, and its layers' fewer queries than keys without a mask align
the last query with the last key, as transformers assumes of backends other than sdpa. The output is contiguous, as SDPA's path
gives it; `output_attentions=True` gets no weights, said once.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
import weakref
from typing import Any, Callable

import torch

from fatune.api import attention
from fatune.kernel.mask_spans import prepare_mask
from fatune.logs import warn_once

NAME = "fatune"
_HOOKED_MODULE = "transformers.modeling_utils"  # AttentionInterface's home: loaded before any model is built
# what the mask function reads of transformers' masking code (transformers >= 5); a packed batch's mask remaps
# the base mask's positions to each sequence's where transformers has remap_positions_for_packed_sequence
_MASKING_NAMES = ("AttentionMaskInterface", "sdpa_mask", "causal_mask_function", "sliding_window_causal_mask_function",
                  "and_masks", "packed_sequence_mask_function")
_registered = False
_lock = threading.Lock()


def unsupported() -> str | None:
    """Why ``attn_implementation="fatune"`` cannot register with the installed transformers (None: it can)."""
    try:
        import transformers
        from transformers import masking_utils, modeling_utils
    except ImportError as error:
        return f"transformers cannot be imported ({error})"
    needed = [(modeling_utils, "AttentionInterface")] + [(masking_utils, name) for name in _MASKING_NAMES]
    if not all(hasattr(module, name) for module, name in needed):
        return f"it needs transformers >= 5 (its masking functions), found {transformers.__version__}"
    return None


def register() -> bool:
    """Register ``attn_implementation="fatune"`` with transformers (imported here); False if transformers is not
    installed or lacks what fatune's functions use (transformers >= 5: `unsupported` says why). `import fatune`
    calls it once transformers' modeling code loads; calling it again is cheap and harmless."""
    global _registered
    with _lock:  # registered again where asked again: a registry another library reset is healed
        reason = unsupported()
        if reason is not None:
            if not reason.startswith("transformers cannot be imported"):
                warn_once(f"fatune: attn_implementation='fatune' is not available: {reason}")
            return False
        from transformers import masking_utils
        from transformers.modeling_utils import AttentionInterface

        AttentionInterface.register(NAME, attention_forward)
        masking_utils.AttentionMaskInterface.register(NAME, mask)
        _registered = True
        return True


def _register_quietly() -> None:
    try:
        register()
    except Exception as error:  # noqa: BLE001 - registering may fail; importing fatune or transformers must not
        warn_once(f"fatune: attn_implementation='fatune' is not available ({type(error).__name__}: {error})")


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Registers fatune once transformers' modeling code has run, and leaves sys.meta_path then (a lookup alone,
    or an import that fails, leaves it waiting for the next import)."""

    _finding = False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname != _HOOKED_MODULE or self._finding or _registered:
            return None
        self._finding = True  # the lookup below asks every finder again, this one included
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _RegisteringLoader(spec.loader, self)
        return spec


class _RegisteringLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, finder: _RegisterAfterImport):
        self.loader, self.finder = loader, finder

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        _register_quietly()
        if self.finder in sys.meta_path:
            sys.meta_path.remove(self.finder)

    def __getattr__(self, name: str):
        return getattr(self.loader, name)


def install() -> None:
    """What `import fatune` runs: register now if transformers' modeling code is loaded, else once it loads (if
    transformers is installed at all)."""
    if _HOOKED_MODULE in sys.modules:
        _register_quietly()
    elif importlib.util.find_spec("transformers") is not None and \
            not any(isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())


# -- the mask function ------------------------------------------------------------------------------------------

class Form:
    """What a mask the mask function made says, in the form fatune runs it: `kind` "plain" (no mask: causal,
    within `window`), "lengths" (the mask is a right-padded (B, L) padding mask: key lengths), "unpadded" (a
    (B, L) padding mask keeping one run of tokens per row, left padding say: those tokens run as packed
    sequences) or "packed" (a packed batch: the (B, L) `sequence_ids`), and the sliding window (None: none) of
    the layers it is for."""

    def __init__(self, kind: str, window: int | None, sequence_ids: torch.Tensor | None = None):
        self.kind, self.window, self.sequence_ids = kind, window, sequence_ids
        self._offsets: tuple[torch.Tensor, int] | None = None
        self._kept: torch.Tensor | None = None

    def offsets(self) -> tuple[torch.Tensor, int]:
        """cu_seqlens (int32) and the longest sequence of a packed batch (its sequence ids) or of an unpadded one
        (its kept tokens per row), worked out once for all its layers."""
        if self._offsets is None:
            self._offsets = _sequence_offsets(self.sequence_ids)
        return self._offsets

    def kept(self, padding: torch.Tensor) -> torch.Tensor:
        """The flat indices of an unpadded batch's kept tokens (row after row), worked out once."""
        if self._kept is None:
            self._kept = padding.reshape(-1).nonzero().squeeze(1)
            counts = padding.sum(-1, dtype=torch.int32)
            cu_seqlens = torch.cat([counts.new_zeros(1), counts.cumsum(0, dtype=torch.int32)])
            self._offsets = (cu_seqlens, int(counts.max()))
        return self._kept


_forms: dict[int, tuple[weakref.ref, Form]] = {}  # by id of the mask tensor the mask function returned


def _remember(tensor: torch.Tensor, form: Form) -> torch.Tensor:
    key = id(tensor)
    _forms[key] = (weakref.ref(tensor, lambda _: _forms.pop(key, None)), form)
    return tensor


def form_of(attention_mask: torch.Tensor | None) -> Form | None:
    """The Form of a mask the mask function made, as the model passed it on (None for any other tensor: one the
    model changed, or a mask the user made)."""
    found = _forms.get(id(attention_mask)) if attention_mask is not None else None
    return found[1] if found is not None and found[0]() is attention_mask else None


def mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
         mask_function: Callable | None = None, attention_mask: torch.Tensor | None = None,
         local_size: int | None = None, allow_is_causal_skip: bool = True, **kwargs: Any) -> torch.Tensor | None:
    """transformers' mask function for fatune (AttentionMaskInterface): transformers' own `sdpa_mask`, except
    where a cheaper form says the same (see the module's docstring), which it returns as a tensor it remembers
    (form_of): a model that changes the mask gets a new tensor, which runs as the mask it is."""
    from transformers import masking_utils

    arguments = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function or masking_utils.causal_mask_function,
                     attention_mask=attention_mask, local_size=local_size,
                     allow_is_causal_skip=allow_is_causal_skip, **kwargs)
    tracing = torch.compiler.is_compiling()
    if not _declares_sdpa(kwargs.get("config")):  # its layers may run their own attention, adding the mask to scores
        return masking_utils.eager_mask(**arguments)
    if not tracing and q_offset == 0 and kv_offset == 0 and q_length == kv_length:
        compact = _compact(arguments["mask_function"], attention_mask, local_size, allow_is_causal_skip, kv_length,
                           batch_size, kwargs.get("device", "cpu"))
        if compact is not None and compact[0] is not None and _slices_masks(kwargs.get("config")):
            compact = None  # the model slices the masks' query rows: it gets them as (B, 1, L_q, L_k) tensors
        if compact is not None:
            tensor, form = compact
            if form.kind != "packed":
                return tensor if tensor is None else _remember(tensor, form)
            dense = masking_utils.sdpa_mask(**arguments)  # a packed batch: the model may need the mask as it is
            return _remember(dense, form) if isinstance(dense, torch.Tensor) else dense
    dense = masking_utils.sdpa_mask(**arguments)
    heads = getattr(kwargs.get("config"), "num_attention_heads", None)
    if isinstance(dense, torch.Tensor) and isinstance(heads, int) and not tracing:
        try:  # its tiles' spans made once for every layer (fatune.prepare_mask), not scanned again by each
            dense = prepare_mask(dense, (batch_size, heads, q_length, kv_length))
        except (TypeError, ValueError):
            pass  # a mask it does not take is scanned per call, as any mask
    return dense


def _slices_masks(config: Any) -> bool:
    """Whether a model of `config` slices its masks' query rows on its way (Gemma-4 before its KV-shared layers)."""
    return bool(getattr(config, "num_kv_shared_layers", 0))


def _declares_sdpa(config: Any) -> bool:
    """Whether the model class of `config` declares SDPA, flash-attn or attention-interface support, or cannot be
    found: its layers then take SDPA's masks (boolean, or none for a causal layer). A class without any (GIT, say)
    may run its own attention on the mask it gets, added to the scores: it gets eager's additive mask, which
    fatune's attention runs as well."""
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str):
        return True
    supported = _sdpa_support.get(model_type)
    if supported is None:
        supported = True
        try:
            from transformers.models.auto import modeling_auto

            for mapping in (modeling_auto.MODEL_MAPPING_NAMES, modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
                name = mapping.get(model_type)
                model_class = _transformers_class(name) if isinstance(name, str) else None
                if model_class is not None:  # (Gemma2 declares flash-attn and the attention interface, not SDPA)
                    supported = any(getattr(model_class, flag, True) for flag in (
                        "_supports_sdpa", "_supports_flash_attn", "_supports_attention_backend"))
                    break
        except Exception:  # noqa: BLE001 - a transformers without these mappings: as before
            supported = True
        _sdpa_support[model_type] = supported
    return supported


_sdpa_support: dict[str, bool] = {}


def _transformers_class(name: str) -> Any:
    import transformers

    try:
        return getattr(transformers, name)
    except (AttributeError, ImportError):
        return None


def _compact(mask_function: Callable, padding: torch.Tensor | None, window: int | None, skip: bool, length: int,
             batch: int, device: torch.device | str) -> tuple[torch.Tensor | None, Form] | None:
    """(the tensor to return, its Form) where a cheaper form says what `mask_function` over `padding` does for a
    call without a cache (queries and keys the same `length` tokens); None where none does. A model that asked
    for the mask as a tensor (allow_is_causal_skip=False: it combines the mask with something) gets it, except
    for a packed batch (transformers asks for the tensor there itself), whose tensor is remembered."""
    from transformers import masking_utils

    base = masking_utils.causal_mask_function if window is None else \
        masking_utils.sliding_window_causal_mask_function(window)
    if _same_function(mask_function, base, []):
        if not skip:
            return None
        if padding is None:  # causal: no mask at all, or a (B, L) marker that carries the window
            return (None, Form("plain", None)) if window is None else \
                (torch.ones(batch, length, dtype=torch.bool, device=device), Form("plain", window))
        padding = padding[:, :length] if padding.shape[-1] >= length else None  # the keys sdpa_mask reads
        if padding is None or padding.dtype != torch.bool:
            return None
        lengths = padding.sum(-1, keepdim=True)
        positions = torch.arange(length, device=padding.device)
        if torch.equal(padding, positions < lengths):
            return padding, Form("lengths", window)
        first = padding.to(torch.int8).argmax(-1, keepdim=True)  # one run of kept tokens per row (left padding)
        if torch.equal(padding, (positions >= first) & (positions < first + lengths)):
            return padding, Form("unpadded", window)
        return None
    if padding is not None:
        return None
    tensors: list[torch.Tensor] = []  # a packed batch's position ids (where remapped), then its sequence ids
    placeholder = torch.zeros((1, 1), dtype=torch.long)
    remap = getattr(masking_utils, "remap_positions_for_packed_sequence", None)
    # (the base mask on positions within each sequence or on the batch's: the same mask, causal or windowed)
    packed = masking_utils.and_masks(remap(base, placeholder) if remap else base,
                                     masking_utils.packed_sequence_mask_function(placeholder))
    if _same_function(mask_function, packed, tensors) and len(tensors) == 1 + bool(remap) and \
            tensors[-1].shape[-1] == length:
        return None, Form("packed", window, tensors[-1])
    return None


def _same_function(function: Any, reference: Any, tensors: list[torch.Tensor]) -> bool:
    """Whether `function` is `reference` or a closure of the same code over the same values (functions compared
    alike, any tensor matching a tensor: those of `function` are appended to `tensors`)."""
    if function is reference:
        return True
    if isinstance(reference, torch.Tensor):
        if isinstance(function, torch.Tensor):
            tensors.append(function)
            return True
        return False
    if isinstance(reference, tuple):
        return isinstance(function, tuple) and len(function) == len(reference) and \
            all(_same_function(f, r, tensors) for f, r in zip(function, reference))
    code = getattr(reference, "__code__", None)
    if code is None:
        return type(function) is type(reference) and function == reference
    if getattr(function, "__code__", None) is not code:
        return False
    cells = [cell.cell_contents for cell in function.__closure__ or ()]
    reference_cells = [cell.cell_contents for cell in reference.__closure__ or ()]
    return len(cells) == len(reference_cells) and \
        all(_same_function(c, r, tensors) for c, r in zip(cells, reference_cells))


# -- the attention function -------------------------------------------------------------------------------------

def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention function for fatune (AttentionInterface): query (B, H, L_q, D), key and value
    (B, H_kv, L_k, D) not repeated for GQA; returns (B, L_q, H, D_v) and no weights. The mask decides, as in
    SDPA: a layer's own `sliding_window` argument is not read (its mask carries the window)."""
    _refuse_unsupported(module, kwargs)
    q_length, kv_length = query.shape[2], key.shape[2]
    # SDPA's alignment: query i sees keys up to i (with seqlens_k, a window or packed sequences fatune would align
    # the last query with the last key)
    common = dict(dropout_p=dropout, scale=scaling, enable_gqa=key.shape[1] != query.shape[1],
                  causal_alignment="top_left")
    form = form_of(attention_mask)
    offsets = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    # a packed batch whose collator gave the sequences' offsets (return_flash_attn_kwargs=True) and no position_ids:
    # a causal layer runs the sequences flash-attn's path would run, with its window if it has one
    collated = query.shape[0] == 1 and q_length == kv_length and all(isinstance(t, torch.Tensor) for t in offsets)
    if form is not None:
        window_size = (form.window - 1, 0) if form.window else (-1, -1)
        if form.kind == "plain" and collated:
            return _collated(query, key, value, offsets, window_size, kwargs, common), None
        if form.kind == "packed":
            cu_seqlens, longest = form.offsets()
            return _varlen(query, key, value, cu_seqlens, cu_seqlens, longest, longest, window_size, common), None
        if form.kind == "unpadded":
            return _unpadded(query, key, value, attention_mask, form, window_size, common), None
        seqlens = attention_mask.sum(-1, dtype=torch.int32) if form.kind == "lengths" else None
        out = attention(query, key, value, is_causal=True, window_size=window_size, seqlens_k=seqlens, **common)
        return out.transpose(1, 2).contiguous(), None
    if attention_mask is not None and attention_mask.dim() != 4:
        raise NotImplementedError(f"attn_implementation='fatune' takes the masks its mask function makes and 4-d "
                                  f"masks; {type(module).__name__} passed a {attention_mask.dim()}-d one")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(q_length > 1 and attention_mask is None and causal)
    if causal and collated:
        return _collated(query, key, value, offsets, (-1, -1), kwargs, common), None
    if causal and kv_length > q_length:
        if _slices_masks(getattr(module, "config", None)):
            # queries the model kept of more (Gemma-4's KV-shared layers keep the last logits_to_keep): as under
            # flash-attn, which transformers assumes there for backends other than sdpa, the last query sees every key
            common["causal_alignment"] = "bottom_right"
        else:  # an empty static cache's prefill (sdpa_mask gives no mask): the keys past the queries are unwritten
            key, value = key[:, :, :q_length], value[:, :, :q_length]
    out = attention(query, key, value, attention_mask, is_causal=causal, **common)
    return out.transpose(1, 2).contiguous(), None


_UNSUPPORTED = {
    "softcap": "attention-logit soft-capping (config.attn_logit_softcapping)",
    "s_aux": "attention sinks (the model's `sinks` parameter)",
    "sinks": "attention sinks (the model's `sinks` parameter)",
    "position_bias": "a relative position bias added to the scores (position_bias, T5-style models)",
    "indices": "a sparse indexer's selected keys (indices=, passed to backends other than eager and sdpa)",
    "block_indices": "a sparse indexer's selected key blocks (block_indices=)",
    "head_mask": "a head mask",
}
# arguments transformers' models pass that change nothing fatune computes (or that it reads itself), whatever their
# value; any other tensor argument may carry a feature fatune would ignore, and is refused
_KNOWN = {"sliding_window", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
          "seq_idx", "num_items_in_batch", "output_hidden_states", "output_attentions", "output_router_logits",
          "deterministic", "cache_position", "position_embeddings", "use_cache", "layer_idx", "past_key_values",
          "past_key_value", "token_type_ids", "return_dict", "cache", "mm_token_type_ids", "encoder_hidden_states",
          "encoder_attention_mask", "labels", "shift_labels", "ignore_index", "logits_to_keep"}  # (the loss's too)


def _refuse_unsupported(module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    for name, value in kwargs.items():
        feature = _UNSUPPORTED.get(name)
        if feature is None and name not in _KNOWN and isinstance(value, torch.Tensor):
            feature = f"the tensor argument {name}= (not one fatune knows: it would be ignored)"
        if feature is not None and value is not None:
            raise NotImplementedError(
                f"attn_implementation='fatune' does not support {feature}, which {type(module).__name__} uses; "
                f"load the model with attn_implementation='eager' or 'sdpa'")
    if kwargs.get("output_attentions"):
        warn_once(f"fatune: attn_implementation='fatune' computes no attention weights: output_attentions=True "
                  f"returns none for {type(module).__name__} (attn_implementation='eager' returns them)")


def _collated(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, offsets: tuple, window_size: tuple[int, int],
              kwargs: dict[str, Any], common: dict[str, Any]) -> torch.Tensor:
    """A packed batch's causal call on the sequences its collator's offsets (cu_seq_lens_q/k) give; (B, L, H, D_v)."""
    return _varlen(query, key, value, offsets[0].to(torch.int32), offsets[1].to(torch.int32),
                   kwargs.get("max_length_q"), kwargs.get("max_length_k"), window_size, common)


def _varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens_q: torch.Tensor,
            cu_seqlens_k: torch.Tensor, longest_q: int | None, longest_k: int | None, window_size: tuple[int, int],
            common: dict[str, Any]) -> torch.Tensor:
    """fatune's variable-length causal call on the batch's rows one after another; (B, L, H, D_v)."""
    batch, heads, length, _ = query.shape
    tokens = lambda t: t.transpose(1, 2).reshape(batch * t.shape[2], t.shape[1], t.shape[3])  # noqa: E731
    out = attention(tokens(query), tokens(key), tokens(value), is_causal=True, window_size=window_size,
                    cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=longest_q,
                    max_seqlen_k=longest_k, **common)
    return out.view(batch, length, heads, -1)


def _unpadded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, padding: torch.Tensor, form: Form,
              window_size: tuple[int, int], common: dict[str, Any]) -> torch.Tensor:
    """A batch whose rows keep one run of tokens each: those tokens gathered into packed sequences, run as
    fatune's variable-length causal call, and put back in their places; padded places get 0. (B, L, H, D_v)."""
    batch, heads, length, _ = query.shape
    kept = form.kept(padding)
    cu_seqlens, longest = form.offsets()
    tokens = lambda t: t.transpose(1, 2).reshape(batch * length, t.shape[1], t.shape[3]).index_select(0, kept)  # noqa: E731
    out = attention(tokens(query), tokens(key), tokens(value), is_causal=True, window_size=window_size,
                    cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=longest, max_seqlen_k=longest,
                    **common)
    placed = out.new_zeros(batch * length, heads, out.shape[-1]).index_copy(0, kept, out)
    return placed.view(batch, length, heads, -1)


def _sequence_offsets(sequence_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seqlens int32, the longest sequence) of a (B, L) tensor of sequence ids: each row's tokens split where
    the id changes, the rows one after another."""
    batch, length = sequence_ids.shape
    flat = sequence_ids.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::length] = True  # a row starts a sequence
    cu_seqlens = torch.cat([starts.nonzero().flatten(), flat.new_tensor([batch * length])]).to(torch.int32)
    return cu_seqlens, int(cu_seqlens.diff().max())
