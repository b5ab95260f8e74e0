"""The iterator of an ``IterDataset``: Grain's ``DatasetIterator`` API with a state that is a stream position.

``iter(ds)`` compiles the pipeline into its running parts (:mod:`portable_loader.dataset.iter.runtime`)
and wraps them in a :class:`DatasetIterator`. Its state (``get_state()``) is a JSON dict of fixed
size:

- ``version``: the format, 1;
- ``pipeline``: the dataset's fingerprint (source, operations, functions, seeds, mixture weights;
  not ``mp_prefetch``, ``read_options`` or ``batch_size``);
- ``cursor``: the named stream-position fields, each a 20-digit decimal string:
  ``"<n>.source.position"`` (the source index of the next element) per source,
  ``"<n>.random_map.count"`` / ``"<n>.map_with_index.count"`` (elements that operation has seen)
  and ``"<n>.mix.index"`` / ``"<n>.mix.stop"`` per mixture, ``<n>`` numbering the pipeline's nodes
  from the sources up;
- ``steps``, only where the pipeline has user-written steps (:mod:`~portable_loader.dataset.iter.opaque`):
  what each one's iterator's ``get_state()`` returned, by ``"<n>.<class name>"``; where such a
  step is the last one, the state is its own state alone, as in Grain;
- ``check``: a digest of the fields above, so an edited or damaged state is refused;
- where the last step is a ``WindowShuffleIterDataset``, also Grain's ``window_index`` (an int, the
  windows fully emitted), which Grain code reads: derived from the cursor and checked against it.

Example:
    >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
    >>> it = iter(to_iter_dataset(range(100)).filter(lambda x: x % 2).map_with_index(lambda i, x: (i, x)))
    >>> next(it), next(it)
    ((0, 1), (1, 3))
    >>> sorted(it.get_state()["cursor"].items())
    [('0.source.position', '00000000000000000004'), ('2.map_with_index.count', '00000000000000000002')]
"""

from __future__ import annotations

import copy
import itertools
import operator
import sys
import types
from collections.abc import Iterator, Mapping

from portable_loader.dataset.base import digest
from portable_loader.dataset.iter.dataset import (IterDataset, _BatchNode, _MixNode, _OpNode, _PrefetchNode, _SeedNode,
                                                  _SourceNode)
from portable_loader.dataset.iter.opaque import OpaqueIter, building, is_opaque, nested, nesting, state_form
from portable_loader.dataset.iter.ops import Segment
from portable_loader.dataset.iter.options import (DatasetOptions, IteratorContext, WithOptionsIterDataset,
                                                  pipeline_options)
from portable_loader.dataset.iter.runtime import (BatchIter, InlineExec, MixIter, OpIter, SourceIter, next_index,
                                                  set_next_index)
from portable_loader.errors import StateError
from portable_loader.lifecycle import Closing, close_at_exit

__all__ = ["DatasetIterator"]

STATE_VERSION = 1
_WIDTH = 20  # digits of every integer in a state: 2**64 fits, and the size never depends on the position


def _compile(root: IterDataset, options: DatasetOptions | None = None, pool=None, opaque: list | None = None):
    """The running parts for ``root``, with the pipeline's ``options`` (Grain's defaults where None).

    Nodes are numbered from the sources up (so adding a step downstream renames no field), skipping
    ``seed``, ``mp_prefetch`` and ``WithOptionsIterDataset``: field names, like the fingerprint, do
    not depend on them. ``pool``: the worker pool of an ``mp_prefetch`` above ``root`` (a user's
    step's parent, built inside the outer pipeline). A user's step (:mod:`~portable_loader.dataset.iter.opaque`)
    becomes an :class:`~portable_loader.dataset.iter.opaque.OpaqueIter` over the iterator its
    ``__iter__`` returns; its field is appended to ``opaque``. So is the field of a built-in step whose
    ``_make_part`` returns an ``OpaqueIter`` (an interleave over datasets whose states are not flat
    integers): its iterator runs as written and its state nests under ``steps``, as a user's would.
    """
    counter = itertools.count()
    opaque = [] if opaque is None else opaque
    options = DatasetOptions() if options is None else options
    ratios = (options.filter_warn_threshold_ratio, options.filter_raise_threshold_ratio)

    def seal(part):
        if isinstance(part, SourceIter):
            part.seal()
        return part

    def build(node, pool):
        if isinstance(node, (_SeedNode, WithOptionsIterDataset)):
            return build(node._parent, pool)
        if isinstance(node, _PrefetchNode):
            if node.num_workers == 0:
                return build(node._parent, pool)
            from portable_loader.dataset.iter.mp_prefetch import WorkerPool

            pool = WorkerPool(node.num_workers, node.buffer, node.worker_init_fn)
            return seal(build(node._parent, pool))  # what follows runs here, as in Grain
        if isinstance(node, _SourceNode):
            if pool is not None:
                from portable_loader.dataset.iter.mp_prefetch import PoolExec

                executor = PoolExec(pool)
            else:
                executor = InlineExec(threads=node.threads, buffer=node.buffer)
            return SourceIter(f"{next(counter)}.source.position", node.ds, Segment(node.allow_nones), executor, ratios,
                              f"to_iter_dataset(filters={', '.join(node.ds.filters)})")
        if isinstance(node, _OpNode):
            child = build(node._parent, pool)
            field, op = f"{next(counter)}.{node.op.kind}.count", copy.copy(node.op)  # its own generator per iterator
            if isinstance(child, SourceIter) and child.open:
                child.add(field, op)
                return child
            return OpIter(field, child, op, ratios)
        if isinstance(node, _BatchNode):
            child = seal(build(node._parent, pool))
            next(counter)
            return BatchIter(child, node.batch_size, node.drop_remainder, node.batch_fn)
        if isinstance(node, _MixNode):
            children = [seal(build(p, pool)) for p in node._parents]
            return MixIter(f"{next(counter)}.mix", children, node.proportions)
        if is_opaque(node) and not building(node):
            field = f"{next(counter)}.{type(node).__name__}"
            with nested(pool, options, node):
                iterator = node.__iter__()
            opaque.append(field)
            return OpaqueIter(field, iterator)
        make_part = getattr(node, "_make_part", None)
        if make_part is not None:  # a step defined in its own module (iter_pack, iter_concat_split)
            children = [seal(build(p, pool)) for p in node._parents]
            part = make_part(children, next(counter))
            if isinstance(part, OpaqueIter):  # a built-in step whose state is not a position here (its own, nested)
                opaque.append(part.field)
            return part
        if not isinstance(node, IterDataset):
            raise TypeError(f"{type(node).__name__} is not an IterDataset")
        raise TypeError(f"{type(node).__name__} subclasses IterDataset but defines no __iter__: a step of one's own "
                        "returns its DatasetIterator from __iter__ (Grain's abstract method)")

    return seal(build(root, pool))


class DatasetIterator(Closing):
    """An iterator over an :class:`IterDataset` whose state is a stream position; built by ``iter(ds)``.

    ``get_state()`` returns a JSON-serializable dict of fixed size (``version``, ``pipeline``: the
    dataset's fingerprint, ``cursor``: the position fields as 20-digit strings, ``check``: a digest
    of them); ``set_state(state)`` continues exactly where that state was taken, in O(1), at any
    ``mp_prefetch`` worker count. A state of another pipeline, an edited one or anything that is not
    a state raises :class:`portable_loader.errors.StateError`. ``close()`` (or ``with``, or garbage
    collection, or interpreter exit) ends the worker processes and threads.

    Example:
        >>> import json
        >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
        >>> ds = to_iter_dataset(range(10**8)).map(lambda x: x * 2)
        >>> with iter(ds) as it:
        ...     it.set_state(json.loads(json.dumps({**it.get_state(), "cursor": {"0.source.position": "%020d" % 10**7}})))
        Traceback (most recent call last):
        ...
        portable_loader.errors.StateError: loader state: field 'check': does not match the state's fields: the state was edited or damaged
        >>> with iter(ds) as it:
        ...     _ = [next(it) for _ in range(3)]
        ...     state = it.get_state()
        >>> state["cursor"]
        {'0.source.position': '00000000000000000003'}
        >>> with iter(ds) as it:
        ...     it.set_state(state)
        ...     next(it)
        6
    """

    #: ``DatasetIterator[int]``, as Grain code annotates and subclasses it (the parameter is not checked).
    __class_getitem__ = classmethod(types.GenericAlias)
    # What a user's subclass has before (or without) calling super().__init__, as Grain's base.
    _parents: tuple = ()
    _closed = False
    _root = None

    def __init__(self, parents=()):
        """``iter(ds)`` builds one over an ``IterDataset``; a user's subclass passes its parent iterator(s).

        As the base of a user's iterator (Grain's ``DatasetIterator.__init__(parents)``): one
        iterator, a sequence of them, or nothing (a source); a plain Python iterator counts as one
        parent. The subclass brings ``__next__``, ``get_state`` and ``set_state``.

        Example:
            >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
            >>> class Twice(DatasetIterator):
            ...     def __next__(self):
            ...         return 2 * next(self._parent)
            ...     def get_state(self):
            ...         return self._parent.get_state()
            ...     def set_state(self, state):
            ...         self._parent.set_state(state)
            >>> it = Twice(iter(to_iter_dataset(range(3))))
            >>> list(it), it._ctx.mp_context.process_count
            ([0, 2, 4], 1)
            >>> list(Twice(iter([5, 6])))           # over any iterator
            [10, 12]
        """
        if isinstance(parents, IterDataset):
            self._build(parents)
        else:
            self._adopt(parents)

    def _build(self, dataset: IterDataset) -> None:
        self._closed = True  # until built: a failed build leaves nothing to close
        self._dataset = dataset
        # Inside a user's step of an outer pipeline: that pipeline's workers and options (opaque.nested).
        pool, outer = nesting()
        if pool is not None and pool.started:  # too late to add a stream: read here (the stream is the same)
            pool = None
        options = pipeline_options(dataset)
        options = options if outer is None else outer.merge(options)
        # Grain code reads the options as ``it._ctx.dataset_options`` and walks ``it._parents``: the
        # whole pipeline runs in this one iterator, so it has the pipeline's options and no parents.
        self._ctx = IteratorContext(options)
        self._parents = ()
        self._opaque: list[str] = []  # the user's steps' fields: their states go under "steps"
        self._root = _compile(dataset, options, pool, self._opaque)
        self._names = [name for name in self._root.field_names() if name not in self._opaque]
        self._closed = False
        close_at_exit(self)
        _register_with_grain()

    def _adopt(self, parents) -> None:
        """Grain's base ``__init__``: the parents, their shared context, not closed."""
        missing = [m for m in ("__next__", "get_state", "set_state")
                   if getattr(type(self), m) is getattr(DatasetIterator, m)]
        if missing:
            raise TypeError(f"Can't instantiate abstract class {type(self).__name__} without an implementation for "
                            f"abstract method{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}")
        if isinstance(parents, Iterator) and not isinstance(parents, (list, tuple)):
            parents = (parents,)
        self._parents = tuple(parents)
        contexts = [p._ctx for p in self._parents if isinstance(getattr(p, "_ctx", None), IteratorContext)]
        self._ctx = contexts[0] if contexts else IteratorContext()
        for ctx in contexts[1:]:
            self._ctx.merge(ctx)
        for parent in self._parents:  # one context for the whole tree, as Grain shares it
            if hasattr(parent, "_ctx"):
                parent._ctx = self._ctx
        self._closed = False
        _register_with_grain()  # Grain's checkpoint handler then saves it as one of Grain's iterators

    @property
    def _parent(self):
        assert len(self._parents) == 1, self._parents
        return self._parents[0]

    def _assert_not_closed(self) -> None:
        if self._closed:
            raise ValueError(f"Trying to advance a closed iterator: '{self}'.")

    @property
    def _pipeline(self) -> str:
        # The fingerprint is taken when a state is first taken or given, not by iter(): a source
        # without its own fingerprint is read for it (up to 1,024 records), and nothing should be
        # read before the first next() (as in Grain). The dataset keeps it once computed.
        return self._dataset.fingerprint()

    def __iter__(self) -> "DatasetIterator":
        return self

    def __next__(self):
        if self._closed:
            raise ValueError("this DatasetIterator is closed")
        return self._root.next()

    def get_state(self) -> dict:
        """The stream position after the last element returned, as a small JSON-serializable dict.

        A user's steps in the pipeline add ``steps``: each one's own ``get_state()``, by field name.

        Example:
            >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
            >>> it = iter(to_iter_dataset(range(5)).filter(lambda x: x > 2))
            >>> next(it), it.get_state()["cursor"]
            (3, {'0.source.position': '00000000000000000004'})
        """
        fields = self._root.fields()
        if isinstance(self._root, OpaqueIter):  # a user's step is the last: its state is its own, as in Grain
            return fields[self._root.field]
        cursor = {name: f"{int(fields[name]):0{_WIDTH}d}" for name in self._names}
        steps = {name: fields[name] for name in self._opaque}
        state = {"version": STATE_VERSION, "pipeline": self._pipeline, "cursor": cursor}
        if steps:
            state["steps"] = steps
        return {**state, "check": _check(self._pipeline, cursor, steps), **self._grain_keys(fields)}

    def _grain_keys(self, fields: dict) -> dict:
        """Keys of Grain's own state that Grain code reads, where the last step has any (a window
        shuffle's ``window_index``): derived from the cursor, and checked against it on restore."""
        keys = getattr(self._root, "grain_keys", None)
        return {} if keys is None else keys(fields)

    def set_state(self, state: dict) -> None:
        """Continue from ``state`` (from ``get_state``, at any worker count); refused unless it is this pipeline's.

        Example:
            >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
            >>> it = iter(to_iter_dataset(range(5)))
            >>> it.set_state(iter(to_iter_dataset(range(6))).get_state())
            Traceback (most recent call last):
            ...
            portable_loader.errors.StateError: loader state: field 'pipeline': the state was saved by another pipeline (...); a different source, operation, function or seed, or a shuffle saved before shuffles took Grain's order
        """
        if self._closed:
            raise ValueError("this DatasetIterator is closed")
        if isinstance(self._root, OpaqueIter):
            self._root.restore({self._root.field: state}, StateError)
            return
        if not isinstance(state, Mapping):
            raise StateError(None, f"expected the dict that get_state() returns, got {type(state).__name__}")
        for key in ("version", "pipeline", "cursor", "check"):
            if key not in state:
                raise StateError(key, "missing")
        if state["version"] != STATE_VERSION:
            raise StateError("version", f"{state['version']!r} is not {STATE_VERSION}, the version this release reads")
        if state["pipeline"] != self._pipeline:
            raise StateError("pipeline", f"the state was saved by another pipeline ({state['pipeline']!r}, this one "
                                         f"is {self._pipeline!r}); a different source, operation, function or seed, "
                                         "or a shuffle saved before shuffles took Grain's order")
        cursor = state["cursor"]
        if not isinstance(cursor, Mapping) or sorted(cursor) != sorted(self._names):
            got = sorted(cursor) if isinstance(cursor, Mapping) else type(cursor).__name__
            raise StateError("cursor", f"fields {got} are not this pipeline's {sorted(self._names)}")
        fields = {}
        for name in self._names:
            value = cursor[name]
            if not isinstance(value, str) or len(value) != _WIDTH or not value.isdigit() or not value.isascii():
                raise StateError(name, f"{value!r} is not a {_WIDTH}-digit string")
            fields[name] = int(value)
        steps = state.get("steps", {})
        if not isinstance(steps, Mapping) or sorted(steps) != sorted(self._opaque):
            got = sorted(steps) if isinstance(steps, Mapping) else type(steps).__name__
            raise StateError("steps", f"user steps {got} are not this pipeline's {sorted(self._opaque)}")
        steps = {k: steps[k] for k in self._opaque}
        if state["check"] != _check(self._pipeline, {k: cursor[k] for k in self._names}, steps):
            raise StateError("check", "does not match the state's fields: the state was edited or damaged")
        fields.update(steps)
        for key, value in self._grain_keys(fields).items():
            if key in state and state[key] != value:
                raise StateError(key, f"{state[key]!r} does not match the cursor ({value!r}): the state was edited")
        self._root.restore(fields, StateError)

    def _get_next_index(self) -> int:
        """Grain's ``grain.experimental.get_next_index(it)``: the index of the element ``next`` returns.

        Defined where it is arithmetic: ``to_iter_dataset`` (the source position), ``map``,
        ``random_map``, ``map_with_index``, ``batch`` (batches), ``mp_prefetch``; through a filter,
        a mixture, packing or other stateful steps it is a ``ValueError`` (Grain documents the same
        for its filters and packing): ``get_state()`` is the position to use there.

        Example:
            >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
            >>> it = iter(to_iter_dataset(range(10)).map(lambda x: x * 2).batch(3))
            >>> it._get_next_index(), next(it).tolist(), it._get_next_index()
            (0, [0, 2, 4], 1)
            >>> it._set_next_index(3); next(it).tolist()
            [18]
        """
        if self._closed:
            raise ValueError("this DatasetIterator is closed")
        if self._root is None:
            raise NotImplementedError  # a user's iterator that does not define it, as Grain's base
        return next_index(self._root)

    def _set_next_index(self, index: int) -> None:
        """Grain's ``grain.experimental.set_next_index(it, index)``: continue at the element of that index.

        Where ``_get_next_index`` is defined; otherwise the same ``ValueError``. O(1): nothing is read.

        Example:
            >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
            >>> it = iter(to_iter_dataset(range(10)).map_with_index(lambda i, x: (i, x)))
            >>> it._set_next_index(7); next(it)
            (7, 7)
        """
        if self._closed:
            raise ValueError("this DatasetIterator is closed")
        if isinstance(index, bool):
            raise TypeError("set_next_index: index must be an integer, got bool")
        if self._root is None:
            raise NotImplementedError
        set_next_index(self._root, operator.index(index))

    def start_prefetch(self) -> None:
        """Nothing to start ahead of the first ``next``: workers start then (kept for Grain's API).

        A user's iterator passes it on to its parents, as Grain's base does.

        Example:
            >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
            >>> iter(to_iter_dataset([1])).start_prefetch()
        """
        for parent in self._parents:
            start = getattr(parent, "start_prefetch", None)
            if start is not None:
                start()

    def set_weights(self, weights) -> None:
        """Refused with a ``ValueError`` that says why: only ``pl.DataLoader`` over ``pl.mix(...)`` re-weights
        while running; this iterator follows its pipeline's own order (Grain's ``mix`` is a fixed interleave).

        Example:
            >>> from portable_loader.grain import MapDataset
            >>> it = iter(MapDataset.range(4).to_iter_dataset())
            >>> it.set_weights({"a": 1})
            Traceback (most recent call last):
            ...
            ValueError: set_weights: a Grain-style iterator follows its pipeline's own order; re-weight a pl.DataLoader over pl.mix(...) instead (its iterator's set_weights)
        """
        raise ValueError("set_weights: a Grain-style iterator follows its pipeline's own order; re-weight a "
                         "pl.DataLoader over pl.mix(...) instead (its iterator's set_weights)")

    def close(self) -> None:
        """End the worker processes and reader threads; safe to call twice.

        Example:
            >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
            >>> it = iter(to_iter_dataset([1, 2]))
            >>> it.close(); it.close()
        """
        if self._closed:
            return
        self._closed = True
        if self._root is not None:
            self._root.close()
        for parent in self._parents:  # a user's iterator closes its parents, as Grain's base does
            close = getattr(parent, "close", None)
            if close is not None:
                close()


def _register_with_grain() -> None:
    """Make our iterators ``grain.DatasetIterator``s for ``isinstance``, once Grain is imported.

    Grain's checkpoint handler (``grain.checkpoint.CheckpointHandler``, what Orbax uses) saves
    ``json.dumps(it.get_state())`` only for its ``DatasetIterator``s; anything else must return
    bytes. Importing Grain here would import JAX (Grain's pytrees use it when installed), which the
    core must not, so this registers only where the user's code has imported Grain already.
    """
    grain_ds = sys.modules.get("grain._src.python.dataset.dataset")
    if grain_ds is not None and not issubclass(DatasetIterator, grain_ds.DatasetIterator):
        grain_ds.DatasetIterator.register(DatasetIterator)


def _check(pipeline: str, cursor: dict, steps: dict | None = None) -> str:
    if not steps:  # a pipeline without user steps: the digest its states have always had
        return digest("IterDataset state", STATE_VERSION, pipeline, sorted(cursor.items()))
    return digest("IterDataset state", STATE_VERSION, pipeline, sorted(cursor.items()), state_form(steps))
