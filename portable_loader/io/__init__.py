"""Reading inputs: one file's rows (:mod:`~portable_loader.io.tables`) and many files as one table
(:mod:`~portable_loader.io.files`).

Example:
    >>> from portable_loader.io import open_inputs
    >>> table = open_inputs(["a.jsonl", "shards/"])  # doctest: +SKIP
"""

from portable_loader.io.files import MultiTable, describe, list_files, open_inputs
from portable_loader.io.tables import SUPPORTED, InputTable, file_digest, open_input

__all__ = ["InputTable", "MultiTable", "SUPPORTED", "describe", "file_digest", "list_files", "open_input", "open_inputs"]
