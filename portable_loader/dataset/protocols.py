"""The written-down contract between datasets, stream orders and the loader.

The loader reads a dataset through :class:`RandomAccess` (every dataset, ``pl.Dataset`` included)
and, where a dataset offers them, through the optional capabilities below; it serves a stream
position through a :class:`StreamOrder` (the LCG sampler, a mixture's order, the shard-group
order), and nothing else. A new dataset or order implements these and is served like ours.

Example:
    >>> import numpy as np
    >>> from portable_loader.dataset import source
    >>> from portable_loader.orders.sampler import LCGSampler
    >>> isinstance(source([{"input_ids": np.arange(3)}]), RandomAccess), isinstance(LCGSampler(4, seed=0), StreamOrder)
    (True, True)
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np

__all__ = ["Capabilities", "RandomAccess", "TokenLengths", "Filtered", "StreamOrder"]


@runtime_checkable
class RandomAccess(Protocol):
    """What every dataset offers: immutable, stateless, random access.

    ``__getitems__(indices)`` returns the elements at ``indices`` (a sequence or 1-D int array, each in
    ``[0, len)``) in that order, in one batched read; a filtered-out index reads as None.
    ``fingerprint()`` names the whole tree (sources, transforms, their parameters), is fixed when the
    dataset is built, and never changes when it is read: a loader state carries it and a state of
    another pipeline is refused. ``reopen()`` gives a worker process its own file handles (``self``
    when there are none).

    Example:
        >>> class Squares:
        ...     def __len__(self): return 3
        ...     def __getitems__(self, indices): return [i * i for i in indices]
        ...     def fingerprint(self): return "squares-3"
        ...     def reopen(self): return self
        >>> isinstance(Squares(), RandomAccess)
        True
    """

    def __len__(self) -> int: ...

    def __getitems__(self, indices: Sequence[int] | np.ndarray) -> list: ...

    def fingerprint(self) -> str: ...

    def reopen(self) -> "RandomAccess": ...


@runtime_checkable
class TokenLengths(Protocol):
    """Token records (dicts with ``input_ids``): what packing needs before anything is read.

    ``lengths(indices)`` is ``len(record["input_ids"])`` for each index, as int64; ``cheap_lengths``
    says it is answered without decoding tokens (a cache's offsets), so the planner may ask for a
    whole chunk of positions at once.

    Example:
        >>> import numpy as np
        >>> from portable_loader.dataset import source
        >>> ds = source([{"input_ids": np.arange(n)} for n in (2, 5)])
        >>> isinstance(ds, TokenLengths), ds.lengths([1, 0]).tolist()
        (True, [5, 2])
    """

    cheap_lengths: bool

    def lengths(self, indices: Sequence[int] | np.ndarray) -> np.ndarray: ...


@runtime_checkable
class Filtered(Protocol):
    """A tree with filters: ``filters`` names them (empty: none), ``accepts(indices)`` says which survive.

    The loader skips rejected positions as it plans, so batches stay full and the state stays a
    stream position.

    Example:
        >>> import numpy as np
        >>> from portable_loader.dataset import source
        >>> ds = source([{"input_ids": np.arange(n)} for n in (0, 3)]).filter(lambda r: r["input_ids"].size > 0)
        >>> ds.filters, ds.accepts([0, 1]).tolist()
        (('filter <lambda>',), [False, True])
    """

    filters: tuple[str, ...]

    def accepts(self, indices: Sequence[int] | np.ndarray) -> np.ndarray: ...


class Capabilities:
    """The optional capabilities of a dataset, with the value ``pl.Dataset`` gives each where a dataset
    has none: the loader reads them as attributes, never by probing.

    * ``spans(indices)``: where the records' tokens lie in mapped buffers (a
      :class:`~portable_loader.cache.readers.Spans`): the loader copies batches straight from them
      (caches, mixtures of caches). ``read_ahead(now, ahead)``: of the records ``ahead``, those worth
      reading together with ``now`` (a remote cache keeps within its ``cache_limit``).
    * ``collate_rows(rows, seq_len, pad_id, fields)``: the dataset builds the batch of a row plan
      itself (windows of a token stream, ``packing="concat"``). ``stream()``: the documents' tokens
      back to back, read straight from token files (``pl.pretokenized``); without it,
      ``packing="concat"`` finds them through the records.
    * ``tokenizes_ahead``: reading a record tokenizes it, so the loader's workers compute packing
      windows' lengths ahead of the planner (``pl.tokenized``), through ``unknown(indices)``,
      ``tokenize_ahead(indices, name)`` (in a worker: the lengths, the records handed over as file
      ``name``), ``learn(indices, lengths)`` and ``drop_handover(name=None)``
      (:mod:`portable_loader.engine.ahead`). A ``map`` over such a source and a mixture with one
      among its sources have it too and pass those calls down in their sources' record numbers.
    * ``source_groups()``, ``locate(indices)``, ``schedule_digests(position)``,
      ``schedule_change(saved, position)``: a mixture's sources, which source and record an index
      is, and the schedule checks a state carries; transforms pass them through from their parent.
    * ``fork_hazard``: why forked worker processes must not read the dataset (None: they may);
      ``reopen()``: the same dataset with its own file handles, for a worker process.

    Example:
        >>> import numpy as np
        >>> from portable_loader.dataset import mix, source
        >>> plain = source([{"input_ids": np.arange(3)}])
        >>> plain.spans, plain.collate_rows, plain.source_groups, plain.tokenizes_ahead
        (None, None, None, False)
        >>> mix({"a": plain, "b": plain}, {"a": 1, "b": 1}).map(dict).source_groups()[0]
        ('a', 'b')
    """

    spans = None
    read_ahead = None
    collate_rows = None
    stream = None
    tokenizes_ahead = False
    source_groups = None
    locate = None
    schedule_digests = None
    schedule_change = None
    fork_hazard: str | None = None


@runtime_checkable
class StreamOrder(Protocol):
    """Stream position -> dataset index: the one interface the planner takes every order through.

    ``stream_indices(positions)`` maps an array of positions in ``[0, len)`` (epochs concatenated;
    ``len`` is ``sys.maxsize`` when ``num_epochs`` is None); ``few(positions)`` does the same for a
    handful of Python integers already checked to be in range (a resume, a ``describe``), where
    numpy's per-call cost would dominate. ``seed`` and ``shuffle`` key the row order of packed
    windows. ``whole_epochs``: every run of ``len(dataset)`` positions from an epoch start holds each
    index once (True for the LCG sampler and the shard-group order; a mixture's sources repeat
    unevenly), which lets an error say a filter rejects every record.

    Example:
        >>> from portable_loader.orders.shard_order import ShardShuffle
        >>> order = ShardShuffle([2, 2], group=1, seed=3)
        >>> isinstance(order, StreamOrder), order.few([0, 1, 2, 3]) == order.stream_indices([0, 1, 2, 3]).tolist()
        (True, True)
    """

    seed: int
    shuffle: bool
    num_epochs: int | None
    whole_epochs: bool
    #: Stages of a mixture set while the loader ran (``it.set_weights``), which a state carries;
    #: empty for every other order.
    online: tuple | list

    def __len__(self) -> int: ...

    def stream_indices(self, positions: Sequence[int] | np.ndarray) -> np.ndarray: ...

    def few(self, positions: list[int]) -> list[int]: ...
