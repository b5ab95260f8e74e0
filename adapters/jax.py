"""JAX adapter (planned: issue 6)."""
