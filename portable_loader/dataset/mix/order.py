"""The record order of a mixture: blocks, largest-remainder counts, staged weights; O(#sources) per block.

A stage covers the mixed stream from its ``start`` (a position in records) until the next stage's.
Its stream is cut into blocks of ``block`` records. With record weights ``w_i = nums[i] / den``,
``c_i(b)``, the count of source ``i`` in the first ``b`` blocks of the stage, is the largest-remainder
(Hamilton) rounding of ``w_i * b * block``: each source gets ``floor`` and the largest remainders
(ties: the lower source index) get one more, so ``|c_i(b) - w_i b K| < 1`` and ``sum_i c_i(b) = bK``.
Counts carry over from stage to stage (``base``). Block ``b`` holds ``c_i(b+1) - c_i(b)`` records of
source ``i`` in a keyed permutation of its slots; slot -> (source ``i``, its ``j``-th draw in the
block, counted in slot order) -> source position ``base_i + c_i(b) + j`` -> that source's own keyed
order. Counting draws in slot order makes the first ``s`` slots of any block draw a prefix of each
source's share, so a stage set while running (``it.set_weights``) may begin inside a block and each
source goes on from exactly where it stands. Everything is Python integers until the per-position
numpy work, so no float rounding can differ between machines.

Example:
    >>> hamilton((46, 39, 10, 20, 7, 47), 169, 2 * 6)   # 6 blocks of K = 2
    [3, 3, 1, 1, 1, 3]
    >>> hamilton((46, 39, 10, 20, 7, 47), 169, 2 * 7)   # source 4 went from 1 to 0: the Alabama paradox
    [4, 3, 1, 2, 0, 4]
"""

from __future__ import annotations

import bisect
import hashlib
import sys
from typing import NamedTuple, Sequence

import numpy as np

from portable_loader.errors import PositionOutOfRange
from portable_loader.orders.keyed import KeyedPermutation, keep, permute_many, splitmix64, subkey
from portable_loader.orders.sampler import LCGSampler

__all__ = ["MixOrder", "Stage", "hamilton", "name_key"]

_BLOCK_SALT = 0xB10C_0F_5EED
_ONLINE_SALT = 0x0E1_1E_5EED  # keeps the block keys of online stages apart from the schedule's
#: Online stages a mixture order keeps (besides one at position 0): see ``MixOrder.with_stage``.
KEPT_ONLINE = 3
_CACHED_BLOCKS = 64
_CACHED_ORDERS = 16  # block orders kept: a block of 256 serves 32 steps of 8
_FEW = 24  # up to this many positions are looked up in Python integers (numpy calls cost more)
_VECTOR_BLOCKS = 4  # a lookup meeting this many blocks builds them together (MixOrder._many_blocks)


def hamilton(nums: Sequence[int], den: int, total: int) -> list[int]:
    """Largest-remainder rounding of ``nums[i] * total / den`` (``sum(nums) == den``): sums to ``total``.

    Example:
        >>> hamilton((1, 1, 1), 3, 4)
        [2, 1, 1]
    """
    floors, rems = [], []
    for a in nums:
        q, r = divmod(a * total, den)
        floors.append(q)
        rems.append(r)
    extra = total - sum(floors)
    if extra:
        for i in sorted(range(len(nums)), key=lambda i: (-rems[i], i))[:extra]:
            floors[i] += 1
    return floors


def name_key(seed: int, name: str) -> int:
    """The seed of source ``name`` inside a mixture keyed by ``seed`` (stable across processes).

    Example:
        >>> name_key(0, "web") == name_key(0, "web") != name_key(0, "code")
        True
    """
    h = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    return splitmix64(seed ^ h)


def _runs(keys: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(key, where it occurs) for each distinct key, in O(n) for sorted keys (stream positions
    usually come in order), never one full pass per key."""
    if keys.size and (keys[1:] >= keys[:-1]).all():
        order = np.arange(keys.size)
    else:
        order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    cuts = (np.flatnonzero(ordered[1:] != ordered[:-1]) + 1).tolist()
    return [(int(ordered[a]), order[a:b]) for a, b in zip([0] + cuts, cuts + [keys.size]) if b > a]


class Stage(NamedTuple):
    """One stage of a schedule: its first position, block size, record weights ``nums/den`` and the
    per-source counts drawn before it (``base``).

    ``online`` marks a stage set while the loader ran (``it.set_weights``): its blocks are keyed by
    its start, not by its place in the list, so a state that carries only the last such stage
    rebuilds the same blocks.
    """

    start: int
    block: int
    nums: tuple[int, ...]
    den: int
    base: tuple[int, ...]
    online: bool = False

    def counts(self, blocks: int) -> list[int]:
        """Per-source counts after ``blocks`` whole blocks of this stage (the stage's own draws)."""
        return hamilton(self.nums, self.den, blocks * self.block)


class MixOrder:
    """Stream position -> index into the mixture (its sources concatenated), keyed by ``seed``.

    It is a :class:`portable_loader.dataset.protocols.StreamOrder` (its sources repeat unevenly, so
    not ``whole_epochs``). ``children`` are the sources' own orders (an ``LCGSampler`` or a nested ``MixOrder``),
    ``offsets`` where each source starts in the concatenation.

    Example:
        >>> from portable_loader.orders.sampler import LCGSampler
        >>> st = (Stage(0, 4, (1, 3), 4, (0, 0)),)
        >>> kids = [LCGSampler(2, seed=1), LCGSampler(3, seed=2)]
        >>> o = MixOrder(st, kids, np.array([0, 2, 5]), seed=0)
        >>> src, _ = o.sources_at(np.arange(8))
        >>> np.bincount(src).tolist()
        [2, 6]
    """

    whole_epochs = False

    def __init__(self, stages: Sequence[Stage], children: Sequence, offsets: np.ndarray, *, seed: int,
                 shuffle: bool = True, num_epochs: int | None = None):
        self.stages, self.children, self.offsets = tuple(stages), list(children), np.asarray(offsets, np.int64)
        self.seed, self.shuffle, self.num_epochs = seed, shuffle, num_epochs
        self.num_records = int(self.offsets[-1])
        self._offset_list = self.offsets.tolist()
        self._starts = np.array([s.start for s in self.stages], dtype=np.int64)
        self._blocks: dict[tuple[int, int], list[int]] = {}
        self._orders: dict[tuple[int, int], tuple] = {}
        self._start_list = self._starts.tolist()
        # Plain LCG samplers as every child (a mixture of caches or lists): a chunk's draws of all
        # of them go through one vectorized pass (_lcg_records) instead of a numpy pipeline per source.
        self._lcg_sizes = None
        if self.children and all(type(c) is LCGSampler and c.shard_count == 1 and c.num_epochs is None
                                  for c in self.children):
            self._lcg_sizes = np.array([c.num_records for c in self.children], dtype=np.int64)

    def __len__(self) -> int:
        return sys.maxsize if self.num_epochs is None else self.num_epochs * self.num_records

    def _counts(self, k: int, b: int) -> list[int]:
        """Counts of stage ``k``'s first ``b`` blocks, kept for the next block (which starts there)."""
        got = self._blocks.get((k, b))
        if got is None:
            got = keep(self._blocks, (k, b), self.stages[k].counts(b), _CACHED_BLOCKS)
        return got

    def _block_order(self, k: int, b: int) -> list:
        """Block ``b`` of stage ``k``: [the source of each slot, each source's first source position,
        the source position of each slot (None until asked for)], kept for the next lookups
        (consecutive steps share a block).

        The keyed permutation of the block's slots decides which source each slot draws from (the
        sources' counts lie back to back in permuted order); a source's draws then take its source
        positions in slot order, so the first ``s`` slots of a block draw a prefix of every source's
        share: a stage may begin inside a block (``it.set_weights``) and go on from exactly where
        each source stands.
        """
        got = self._orders.get((k, b))
        if got is None:
            st = self.stages[k]
            before, after = self._counts(k, b), self._counts(k, b + 1)
            first = [x + y for x, y in zip(st.base, before)]
            ends = np.cumsum([y - x for x, y in zip(before, after)])
            slots = np.arange(st.block, dtype=np.uint64)
            if self.shuffle:
                # Block b of stage k: a family per stage, whose salt is the stage's own subkey.
                family = splitmix64(st.start ^ _ONLINE_SALT) if st.online else splitmix64(k ^ _BLOCK_SALT)
                q = KeyedPermutation(st.block, subkey(self.seed, b, family), 0)(slots).astype(np.int64)
            else:
                q = slots.astype(np.int64)
            got = keep(self._orders, (k, b), [np.searchsorted(ends, q, side="right"), first, None], _CACHED_ORDERS)
        return got

    def _block_positions(self, k: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, source position) of every slot of block ``b`` of stage ``k``."""
        got = self._block_order(k, b)
        src, first, spos = got
        if spos is None:
            n = len(first)
            counts = np.bincount(src, minlength=n)
            by_source = np.argsort(src, kind="stable")  # each source's slots, in slot order, back to back
            rank = np.empty(src.size, dtype=np.int64)
            rank[by_source] = np.arange(src.size, dtype=np.int64) - (np.cumsum(counts) - counts)[src[by_source]]
            spos = got[2] = np.asarray(first, dtype=np.int64)[src] + rank
        return src, spos

    def _many_blocks(self, k: int, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``_block_positions`` of each of ``blocks`` (sorted, distinct) of stage ``k``, as rows of two
        arrays, in a few numpy passes over all of them (a chunk of 4,096 positions meets 16 blocks of
        256; one by one, their counts, permutations and ranks cost 1 ms with 60 sources).

        The same values as block by block: the counts by :func:`_hamiltons`, the slots by each
        block's own ``KeyedPermutation`` (:func:`~portable_loader.orders.keyed.permute_many`), and each source's draws ranked in slot
        order. The last blocks are kept for the lookups that follow (``_few``, ``drawn_before``).
        """
        st = self.stages[k]
        size, m, nb = st.block, len(st.nums), blocks.size
        b0 = int(blocks[0])
        if int(blocks[-1]) - b0 + 1 == nb:  # consecutive blocks (a chunk): their nb + 1 boundaries
            counts = _hamiltons(st.nums, st.den, range(b0 * size, (b0 + nb + 1) * size, size))
            before, after = counts[:-1], counts[1:]
        else:
            bounds = np.union1d(blocks, blocks + 1)
            counts = _hamiltons(st.nums, st.den, [b * size for b in bounds.tolist()])  # Python ints: no wrap
            before, after = counts[np.searchsorted(bounds, blocks)], counts[np.searchsorted(bounds, blocks + 1)]
        first = before + np.asarray(st.base, dtype=np.int64)
        slots = np.broadcast_to(np.arange(size, dtype=np.int64), (nb, size))
        if self.shuffle:
            family = splitmix64(st.start ^ _ONLINE_SALT) if st.online else splitmix64(k ^ _BLOCK_SALT)
            perms = [KeyedPermutation(size, subkey(self.seed, b, family), 0) for b in blocks.tolist()]
            q = permute_many(perms, None, slots).reshape(-1)
        else:
            q = slots.reshape(-1)
        # The source of value v of block j (the sources' shares lie back to back in value order) is
        # entry j * size + v of this table: one gather, where searchsorted per block costs more.
        rows = np.arange(nb, dtype=np.int64)
        owner = np.repeat(np.tile(np.arange(m, dtype=np.int64), nb) + np.repeat(rows * m, m), (after - before).reshape(-1))
        key = owner[q + np.repeat(rows * size, size)]  # j * m + the slot's source
        src = key - np.repeat(rows * m, size)
        # Each (block, source)'s slots in slot order, back to back: a stable sort, by radix on 16 bits when it fits.
        order = np.argsort(key.astype(np.uint16) if nb * m <= 1 << 16 else key, kind="stable")
        have = np.bincount(key, minlength=nb * m)
        rank = np.empty_like(key)
        rank[order] = np.arange(key.size, dtype=np.int64) - (np.cumsum(have) - have)[key[order]]
        spos = first.reshape(-1)[key] + rank
        src, spos = src.reshape(nb, size), spos.reshape(nb, size)
        for j in range(max(0, nb - _CACHED_ORDERS), nb):
            keep(self._orders, (k, int(blocks[j])), [src[j], first[j].tolist(), spos[j]], _CACHED_ORDERS)
        return src, spos

    def drawn_before(self, position: int) -> list[int]:
        """Per-source draws at stream positions ``[0, position)``: where each source stands.

        Example:
            >>> from portable_loader.orders.sampler import LCGSampler
            >>> o = MixOrder((Stage(0, 4, (1, 3), 4, (0, 0)),), [LCGSampler(2, seed=1), LCGSampler(3, seed=2)],
            ...              np.array([0, 2, 5]), seed=0)
            >>> src, _ = o.sources_at(np.arange(6))
            >>> o.drawn_before(6) == np.bincount(src, minlength=2).tolist()
            True
        """
        k = bisect.bisect_right(self._start_list, position) - 1
        st = self.stages[k]
        b, s = divmod(position - st.start, st.block)
        src, first, _ = self._block_order(k, b)
        return [x + c for x, c in zip(first, np.bincount(src[:s], minlength=len(first)).tolist())]

    def with_stage(self, stage: Stage) -> "MixOrder":
        """This order followed by ``stage`` from ``stage.start`` on (stages starting there or later are
        dropped), keeping of the online stages the first (if it starts at 0) and the last ``KEPT_ONLINE``.

        The last ones serve the position a change is made at and the few batches before it that a
        trainer may still save a state for (a Lightning loop holds one batch ahead of its step), so
        the state stays O(sources) after any number of changes.

        Example:
            >>> from portable_loader.orders.sampler import LCGSampler
            >>> o = MixOrder((Stage(0, 4, (1, 3), 4, (0, 0)),), [LCGSampler(2, seed=1), LCGSampler(3, seed=2)],
            ...              np.array([0, 2, 5]), seed=0)
            >>> o2 = o.with_stage(Stage(6, 4, (1, 0), 1, tuple(o.drawn_before(6)), online=True))
            >>> o2.sources_at(np.arange(6, 10))[0].tolist(), o2.stages[0] == o.stages[0]
            ([0, 0, 0, 0], True)
        """
        stages = [st for st in self.stages if st.start < stage.start] + [stage]
        online = [j for j, st in enumerate(stages) if st.online]
        # The first stage stays too: the order covers every position from 0 (a planner looks up whole chunks).
        dropped = set(online[:-KEPT_ONLINE]) - {0}
        return self.with_stages([st for j, st in enumerate(stages) if j not in dropped])

    def with_stages(self, stages: Sequence[Stage]) -> "MixOrder":
        """The same sources and seed over ``stages``."""
        return MixOrder(stages, self.children, self.offsets, seed=self.seed, shuffle=self.shuffle,
                        num_epochs=self.num_epochs)

    @property
    def online(self) -> list[Stage]:
        """The stages set while running (``it.set_weights``) that this order still holds."""
        return [st for st in self.stages if st.online]

    def _few(self, positions: list[int]) -> tuple[list[int], list[int]]:
        """``sources_at`` for a few positions, in Python integers (a step of ``describe``, a resume)."""
        src, spos = [], []
        starts = self._start_list
        for p in positions:
            k = 0 if len(starts) == 1 else bisect.bisect_right(starts, p) - 1
            st = self.stages[k]
            b, slot = divmod(p - st.start, st.block)
            block_src, first, _ = self._block_order(k, b)
            i = int(block_src[slot])
            src.append(i)
            spos.append(first[i] + int(np.count_nonzero(block_src[:slot] == i)))  # its draws before, in slot order
        return src, spos

    def sources_at(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source index, position in that source's own stream) for each mixture stream position."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        src, spos = np.empty_like(pos), np.empty_like(pos)
        stage_of = np.searchsorted(self._starts, pos, side="right") - 1
        for k, in_stage in _runs(stage_of):
            st = self.stages[k]
            blk, slot = np.divmod(pos[in_stage] - st.start, st.block)
            if blk.size > 1 and (blk[1:] >= blk[:-1]).all():  # in order (a chunk): the blocks met, without a sort
                met = blk[np.flatnonzero(np.concatenate(([True], blk[1:] != blk[:-1])))]
            else:
                met = np.unique(blk)
            if _VECTOR_BLOCKS <= met.size and met.size * st.block <= max(4 * in_stage.size, 1 << 16):
                # a planner's chunk: its blocks built together (bounded: scattered positions go block by block)
                block_src, block_spos = self._many_blocks(k, met)
                row = np.searchsorted(met, blk)
                src[in_stage] = block_src[row, slot]
                spos[in_stage] = block_spos[row, slot]
                continue
            for b, here in _runs(blk):
                block_src, block_spos = self._block_positions(k, b)
                sel = in_stage[here]
                src[sel] = block_src[slot[here]]
                spos[sel] = block_spos[slot[here]]
        return src, spos

    def few(self, positions: list[int]) -> list[int]:
        """``stream_indices`` of a few positions already checked to be in range, as Python integers."""
        src, spos = self._few(positions)
        found: dict[int, list[int]] = {}
        for j, i in enumerate(src):
            found.setdefault(i, []).append(j)
        out = [0] * len(src)
        for i, where in found.items():
            got = self.children[i].few([spos[j] for j in where])
            for j, r in zip(where, got):
                out[j] = r + self._offset_list[i]
        return out

    def stream_indices(self, positions) -> np.ndarray:
        """Mixture index (``offsets[source] + record``) at each stream position."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size <= _FEW:  # a step of describe, a resume: Python integers throughout
            flat = pos.reshape(-1).tolist()
            bad = [p for p in flat if not 0 <= p < len(self)]
            if bad:
                raise PositionOutOfRange(f"index must be in [0, {len(self)}) for this mixture's stream, got {bad[0]}")
            return np.array(self.few(flat), dtype=np.int64).reshape(pos.shape)
        if pos.min() < 0 or pos.max() >= len(self):
            bad = pos[(pos < 0) | (pos >= len(self))][0]
            raise PositionOutOfRange(f"index must be in [0, {len(self)}) for this mixture's stream, got {int(bad)}")
        src, spos = self.sources_at(pos)
        if self._lcg_sizes is not None:
            return (_lcg_records(self.children, self._lcg_sizes, src, spos) + self.offsets[src]).reshape(pos.shape)
        out = np.empty_like(pos)
        for i, sel in _runs(src):  # one sort, not a pass over every position per source
            out[sel] = self.children[i].stream_indices(spos[sel]) + self.offsets[i]
        return out


def _lcg_records(children: Sequence[LCGSampler], sizes: np.ndarray, src: np.ndarray, spos: np.ndarray) -> np.ndarray:
    """``children[src[j]].stream_indices([spos[j]])`` for every ``j`` at once, for plain LCG samplers.

    Each (source, epoch) met is one ``KeyedPermutation``; its keys are gathered per position and the
    mixer and cycle walk of ``KeyedPermutation.__call__`` run once over all positions, with the
    same 64-bit numpy arithmetic, so every value is the one the source's own sampler gives. A
    mixture's chunk then costs a few dozen numpy passes, not a dozen per source (60 sources: 4 ms).

    Example:
        >>> kids = [LCGSampler(5, seed=1), LCGSampler(3, seed=2, shuffle=False), LCGSampler(40, seed=3)]
        >>> src = np.array([0, 2, 1, 0, 2, 2] * 9)
        >>> spos = np.arange(src.size, dtype=np.int64)
        >>> got = _lcg_records(kids, np.array([5, 3, 40]), src, spos)
        >>> got.tolist() == [int(kids[i].stream_indices([p])[0]) for i, p in zip(src.tolist(), spos.tolist())]
        True
    """
    n = sizes[src]
    epoch, within = np.divmod(spos, n)
    out = within.copy()  # an unshuffled source serves its positions in order
    k = len(children)
    # (source, epoch) pairs met, numbered densely: each source's epochs counted from its first here
    # (a chunk meets one or two per source; np.unique's sort cost more than the rest together).
    low = np.full(k, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(low, src, epoch)
    rel = epoch - low[src]
    cells = (int(rel.max(initial=0)) + 1) * k
    if cells <= max(4 * src.size, 1024):
        group = rel * k + src
        groups = np.flatnonzero(np.bincount(group, minlength=cells))
        dense = np.empty(cells, dtype=np.int64)
        dense[groups] = np.arange(groups.size)
        group = dense[group]
        met = [(int(low[g % k]) + g // k, g % k) for g in groups.tolist()]
    elif int(epoch.max(initial=0)) < (1 << 62) // k:  # scattered positions: the pairs by a sort
        groups, group = np.unique(epoch * k + src, return_inverse=True)
        met = [divmod(g, k) for g in groups.tolist()]
    else:  # epochs so large that epoch * k would overflow
        for i, sel in _runs(src):
            out[sel] = children[i].stream_indices(spos[sel])
        return out
    perms, slot = [], np.full(len(met), -1, dtype=np.int64)
    for g, (e, i) in enumerate(met):
        if children[i].shuffle:
            slot[g] = len(perms)
            perms.append(children[i]._permutation(e))
    if not perms:
        return out
    which = slot[group]
    sel = np.flatnonzero(which >= 0)
    out[sel] = permute_many(perms, which[sel], within[sel])
    return out


def _hamiltons(nums: Sequence[int], den: int, totals: Sequence[int]) -> np.ndarray:
    """``hamilton(nums, den, t)`` for each ``t`` in ``totals``, as the rows of an int64 array: in numpy
    when the products fit in 62 bits (ties again to the lower index: a stable sort), else in Python.

    Example:
        >>> _hamiltons((46, 39, 10, 20, 7, 47), 169, [12, 14]).tolist()
        [[3, 3, 1, 1, 1, 3], [4, 3, 1, 2, 0, 4]]
    """
    k = len(nums)
    if not len(totals) or max(nums) * max(totals) >= 1 << 62:
        return np.array([hamilton(nums, den, t) for t in totals], dtype=np.int64).reshape(len(totals), k)
    prod = np.asarray(totals, dtype=np.int64)[:, None] * np.asarray(nums, dtype=np.int64)[None, :]
    floors, rems = np.divmod(prod, den)
    extra = np.asarray(totals, dtype=np.int64) - floors.sum(axis=1)
    order = np.argsort(-rems, axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.broadcast_to(np.arange(k), order.shape), axis=1)
    return floors + (rank < extra[:, None])
