"""Input tables (moved to :mod:`portable_loader.io`); this name stays for existing importers.

Example:
    >>> from portable_loader.inputs import open_input, open_inputs
"""

from portable_loader.io import InputTable, file_digest, open_input, open_inputs  # noqa: F401

__all__ = ["InputTable", "open_input", "open_inputs", "file_digest"]
