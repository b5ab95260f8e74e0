"""The fields a Hugging Face causal LM expects, from a loader batch (numpy in, numpy out).

``TorchLoader(hf_labels=True)`` applies ``hf_fields`` to every batch; ``portable_loader.adapters.hf``
and ``portable_loader.adapters.torch`` hand the name on. It needs neither torch nor transformers.

Example:
    >>> batch = {"input_ids": np.array([[5, 6, 7, 0]]), "loss_mask": np.array([[0, 1, 1, 0]]),
    ...          "attention_mask": np.array([[1, 1, 1, 0]])}
    >>> sorted(hf_fields(batch)), hf_fields(batch)["labels"].tolist()
    (['attention_mask', 'input_ids', 'labels', 'position_ids'], [[-100, 6, 7, -100]])
"""

from __future__ import annotations

import numpy as np

__all__ = ["IGNORE_INDEX", "hf_fields"]

IGNORE_INDEX = -100


def hf_fields(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What Hugging Face causal LMs expect, from a loader batch (numpy in, numpy out).

    ``labels``: ``input_ids`` where ``loss_mask``, else -100, and -100 at the first token of every
    packed document so that no document is trained to follow the one before it; ``attention_mask``:
    1 on real tokens; ``position_ids``: positions restarting per document (what flash-attention
    models use to keep packed documents apart). A padded batch without ``segment_ids`` and
    ``positions`` (the default) holds one document per row: its positions are 0, 1, ... on the
    row's real tokens.

    Example:
        >>> b = {"input_ids": np.array([[5, 6, 7, 0]]), "loss_mask": np.array([[1, 1, 1, 0]]),
        ...      "segment_ids": np.array([[1, 1, 2, 0]]), "positions": np.array([[0, 1, 0, 0]])}
        >>> hf_fields(b)["labels"].tolist()
        [[-100, 6, -100, -100]]
        >>> hf_fields({"input_ids": np.array([[5, 6, 0]]), "loss_mask": np.array([[1, 1, 0]]),
        ...            "attention_mask": np.array([[1, 1, 0]])})["position_ids"].tolist()
        [[0, 1, 0]]
    """
    ids = batch["input_ids"].astype(np.int64)
    real = batch["attention_mask"] > 0 if "attention_mask" in batch else batch["segment_ids"] > 0
    if "positions" in batch:
        positions = batch["positions"].astype(np.int64)
    else:  # one document per row, its tokens a prefix of the row
        positions = np.where(real, np.arange(ids.shape[-1], dtype=np.int64), 0)
    first = real & (positions == 0)
    mask = batch["loss_mask"] > 0 if "loss_mask" in batch else real
    labels = np.where(mask & ~first, ids, IGNORE_INDEX)
    return {
        "input_ids": ids,
        "labels": labels,
        "attention_mask": real.astype(np.int64),
        "position_ids": positions,
    }
