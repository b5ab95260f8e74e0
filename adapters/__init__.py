"""Framework adapters, installed as ``portable_loader.adapters`` (torch and jax; see their issues)."""
