"""fatune: autotuned FlashAttention kernels generated from Jinja2 templates for Triton."""

from fatune.flash_attention import attention
from fatune.spec import AttentionConfig, KernelSpec, LaunchConfig

__version__ = "0.1.0"
__all__ = ["AttentionConfig", "KernelSpec", "LaunchConfig", "attention", "__version__"]
