"""PyTorch adapter (planned: issue 5)."""
