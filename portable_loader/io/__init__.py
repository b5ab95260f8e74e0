"""Reading inputs: one file's rows (:mod:`~portable_loader.io.tables`) and many files as one table
(:mod:`~portable_loader.io.files`).

Example:
    >>> import json, os
    >>> from portable_loader.io import open_inputs
    >>> os.makedirs("shards")
    >>> for name, text in [("a.jsonl", "one"), ("shards/b.jsonl", "two"), ("shards/c.jsonl", "three")]:
    ...     with open(name, "w") as f:
    ...         _ = f.write(json.dumps({"text": text}) + "\\n")
    >>> table = open_inputs(["a.jsonl", "shards/"])   # a file, then a folder's files
    >>> len(table), [row["text"] for _, row in table.read(0, 3)], table.where(2)
    (3, ['one', 'two', 'three'], ('shards/c.jsonl', 'line 1'))
"""

from portable_loader.io.files import MultiTable, describe, list_files, open_inputs
from portable_loader.io.tables import SUPPORTED, InputTable, file_digest, open_input

__all__ = ["InputTable", "MultiTable", "SUPPORTED", "describe", "file_digest", "list_files", "open_input", "open_inputs"]
