"""A seeded pseudo-random permutation of [0, n) computed index by index, never materialised:
a 4-round Feistel network over the smallest even-bit power-of-two domain >= n, with cycle
walking (an index mapped to >= n is mapped again until it lands below n). Memory is O(1) in
n, so shuffling a corpus of billions of documents costs nothing up front. The idea is the
one Levanter's data/_prp.py uses (docs/architecture.md)."""

from __future__ import annotations

import numpy as np

ROUNDS = 4
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective 64-bit hash (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class Permutation:
    """`perm(i)` for arrays of indices i in [0, n): a bijection of [0, n) fixed by `key`
    (a tuple of ints, e.g. (seed, epoch))."""

    def __init__(self, n: int, key: tuple[int, ...]):
        if n < 1:
            raise ValueError(f"a permutation of {n} elements")
        self.n = int(n)
        self.half = max(1, (int(n - 1).bit_length() + 1) // 2)  # domain 4**half >= n
        seed = np.uint64(0x9E3779B97F4A7C15)
        for k in key:
            seed = _mix(seed ^ np.uint64(int(k) & 0xFFFFFFFFFFFFFFFF))
        self.round_keys = [_mix(seed + np.uint64(r + 1)) for r in range(ROUNDS)]

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        low_mask = np.uint64((1 << self.half) - 1)
        left = x >> np.uint64(self.half)
        right = x & low_mask
        for k in self.round_keys:
            left, right = right, left ^ (_mix(right ^ k) & low_mask)
        return (left << np.uint64(self.half)) | right

    def __call__(self, indices) -> np.ndarray:
        x = np.asarray(indices, np.int64)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise IndexError(f"indices outside [0, {self.n})")
        y = self._feistel(x.astype(np.uint64))
        walking = y >= np.uint64(self.n)
        while walking.any():  # at most a few rounds: the domain is < 4n
            y[walking] = self._feistel(y[walking])
            walking = y >= np.uint64(self.n)
        return y.astype(np.int64)
