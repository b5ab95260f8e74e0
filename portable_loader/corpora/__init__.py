"""Token corpora: datasets of token ids, read in place or tokenized on read.

``pretokenized`` opens Megatron ``.bin/.idx``, OLMo ``.npy`` and nanoGPT token files memory-mapped;
``windows`` cuts a corpus into ``seq_len`` windows for ``packing="concat"``; ``tokenized`` runs the
precache formatter when a record is read, with ``spill`` handing tokenized records between
processes. Each corpus is a :class:`~portable_loader.dataset.Dataset`: modules here import the
random-access layer, ``io`` and ``collate``; the random-access layer never imports them.

Example:
    >>> import numpy as np, os, tempfile
    >>> from portable_loader.corpora import pretokenized
    >>> path = os.path.join(tempfile.mkdtemp(), "train.bin")
    >>> np.array([5, 6, 0, 7, 0], dtype=np.uint16).tofile(path)
    >>> corpus = pretokenized(path, eos_token_id=0)
    >>> len(corpus), corpus[1]["input_ids"].tolist()
    (2, [7, 0])
"""

from portable_loader.corpora.pretokenized import Pretokenized, pretokenized
from portable_loader.corpora.tokenized import Tokenized, tokenized

__all__ = ["Pretokenized", "Tokenized", "pretokenized", "tokenized"]
