"""Grain's ``index_shuffle`` order, in Python integers and numpy: the permutation behind Grain's shuffles.

Grain 0.2.18 shuffles a ``MapDataset`` (and ``IndexSampler(shuffle=True)``, which shuffles a
``range``) with a C++ function, ``index_shuffle(index, max_index, seed, rounds)``: a cycle-walking
Simon-style Feistel cipher over the smallest even number of bits ``B >= 16`` that holds ``max_index``
(Grain computes it as ``ceil(log2(max_index))`` in floating point, rounded up to even). The block
``x`` is split into two ``B/2``-bit words ``(left, right)``; each pair of rounds is
``left ^= F(right) ^ k[i]; right ^= F(left) ^ k[i + 1]`` with ``F(x) = (rotl(x, 1) & rotl(x, 8)) ^
rotl(x, 2)`` on ``B/2``-bit words, and the round keys ``k`` are the ``rounds`` 32-bit words that C++'s
``std::seed_seq{seed}.generate`` gives (cut to ``B/2`` bits). Cycle walking re-encrypts while the
result exceeds ``max_index``, so ``[0, max_index]`` maps onto itself. This module computes the same
function (written from that description, not from Grain's code) so that a shuffle here reads Grain's
records in Grain's order.

One deliberate difference: where ``ceil(log2(max_index))`` rounds down (``max_index`` a power of two,
``2**B`` with ``B`` even and ``>= 16``, and sizes above ``2**48`` where the float rounds),
Grain's block is one bit short and its shuffle reads some records twice and others never (for
``n = 2**16 + 1`` records, index ``2**16`` reads what index ``0`` reads). Here the indices that do not
fit the block map to themselves, so every size stays a bijection; every other index reads what Grain's
does.

Small blocks: below ``2**14`` records the 16-bit block is mostly outside ``[0, max_index]``, and cycle
walking takes ``2**16 / n`` encryptions per index on average. :class:`IndexShuffle` then computes the
whole permutation once, by pointer doubling over the block (a few milliseconds), and looks indices up.

Example:
    >>> perm = IndexShuffle(max_index=9, seed=5)
    >>> order = [perm.one(i) for i in range(10)]
    >>> sorted(order) == list(range(10)), perm(np.arange(10)).tolist() == order
    (True, True)
"""

from __future__ import annotations

import array
import functools
import math

import numpy as np

from portable_loader.orders.keyed import keep

__all__ = ["ORDER", "EpochShuffle", "IndexShuffle", "block_bits", "round_function", "round_keys"]

#: Names this order in the fingerprints of shuffled pipelines, so that a state saved when shuffles
#: had another order (portable_loader's LCG order, before this module) is refused, not misread.
ORDER = "grain-0.2.18-index-shuffle"

_MIN_BLOCK = 16  # Grain's smallest block, in bits
_MASK32 = (1 << 32) - 1
_INT64_MAX = (1 << 63) - 1
#: Up to this many indices are mapped in Python integers: numpy's per-call cost dominates below it.
FEW = 16
#: Below this many records the whole permutation is computed once and looked up (see the module docstring).
TABLE_BELOW = 1 << 14
#: Words up to this many bits (blocks up to 32 bits: 4 billion records) look the round function up in
#: a table of its 2**w values: one gather where the shifts take eight numpy calls.
_TABLED_WORD = 16


@functools.lru_cache(maxsize=256)
def round_keys(seed: int, rounds: int) -> tuple[int, ...]:
    """The ``rounds`` 32-bit words ``std::seed_seq{seed}.generate`` writes (C++ [rand.util.seedseq]).

    Grain keys its cipher with them; the algorithm is the C++ standard's, so every compiler gives
    the same words.

    Example:
        >>> len(round_keys(0, 4)), round_keys(0, 4) == round_keys(0, 4) != round_keys(1, 4)
        (4, True)
    """
    n, v = rounds, (seed & _MASK32,)
    s = len(v)
    out = [0x8B8B8B8B] * n
    t = 11 if n >= 623 else 7 if n >= 68 else 5 if n >= 39 else 3 if n >= 7 else (n - 1) // 2
    p = (n - t) // 2
    q = p + t
    m = max(s + 1, n)

    def mix(x: int) -> int:
        return x ^ (x >> 27)

    for k in range(m):
        r1 = (1664525 * mix(out[k % n] ^ out[(k + p) % n] ^ out[(k - 1) % n])) & _MASK32
        r2 = (r1 + (s if k == 0 else (k % n + v[k - 1]) if k <= s else k % n)) & _MASK32
        out[(k + p) % n] = (out[(k + p) % n] + r1) & _MASK32
        out[(k + q) % n] = (out[(k + q) % n] + r2) & _MASK32
        out[k % n] = r2
    for k in range(m, m + n):
        r3 = (1566083941 * mix((out[k % n] + out[(k + p) % n] + out[(k - 1) % n]) & _MASK32)) & _MASK32
        r4 = (r3 - k % n) & _MASK32
        out[(k + p) % n] ^= r3
        out[(k + q) % n] ^= r4
        out[k % n] = r4
    return tuple(out)


@functools.lru_cache(maxsize=None)
def round_function(w: int) -> tuple[np.ndarray, array.array]:
    """Simon's ``F(x) = (rotl(x, 1) & rotl(x, 8)) ^ rotl(x, 2)`` on ``w``-bit words, for every word:
    as a numpy array (gathers) and as an ``array.array`` (a Python integer per lookup).

    Example:
        >>> f, f_list = round_function(8)
        >>> int(f[1]), f_list[1]       # rotl(1, 1) & rotl(1, 8) is 2 & 1 = 0; rotl(1, 2) is 4
        (4, 4)
    """
    v = np.arange(1 << w, dtype=np.uint64)
    d = v | (v << np.uint64(w))  # v beside itself: each rotation is then one shift and the mask
    f = ((d >> np.uint64(w - 1)) & (d >> np.uint64(w - 8)) ^ (d >> np.uint64(w - 2))) & np.uint64((1 << w) - 1)
    f = f.astype(np.uint16 if w <= 8 else np.uint32)
    return f, array.array("H" if w <= 8 else "I", f.tobytes())


def block_bits(max_index: int) -> int:
    """Grain's block size in bits for ``[0, max_index]``: ``ceil(log2(max_index))`` of the float,
    rounded up to even, at least 16 and at most 64.

    It is computed as Grain computes it (a double's ``log2``) because the rounding decides the order;
    for a power of two it is one bit short (the module docstring says what happens then).

    Example:
        >>> block_bits(1), block_bits(70_000), block_bits(2**20), block_bits(2**20 + 1)
        (16, 18, 20, 22)
    """
    bits = math.ceil(math.log2(float(max_index))) if max_index > 1 else 0
    return min(max(bits + bits % 2, _MIN_BLOCK), 64)


class IndexShuffle:
    """Grain's ``index_shuffle(., max_index, seed, rounds)`` as a permutation of ``[0, max_index]``.

    ``one(i)`` maps one index in Python integers; calling it maps an int64 array with numpy.
    Indices are assumed in range (callers check them).

    Example:
        >>> perm = IndexShuffle(max_index=99_999, seed=3)
        >>> idx = np.arange(0, 100_000, 7)
        >>> perm(idx).tolist() == [perm.one(i) for i in idx.tolist()]
        True
    """

    def __init__(self, max_index: int, seed: int, rounds: int = 4):
        self.max_index = int(max_index)
        bits = block_bits(self.max_index)
        self._half = bits // 2
        self._wmask = (1 << self._half) - 1
        # Indices that do not fit Grain's block (a log2 rounded down) stay in place: see the module docstring.
        self._fits = (1 << bits) - 1
        self._keys = tuple(k & self._wmask for k in round_keys(seed, rounds))
        self._table = None
        if 0 < self.max_index < TABLE_BELOW:
            self._table = self._whole_permutation()

    def _encrypt_one(self, x: int) -> int:
        w, m, keys = self._half, self._wmask, self._keys
        left, right = x >> w, x & m
        if w <= _TABLED_WORD:
            f = round_function(w)[1]
            for i in range(0, len(keys), 2):
                left ^= f[right] ^ keys[i]
                right ^= f[left] ^ keys[i + 1]
            return (left << w) | right
        s1, s2, s8 = w - 1, w - 2, w - 8
        for i in range(0, len(keys), 2):
            d = right | (right << w)  # right beside itself: each rotation is one shift (see round_function)
            left ^= ((d >> s1) & (d >> s8) ^ (d >> s2)) & m ^ keys[i]
            d = left | (left << w)
            right ^= ((d >> s1) & (d >> s8) ^ (d >> s2)) & m ^ keys[i + 1]
        return (left << w) | right

    def one(self, index: int) -> int:
        """The image of one index in ``[0, max_index]``.

        Example:
            >>> IndexShuffle(max_index=0, seed=9).one(0)
            0
        """
        if self._table is not None:
            return int(self._table[index])
        if self.max_index == 0 or index > self._fits:
            return index
        x = self._encrypt_one(index)
        while x > self.max_index:  # cycle walking: the next member of index's cycle inside the range
            x = self._encrypt_one(x)
        return x

    def _encrypt_words(self, left: np.ndarray, right: np.ndarray) -> None:
        # In place, on words of round_function's type (w <= _TABLED_WORD).
        f = round_function(self._half)[0]
        t = f.dtype.type
        for i in range(0, len(self._keys), 2):  # np.take: twice as fast as f[right] on large arrays
            left ^= np.take(f, right)
            left ^= t(self._keys[i])
            right ^= np.take(f, left)
            right ^= t(self._keys[i + 1])

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        w = self._half
        if w <= _TABLED_WORD:
            t = round_function(w)[0].dtype
            left, right = (x >> np.uint64(w)).astype(t), (x & np.uint64(self._wmask)).astype(t)
            self._encrypt_words(left, right)
            return (left.astype(np.uint64) << np.uint64(w)) | right
        t, m, s1, s2, s8, sw = np.uint64, *(np.uint64(v) for v in (self._wmask, w - 1, w - 2, w - 8, w))
        left, right = x >> sw, x & m

        def f(v):
            d = v | (v << sw)  # as in round_function
            return ((d >> s1) & (d >> s8) ^ (d >> s2)) & m

        for i in range(0, len(self._keys), 2):
            left ^= f(right) ^ t(self._keys[i])
            right ^= f(left) ^ t(self._keys[i + 1])
        return (left.astype(np.uint64) << np.uint64(w)) | right

    def _whole_permutation(self) -> np.ndarray:
        # Pointer doubling: jump[y] is y inside the range and the cipher's image outside it, so
        # applying jump, jump**2, jump**4, ... to an image walks every cycle at once, in log2 steps
        # of the longest walk instead of one step each.
        n, w = self.max_index + 1, self._half
        words = np.arange(1 << w, dtype=round_function(w)[0].dtype)
        left, right = np.repeat(words, 1 << w), np.tile(words, 1 << w)  # every block value, as its two words
        self._encrypt_words(left, right)
        jump = (left.astype(np.int64) << w) | right
        out = jump[:n].copy()
        jump[:n] = np.arange(n)
        while (out >= n).any():
            out = np.take(jump, out)
            jump = np.take(jump, jump)
        return out

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        """The images of an int64 array of indices in ``[0, max_index]`` (int64, same shape)."""
        if self._table is not None:
            return self._table[indices]
        if indices.size <= FEW or self.max_index == 0:
            return np.array([self.one(i) for i in indices.reshape(-1).tolist()],
                            dtype=np.int64).reshape(indices.shape)
        x = indices.astype(np.uint64)
        out = np.where(x > np.uint64(self._fits), x, self._encrypt(x & np.uint64(self._fits)))
        limit = np.uint64(self.max_index)
        walk = np.flatnonzero(out > limit)
        # Cycle walking: a quarter or more of the block is in range, so the walkers thin out fast;
        # the last few finish in Python integers, cheaper than numpy calls on a handful of values.
        while walk.size > FEW:
            y = self._encrypt(out[walk])
            out[walk] = y
            walk = walk[y > limit]
        for i in walk.tolist():
            x = self._encrypt_one(int(out[i]))
            while x > self.max_index:
                x = self._encrypt_one(x)
            out[i] = x
        return out.astype(np.int64)


class EpochShuffle:
    """Grain's ``ShuffleMapDataset`` index arithmetic over ``n`` records: index ``i`` is position
    ``i % n`` of epoch ``e = i // n``, which reads ``e * n + index_shuffle(i % n, n - 1, (seed + e) % 2**32, 4)``.

    Each epoch's permutation is built on first use and the last few are kept (a read may straddle
    an epoch boundary, and a loader's threads may read neighbouring epochs).

    Example:
        >>> order = EpochShuffle(4, seed=1)(np.arange(8))
        >>> sorted(order[:4]) == [0, 1, 2, 3], sorted(order[4:]) == [4, 5, 6, 7]
        (True, True)
    """

    _KEPT = 4  # epochs' permutations kept

    def __init__(self, n: int, seed: int):
        self.n, self.seed = int(n), int(seed)
        self._perms: dict[int, IndexShuffle] = {}

    def epoch(self, e: int) -> IndexShuffle:
        """Epoch ``e``'s permutation of ``[0, n)``.

        Example:
            >>> EpochShuffle(3, seed=2**32 - 1).epoch(1).one(0) == IndexShuffle(2, seed=0).one(0)
            True
        """
        perm = self._perms.get(e)
        if perm is None:
            perm = keep(self._perms, e, IndexShuffle(self.n - 1, (self.seed + e) & _MASK32), self._KEPT)
        return perm

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        """Grain's shuffled index of each non-negative index (same shape).

        Indices are int64, or Python integers (dtype object) where an epoch of an endless parent
        starts past ``2**63 - 1``; the result is Python integers exactly where it does not fit an int64.

        Example:
            >>> import sys
            >>> EpochShuffle(sys.maxsize, seed=0)(np.array([sys.maxsize + 1], dtype=object))[0] >= sys.maxsize
            True
        """
        if indices.size and indices.dtype != object and (int(indices.max()) // self.n + 1) * self.n > _INT64_MAX:
            indices = indices.astype(object)  # an int64 would wrap, silently, in the sum below
        epochs, pos = indices // self.n, (indices % self.n).astype(np.int64)
        first = int(epochs.flat[0]) if epochs.size else 0
        if (epochs == first).all():  # the usual case: one epoch per read
            return self.epoch(first)(pos).astype(indices.dtype) + first * self.n
        out = np.empty_like(indices)
        for e in np.unique(epochs).tolist():
            sel = epochs == e
            out[sel] = self.epoch(e)(pos[sel]).astype(indices.dtype) + e * self.n
        return out
