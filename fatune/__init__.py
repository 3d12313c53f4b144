"""fatune: autotuned FlashAttention kernels generated from Jinja2 templates for Triton."""

from fatune import custom_op as _custom_op  # registers the fatune:: torch ops
from fatune.flash_attention import FlashAttention, attention, explain
from fatune.mask_spans import prepare_mask
from fatune.spec import AttentionConfig, KernelSpec, LaunchConfig

__version__ = "0.1.0"
__all__ = ["AttentionConfig", "FlashAttention", "KernelSpec", "LaunchConfig", "attention", "explain", "prepare_mask",
           "__version__"]
