"""LCG index sampler: a keyed permutation of ``range(N)`` per epoch in O(1) memory.

The order of epoch ``e`` is a bijection ``position -> record index`` that is computed, never stored:

1. Let ``M = 2**k`` be the smallest power of two ``>= N``.
2. A keyed bijection ``f`` of ``[0, M)`` whitens ``x`` (xor a key, multiply by an odd key) and runs a few rounds of a
   full-period linear congruential step ``x = (a*x + c) mod M`` (``a % 4 == 1``, ``c`` odd) followed by
   an xorshift ``x ^= x >> s``. A bare power-of-two LCG has weak low bits (bit 0 alternates, bit j has
   period ``2**(j+1)``); the xorshift folds high bits into low ones, so the mixed order passes the
   rank-correlation, parity and gap checks in ``tests/test_sampler.py``.
3. Cycle walking: ``y = f(x)`` is repeated while ``y >= N``. Because ``f`` permutes ``[0, M)``, the walk
   from ``x < N`` stays on ``x``'s cycle and stops at the next member ``< N``, which makes the result a
   bijection of ``[0, N)`` for every ``N >= 1``; with ``M < 2N`` it takes under two steps on average.

The constants ``a``, ``c``, the whitening key and the shifts are derived from ``(seed, epoch)`` with
splitmix64 on Python integers and applied with wrapping ``uint64`` numpy arithmetic, so the same
``(seed, epoch)`` gives the same order on every machine. This is the idea of IBM's fms-fsdp loader
(an LCG over the next power of two instead of materialized document lists), extended with mixing and
random access.
"""

from __future__ import annotations

import numbers
import sys
from typing import Iterable

import numpy as np

__all__ = ["LCGSampler", "PositionOutOfRange"]

_MASK64 = (1 << 64) - 1
_ROUNDS = 4
# Work in blocks that stay in L2 cache: each round is a handful of in-place passes over the block.
_BLOCK = 1 << 15
_FEW = 24  # up to this many positions are mapped in Python integers (see _EpochPermutation)
_KEPT_EPOCHS = 4  # permutations a sampler keeps: a step may straddle epochs, describe may go back and forth


class PositionOutOfRange(IndexError, ValueError):
    """A position past the end of a finite stream.

    It is a ``ValueError`` for callers and an ``IndexError`` for Grain, whose ``DataLoader`` reads a
    sampler until ``IndexError`` when it has no length.
    """


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _evict_oldest(cache: dict) -> None:
    """Drop a small cache's oldest entry; a loader's prefetch thread and ``describe`` may share it."""
    try:
        cache.pop(next(iter(cache)), None)
    except (StopIteration, RuntimeError):  # emptied or resized by the other thread meanwhile
        pass


def _check_int(name: str, value, minimum: int = 0, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be {bounds}, got {value}")
    return value


class _EpochPermutation:
    """The bijection of ``[0, n)`` for one (seed, epoch); a few integers, no arrays.

    A few positions (what ``describe`` or a resume asks for) are mapped with Python integers: a
    dozen numpy calls on a 3-element array cost ten times the arithmetic. The two paths give the
    same values (``tests/test_sampler.py`` checks it).
    """

    __slots__ = ("n", "bits", "keys", "_draws", "_np")

    def __init__(self, n: int, seed: int, epoch: int):
        self.n = n
        self.bits = bits = max(0, (n - 1).bit_length())
        x = _splitmix64(seed ^ _splitmix64(epoch ^ 0x5EED_0F_E90C))
        draws = []
        m64 = _MASK64
        for _ in range(2 + 2 * _ROUNDS):  # _splitmix64 chained, inlined: this runs once per epoch and per describe
            x = (x + 0x9E3779B97F4A7C15) & m64
            x ^= x >> 30
            x = (x * 0xBF58476D1CE4E5B9) & m64
            x ^= x >> 27
            x = (x * 0x94D049BB133111EB) & m64
            x ^= x >> 31
            draws.append(x)
        mask = (1 << bits) - 1
        # (mask, whitening key, pre-multiplier, [(a, c) per round], shift). Any odd pre-multiplier:
        # with only a % 4 == 1 below, 2-bit domains (N <= 4) reach few orders. a % 4 == 1 and c odd:
        # the conditions (Hull-Dobell) for a full-period LCG modulo 2**k. Python integers take them
        # mod 2**bits (only the result mod 2**bits matters, and small factors keep the products in
        # a machine word or two); numpy takes the 64-bit values (built when first needed).
        self.keys = (mask, draws[0] & mask, (draws[1] | 1) & mask,
                     [(((draws[i] & ~3) | 1) & mask, (draws[i + 1] | 1) & mask) for i in range(2, 2 + 2 * _ROUNDS, 2)],
                     max(1, (bits + 1) // 2))
        self._draws = draws
        self._np = None

    def _numpy_keys(self) -> tuple:
        if self._np is None:
            mask, white, _, _, shift = self.keys
            d = self._draws
            rounds = [(np.uint64((d[i] & ~3) | 1), np.uint64(d[i + 1] | 1)) for i in range(2, 2 + 2 * _ROUNDS, 2)]
            self._np = (np.uint64(mask), np.uint64(white), np.uint64(d[1] | 1), rounds, np.uint64(shift))
        return self._np

    def one(self, x: int) -> int:
        """The image of one position ``x`` in ``[0, n)``, in Python integers."""
        mask, white, premult, rounds, shift = self.keys
        n = self.n
        while True:
            # Reducing mod 2**bits only at the end of each round is the same as numpy's wrapping
            # mod 2**64 at every operation: 2**bits divides 2**64.
            x = (x ^ white) * premult
            for a, c in rounds:
                x = (x * a + c) & mask
                x ^= x >> shift
            if x < n:
                return x

    def _mix(self, x: np.ndarray, tmp: np.ndarray) -> None:
        """Apply the keyed bijection of [0, 2**bits) to ``x`` in place."""
        mask, white, premult, rounds, shift = self._numpy_keys()
        np.bitwise_xor(x, white, out=x)
        np.multiply(x, premult, out=x)
        for a, c in rounds:
            np.multiply(x, a, out=x)
            np.add(x, c, out=x)
            np.bitwise_and(x, mask, out=x)
            np.right_shift(x, shift, out=tmp)
            np.bitwise_xor(x, tmp, out=x)

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        if positions.size <= _FEW:
            out = [self.one(x) for x in positions.reshape(-1).tolist()]
            return np.array(out, dtype=np.int64).reshape(positions.shape)
        out = np.empty(positions.shape, dtype=np.uint64)
        flat_in = positions.reshape(-1)
        flat_out = out.reshape(-1)
        tmp = np.empty(min(_BLOCK, flat_in.size), dtype=np.uint64)
        n = np.uint64(self.n)
        for lo in range(0, flat_in.size, _BLOCK):
            x = flat_out[lo : lo + _BLOCK]
            x[...] = flat_in[lo : lo + _BLOCK]
            t = tmp[: x.size]
            self._mix(x, t)
            over = np.flatnonzero(x >= n)
            if over.size:
                x[over] = self._walk(x[over], n)
        return out.view(np.int64)

    def _walk(self, x: np.ndarray, n: np.uint64) -> np.ndarray:
        tmp = np.empty_like(x)
        todo = np.arange(x.size)
        cur = x
        while todo.size:
            self._mix(cur, tmp[: cur.size])
            x[todo] = cur
            keep = cur >= n
            todo = todo[keep]
            cur = cur[keep]
        return x


class LCGSampler:
    """Shuffled, sharded, repeatable record order without materializing a permutation.

    Each epoch is a fresh pseudo-random permutation of ``range(num_records)``; shard ``k`` of ``K``
    takes global positions ``k, k + K, k + 2K, ...`` of every epoch, so the shards of one epoch are
    disjoint and together cover each record exactly once. Memory is O(1) in ``num_records``.

    It implements Grain's ``Sampler`` protocol (``__getitem__`` returning ``grain.RecordMetadata``).

    Example:
        >>> s = LCGSampler(num_records=10, seed=0)
        >>> sorted(s.record_indices(range(10), epoch=0).tolist()) == list(range(10))
        True
        >>> s[3].record_key == int(s.record_indices([3], epoch=0)[0])
        True
        >>> int(LCGSampler(10**12, seed=1).record_indices([10**12 - 1])[0]) < 10**12
        True
    """

    whole_epochs = True  # each epoch is one permutation of every record (dataset.protocols.StreamOrder)

    def __init__(
        self,
        num_records: int,
        seed: int | None = None,
        *,
        shuffle: bool = True,
        num_epochs: int | None = None,
        shard_index: int = 0,
        shard_count: int = 1,
    ):
        self.num_records = _check_int("num_records", num_records, minimum=1, maximum=1 << 63)
        if seed is None:
            raise ValueError("seed is required (an integer in [0, 2**64)), got None")
        self.seed = _check_int("seed", seed, minimum=0, maximum=_MASK64)
        self.shuffle = bool(shuffle)
        self.num_epochs = None if num_epochs is None else _check_int("num_epochs", num_epochs, 1)
        self.shard_count = _check_int("shard_count", shard_count, minimum=1)
        self.shard_index = _check_int("shard_index", shard_index, 0, self.shard_count - 1)
        # Positions of this shard in each epoch: k, k+K, ... below N.
        self.shard_epoch_length = -(-(self.num_records - self.shard_index) // self.shard_count)
        self._perms: dict[int, _EpochPermutation] = {}

    def _permutation(self, epoch: int) -> _EpochPermutation:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = _EpochPermutation(self.num_records, self.seed, epoch)
            if len(self._perms) >= _KEPT_EPOCHS:
                _evict_oldest(self._perms)
            self._perms[epoch] = perm
        return perm

    def record_indices(self, positions: Iterable[int] | np.ndarray, epoch: int = 0) -> np.ndarray:
        """Record index at each global position of ``epoch`` (vectorized; int64 out).

        Positions are in the whole epoch's order, before sharding: ``[0, num_records)``.
        """
        epoch = _check_int("epoch", epoch)
        if self.num_epochs is not None and epoch >= self.num_epochs:
            raise ValueError(f"epoch must be < num_epochs={self.num_epochs}, got {epoch}")
        pos = _as_int64("positions", positions)
        if pos.size and (pos.min() < 0 or pos.max() >= self.num_records):
            bad = pos[(pos < 0) | (pos >= self.num_records)][0]
            raise ValueError(f"positions must be in [0, {self.num_records}), got {int(bad)}")
        if not self.shuffle:
            return pos.copy()
        return self._permutation(epoch)(pos.view(np.uint64))

    def stream_indices(self, indices: Iterable[int] | np.ndarray) -> np.ndarray:
        """Record index at each position of this shard's stream (epochs concatenated; int64 out)."""
        idx = _as_int64("index", indices)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            bad = idx[(idx < 0) | (idx >= len(self))][0]
            raise PositionOutOfRange(
                f"index must be in [0, {len(self)}) for this sampler's stream, got {int(bad)}"
            )
        if idx.size <= _FEW:  # a few positions: Python integers, no numpy calls per epoch
            return np.array(self.few(idx.reshape(-1).tolist()), dtype=np.int64).reshape(idx.shape)
        epochs, within = np.divmod(idx, self.shard_epoch_length)
        global_pos = within * self.shard_count + self.shard_index
        out = np.empty_like(idx)
        for epoch in np.unique(epochs).tolist():
            sel = epochs == epoch
            out[sel] = self.record_indices(global_pos[sel], epoch=epoch)
        return out

    def few(self, positions: list[int]) -> list[int]:
        """``stream_indices`` of a few positions already checked to be in range, as Python integers."""
        per, k, count = self.shard_epoch_length, self.shard_index, self.shard_count
        out, perm, last = [], None, -1
        for i in positions:
            epoch, within = divmod(i, per)
            g = within * count + k
            if not self.shuffle:
                out.append(g)
                continue
            if epoch != last:  # a few positions seldom straddle epochs
                perm, last = self._permutation(epoch), epoch
            out.append(perm.one(g))
        return out

    def __len__(self) -> int:
        if self.num_epochs is None:
            return sys.maxsize
        return self.num_epochs * self.shard_epoch_length

    @property
    def _shard_options(self):
        # grain.DataLoader reads this to decide how to shard; this sampler's stream is already one
        # shard's, so Grain must not shard it again.
        from grain.python import NoSharding

        return NoSharding()

    def __getitem__(self, index: int):
        from grain.python import RecordMetadata

        index = _check_int("index", index, minimum=-sys.maxsize)
        record_key = int(self.stream_indices([index])[0])
        return RecordMetadata(index=index, record_key=record_key)

    def __repr__(self) -> str:
        return (
            f"LCGSampler(num_records={self.num_records}, seed={self.seed}, shuffle={self.shuffle}, "
            f"num_epochs={self.num_epochs}, shard_index={self.shard_index}, "
            f"shard_count={self.shard_count})"
        )


def _as_int64(name: str, values) -> np.ndarray:
    arr = np.asarray(values)
    if arr.dtype == object or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{name} must be integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{name} must be in int64 range, got {int(arr.max())}")
    return arr.astype(np.int64, copy=False)
