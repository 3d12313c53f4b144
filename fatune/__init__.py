"""fatune: autotuned FlashAttention kernels generated from Jinja2 templates for Triton."""

from fatune import huggingface, ops  # noqa: F401 - ops registers the fatune:: torch ops
from fatune.api import FlashAttention, attention, explain
from fatune.kernel.mask_spans import prepare_mask
from fatune.kernel.spec import AttentionConfig, GluonBackwardConfig, GluonConfig, KernelSpec, LaunchConfig
from fatune.runtime.dispatch import DispatchError
from fatune.runtime.plans import FallbackError
from fatune.tuning.first_use import autotune

huggingface.install()  # attn_implementation="fatune" in transformers, registered once transformers loads

__version__ = "0.1.0"
__all__ = ["AttentionConfig", "DispatchError", "FallbackError", "FlashAttention", "GluonBackwardConfig", "GluonConfig",
           "KernelSpec", "LaunchConfig", "attention", "autotune", "explain", "prepare_mask", "__version__"]
