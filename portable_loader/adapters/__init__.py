"""Framework adapters: torch, JAX, the Hugging Face Trainer and Lightning (the only modules that import a framework)."""
