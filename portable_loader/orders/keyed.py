"""Keyed stream arithmetic: keys from a seed, a keyed permutation of ``range(n)``, the epoch layout.

Every order the loader serves (``LCGSampler``, a mixture's blocks, ``shuffle="shards"``, a packing
window's rows) is built from three pieces, all computed and never stored:

1. **Keys.** ``splitmix64`` is a bijection of 64-bit integers that scrambles every bit.
   ``subkey(seed, i, salt) = splitmix64(seed ^ splitmix64(i ^ salt))`` gives item ``i`` of a family
   (epochs, blocks, windows, shard groups) its own key; the salt keeps families apart, so epoch 3 and
   window 3 of one seed get unrelated keys. Python integers throughout: the same on every machine.
2. **A keyed permutation** of ``[0, n)`` (``KeyedPermutation(n, seed, epoch)``). Let ``M = 2**k`` be
   the smallest power of two ``>= n``. A keyed bijection ``f`` of ``[0, M)`` whitens ``x`` (xor a key,
   multiply by an odd key) and runs four rounds of a full-period linear congruential step
   ``x = (a*x + c) mod M`` (``a % 4 == 1``, ``c`` odd: the Hull-Dobell conditions) followed by an
   xorshift ``x ^= x >> s``. A bare power-of-two LCG has weak low bits (bit 0 alternates, bit j has
   period ``2**(j+1)``); the xorshift folds high bits into low ones, so the mixed order passes the
   rank-correlation, parity and gap checks in ``tests/test_sampler.py``. Cycle walking then repeats
   ``y = f(x)`` while ``y >= n``: because ``f`` permutes ``[0, M)``, the walk from ``x < n`` stays on
   ``x``'s cycle and stops at its next member ``< n``, so the result is a bijection of ``[0, n)`` for
   every ``n >= 1``, in under two steps on average (``M < 2n``). The keys ``a``, ``c``, the whitening
   key and the shift come from ``subkey(seed, epoch, ...)`` chained through splitmix64. This is the
   idea of IBM's fms-fsdp loader (an LCG over the next power of two instead of materialized
   document lists), with mixing and random access added.
3. **The epoch layout.** A stream of whole epochs of ``N`` records, cut into ``K`` shards by position:
   shard ``k`` takes positions ``k, k + K, ...`` of each epoch (``shard_epoch_length`` of them), and
   its ``i``-th position is position ``epoch_position(i, ...)`` of epoch ``i // length``.

Example:
    >>> perm = KeyedPermutation(10, seed=7, epoch=0)
    >>> order = [perm.one(x) for x in range(10)]
    >>> sorted(order) == list(range(10)), order == [perm.one(x) for x in range(10)]   # a bijection, repeatable
    (True, True)
    >>> order != [KeyedPermutation(10, seed=7, epoch=1).one(x) for x in range(10)]   # a new order each epoch
    True
    >>> length = shard_epoch_length(10, shard_index=1, shard_count=3)   # positions 1, 4, 7 of each epoch
    >>> length, [epoch_position(i, length, 1, 3) for i in range(5)]
    (3, [(0, 1), (0, 4), (0, 7), (1, 1), (1, 4)])
"""

from __future__ import annotations

import numbers
from typing import Sequence

import numpy as np

__all__ = ["FEW", "MASK64", "KeyedPermutation", "as_int64", "check_int", "epoch_position", "keep", "permute_many",
           "shard_epoch_length", "splitmix64", "subkey"]

#: Keys and seeds are 64-bit: ``seed`` in ``[0, MASK64]``.
MASK64 = (1 << 64) - 1
_ROUNDS = 4  # of the LCG step and xorshift per application of the mixer
#: Up to this many positions a permutation maps in Python integers: a dozen numpy calls on a
#: 3-element array cost ten times the arithmetic.
FEW = 24
_FEW_PERMS = 8  # permute_many calls each of up to this many permutations on its own positions
# Work in blocks that stay in L2 cache: each round is a handful of in-place passes over the block.
_BLOCK = 1 << 15
_EPOCH_SALT = 0x5EED_0F_E90C  # keeps the epoch keys apart from every other family of subkeys
_GAMMA = 0x9E3779B97F4A7C15


def splitmix64(x: int) -> int:
    """Steele, Lea and Flood's splitmix64 finalizer of ``x + gamma``: a bijection of 64-bit integers.

    Example:
        >>> hex(splitmix64(0))
        '0xe220a8397b1dcdaf'
        >>> splitmix64(1) != splitmix64(2)
        True
    """
    x = (x + _GAMMA) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def subkey(seed: int, index: int, salt: int) -> int:
    """The key of item ``index`` of the family named by ``salt`` under ``seed``.

    ``splitmix64(seed ^ splitmix64(index ^ salt))``: a family's salt is a constant of the code that
    uses it (or a subkey of an outer family), and changing one changes that family's streams.

    Example:
        >>> subkey(1, 3, 0xABC) == splitmix64(1 ^ splitmix64(3 ^ 0xABC))
        True
        >>> subkey(1, 3, 0xABC) != subkey(1, 3, 0xABD)   # another family: another key
        True
    """
    return splitmix64(seed ^ splitmix64(index ^ salt))


class KeyedPermutation:
    """The bijection of ``[0, n)`` keyed by ``(seed, epoch)`` (module docstring); a few integers, no arrays.

    ``one(x)`` maps one position in Python integers; calling it with a ``uint64`` array maps many
    (numpy, in cache-sized blocks; up to ``FEW`` positions, in Python integers). Both give the same
    values (``tests/test_sampler.py`` checks it).

    Example:
        >>> import numpy as np
        >>> perm = KeyedPermutation(1000, seed=3, epoch=2)
        >>> out = perm(np.arange(1000, dtype=np.uint64))
        >>> np.array_equal(np.sort(out), np.arange(1000)), int(out[5]) == perm.one(5)
        (True, True)
    """

    __slots__ = ("n", "bits", "keys", "_draws", "_np")

    def __init__(self, n: int, seed: int, epoch: int = 0):
        self.n = n
        self.bits = bits = max(0, (n - 1).bit_length())
        x = subkey(seed, epoch, _EPOCH_SALT)
        draws = []
        m64 = MASK64
        for _ in range(2 + 2 * _ROUNDS):  # splitmix64 chained, inlined: this runs once per epoch and per describe
            x = (x + _GAMMA) & m64
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
        """The image of one position ``x`` in ``[0, n)``, in Python integers.

        Example:
            >>> KeyedPermutation(1, seed=0).one(0)
            0
        """
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
        if positions.size <= FEW:
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
        """Cycle-walk the values ``x`` (all ``>= n``) into ``[0, n)``: each pass mixes those still
        out of range. The last few go on in Python integers (``one`` continues a walk from any
        value): a pass costs its two dozen numpy calls however few values it mixes, and the
        stragglers of a chunk of 4,096 took half a dozen passes."""
        tmp = np.empty_like(x)
        todo = np.arange(x.size)
        cur = x
        while todo.size > FEW:
            self._mix(cur, tmp[: cur.size])
            x[todo] = cur
            keep = cur >= n
            todo = todo[keep]
            cur = cur[keep]
        if todo.size:
            x[todo] = [self.one(v) for v in cur.tolist()]
        return x


def shard_epoch_length(num_records: int, shard_index: int = 0, shard_count: int = 1) -> int:
    """Positions of shard ``shard_index`` of ``shard_count`` in each epoch: ``k, k + K, ...`` below ``N``.

    Example:
        >>> [shard_epoch_length(10, k, 4) for k in range(4)]   # 0 4 8 | 1 5 9 | 2 6 | 3 7
        [3, 3, 2, 2]
    """
    return -(-(num_records - shard_index) // shard_count)


def epoch_position(index, epoch_length: int, shard_index: int = 0, shard_count: int = 1):
    """``(epoch, position in that epoch's global order)`` of a shard's stream ``index``.

    ``index`` is an integer or an int64 array (then both are arrays); ``epoch_length`` is the
    shard's, from :func:`shard_epoch_length`.

    Example:
        >>> import numpy as np
        >>> epoch_position(7, 3, shard_index=1, shard_count=3)
        (2, 4)
        >>> [a.tolist() for a in epoch_position(np.arange(4), 2)]
        [[0, 0, 1, 1], [0, 1, 0, 1]]
    """
    epoch, within = divmod(index, epoch_length)
    return epoch, within * shard_count + shard_index


def check_int(name: str, value, minimum: int = 0, maximum: int | None = None) -> int:
    """``value`` as an ``int`` in ``[minimum, maximum]``; ``ValueError`` naming ``name`` otherwise.

    What every keyed order checks its sizes, seeds and epochs with (booleans are not integers here).

    Example:
        >>> check_int("seed", 5, maximum=MASK64)
        5
        >>> check_int("epoch", True)
        Traceback (most recent call last):
        ValueError: epoch must be an integer, got True (bool)
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be {bounds}, got {value}")
    return value


def as_int64(name: str, values) -> np.ndarray:
    """Positions as an int64 array (no copy when they are one); ``ValueError`` for anything but integers.

    Example:
        >>> as_int64("positions", [3, 1]).tolist()
        [3, 1]
        >>> as_int64("positions", [1.5])
        Traceback (most recent call last):
        ValueError: positions must be integers, got dtype float64
    """
    arr = np.asarray(values)
    if arr.dtype == object or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{name} must be integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{name} must be in int64 range, got {int(arr.max())}")
    return arr.astype(np.int64, copy=False)


def keep(cache: dict, key, value, limit: int):
    """Put ``value`` in a small cache of permutations or block counts, first dropping its oldest entry
    when it holds ``limit``; returns ``value``.

    A loader's prefetch thread and ``describe`` may share one cache: an entry the other thread
    dropped meanwhile is no error.

    Example:
        >>> cache = {}
        >>> for epoch in range(5):
        ...     _ = keep(cache, epoch, KeyedPermutation(4, seed=0, epoch=epoch), limit=3)
        >>> sorted(cache)
        [2, 3, 4]
    """
    if len(cache) >= limit:
        try:
            cache.pop(next(iter(cache)), None)
        except (StopIteration, RuntimeError):  # emptied or resized by the other thread meanwhile
            pass
    cache[key] = value
    return value


def permute_many(perms: Sequence[KeyedPermutation], which: np.ndarray | None, x: np.ndarray) -> np.ndarray:
    """``perms[which[j]](x[j])`` for every ``j`` (``which`` None: ``x`` has a row per permutation):
    ``KeyedPermutation.__call__`` with each position's own keys, the same 64-bit numpy arithmetic
    (mixer, then cycle walking), so the same values.

    Example:
        >>> perms = [KeyedPermutation(10, seed=1), KeyedPermutation(300, seed=2, epoch=4)]
        >>> x, which = np.arange(40), np.arange(40) % 2
        >>> got = permute_many(perms, which, x % 10)
        >>> got.tolist() == [perms[w].one(v) for w, v in zip(which.tolist(), (x % 10).tolist())]
        True
        >>> permute_many(perms, None, np.array([[0, 1], [2, 3]])).tolist() == [[perms[0].one(0), perms[0].one(1)],
        ...                                                                   [perms[1].one(2), perms[1].one(3)]]
        True
        >>> many = [KeyedPermutation(5 + 7 * k, seed=k, epoch=k % 3) for k in range(12)]   # keys gathered per position
        >>> which = np.arange(200) % 12
        >>> got = permute_many(many, which, np.arange(200) % 5)
        >>> got.tolist() == [many[w].one(v) for w, v in zip(which.tolist(), (np.arange(200) % 5).tolist())]
        True
    """
    if which is not None and len(perms) <= _FEW_PERMS:
        # A few permutations (a mixture of a few sources): each one's positions, sorted together,
        # go through its own call with scalar keys, cheaper than gathering keys per position.
        which = np.asarray(which, dtype=np.int64).reshape(-1)
        order = np.argsort(which.astype(np.uint16), kind="stable")  # by radix
        bounds = np.searchsorted(which[order], np.arange(len(perms) + 1)).tolist()
        xs = np.asarray(x, dtype=np.int64).reshape(-1)[order].view(np.uint64)
        out = np.empty(xs.size, dtype=np.int64)
        for perm, a, b in zip(perms, bounds, bounds[1:]):
            if b > a:
                out[order[a:b]] = perm(xs[a:b])
        return out.reshape(np.shape(x))
    rows = []  # per permutation: n, mask, whitening key, pre-multiplier, a per round, c per round, shift
    for perm in perms:
        mask, white, premult, rounds, shift = perm._numpy_keys()
        rows.append([perm.n, mask, white, premult, *(a for a, _ in rounds), *(c for _, c in rounds), shift])
    keys = np.array(rows, dtype=np.uint64).T  # one row per key, one column per permutation
    rounds = (keys.shape[0] - 5) // 2
    shape = np.shape(x)
    if which is None:  # a row per permutation: its keys broadcast along it (no gather)
        which = np.repeat(np.arange(len(perms)), shape[1] if len(shape) > 1 else 1)
        first = keys[:, :, None]
    else:
        which = np.asarray(which, dtype=np.int64).reshape(-1)
        first = keys[:, which].reshape((keys.shape[0],) + shape)
    x = np.array(x, dtype=np.uint64)
    todo = None  # every position in the first pass; then those still >= n (cycle walking)
    while True:
        key = first if todo is None else keys[:, which[todo]]
        cur = x if todo is None else x[todo]
        cur ^= key[2]
        cur *= key[3]
        for r in range(rounds):
            cur *= key[4 + r]
            cur += key[4 + rounds + r]
            cur &= key[1]
            cur ^= cur >> key[4 + 2 * rounds]
        again = np.flatnonzero(cur >= key[0])
        if todo is None:
            x = x.reshape(-1)
        else:
            x[todo] = cur
        if not again.size:
            return x.view(np.int64).reshape(shape)
        todo = again if todo is None else todo[again]
        if todo.size <= FEW:  # the last few walk on in Python integers (see KeyedPermutation._walk)
            x[todo] = [perms[w].one(v) for w, v in zip(which[todo].tolist(), x[todo].tolist())]
            return x.view(np.int64).reshape(shape)
