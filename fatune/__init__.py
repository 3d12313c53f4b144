"""fatune: autotuned FlashAttention kernels generated from Jinja2 templates for Triton."""

from fatune import ops  # noqa: F401 - registers the fatune:: torch ops
from fatune.api import FlashAttention, attention, explain
from fatune.kernel.mask_spans import prepare_mask
from fatune.kernel.spec import AttentionConfig, GluonConfig, KernelSpec, LaunchConfig

__version__ = "0.1.0"
__all__ = ["AttentionConfig", "FlashAttention", "GluonConfig", "KernelSpec", "LaunchConfig", "attention", "explain",
           "prepare_mask", "__version__"]
