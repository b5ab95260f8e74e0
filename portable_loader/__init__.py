"""portable_loader: deterministic, resumable LLM data loading for JAX and PyTorch trainers."""

from portable_loader.sampler import LCGSampler

__all__ = ["LCGSampler"]
__version__ = "0.1.0"
