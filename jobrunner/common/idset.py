"""A set of string ids in about 16 bytes an id: exact duplicate and resume checks over huge datasets.

A Python set of str costs about 100 bytes an id (the str object and its hash slot). This keeps each
id's 128-bit blake2b digest instead, in sorted numpy runs (a small log-structured merge):

    recent   a plain set of digests (bytes), at most RECENT of them, for cheap single adds
    runs     sorted arrays of digests (dtype V16, compared as bytes), sizes strictly decreasing:
             when `recent` fills it becomes a run, and a run at least half as large as the one before
             merges into it, so there are at most about log2(n / RECENT) runs and each digest is
             re-sorted O(log n) times. A lookup is one binary search per run.

Collisions: membership is exact up to digest collisions. Two distinct ids share a 128-bit digest with
probability 2**-128, so even 10**12 ids against 10**12 collide with probability about 3e-15, far below
the rate of undetected hardware errors; we accept that risk. (A 64-bit digest would not do: 10**9 ids
against 10**9 would collide with probability about 5%, and a resumed job would skip the colliding row
as done, silently losing it.)
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from hashlib import blake2b

import numpy as np

RECENT = 8192           # digests kept in the plain set before they become a sorted run
_DTYPE = np.dtype("V16")


def digest(id: str) -> bytes:
    """16-byte digest of an id (any str, lone surrogates included)."""
    return blake2b(id.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class IdSet:
    """A growing set of str ids: add, membership, len. Not iterable (only digests are kept)."""

    def __init__(self, ids: Iterable[str] = ()):
        self._recent: set[bytes] = set()
        self._runs: list[np.ndarray] = []   # each sorted, no digest in two runs or in _recent
        self._len = 0
        self.update(ids)

    def __len__(self) -> int:
        return self._len

    def __contains__(self, id: str) -> bool:
        return bool(self._known([digest(id)])[0])

    def add(self, id: str) -> None:
        self.add_new([id])

    def update(self, ids: Iterable[str]) -> None:
        batch: list[str] = []
        for id in ids:
            batch.append(id)
            if len(batch) >= RECENT:
                self.add_new(batch)
                batch = []
        self.add_new(batch)

    def contains_many(self, ids: Sequence[str]) -> list[bool]:
        """Membership of each id (one vectorized search per run)."""
        return self._known([digest(i) for i in ids]).tolist()

    def add_new(self, ids: Sequence[str]) -> list[bool]:
        """Add each id in order; True where it was already there (before, or earlier in `ids`)."""
        digs = [digest(i) for i in ids]
        known = self._known(digs).tolist()
        added: set[bytes] = set()           # this call's: `recent` may be sealed into a run midway
        for k, d in enumerate(digs):
            if known[k]:
                continue
            if d in added:                  # a repeat within this call
                known[k] = True
                continue
            added.add(d)
            self._recent.add(d)
            self._len += 1
            if len(self._recent) >= RECENT:
                self._seal()
        return known

    def _known(self, digs: list[bytes]) -> np.ndarray:
        """Bool array: digest already in the set (before this call's additions)."""
        hit = np.fromiter((d in self._recent for d in digs), dtype=bool, count=len(digs))
        if digs and self._runs:
            q = np.frombuffer(b"".join(digs), dtype=_DTYPE)
            for run in self._runs:
                i = np.minimum(np.searchsorted(run, q), len(run) - 1)
                hit |= run[i] == q
        return hit

    def _seal(self) -> None:
        """Turn `recent` into a sorted run, then merge runs until sizes halve at least at each step."""
        run = np.frombuffer(b"".join(self._recent), dtype=_DTYPE).copy()
        run.sort()
        self._recent = set()
        runs = self._runs
        runs.append(run)
        while len(runs) > 1 and 2 * len(runs[-1]) >= len(runs[-2]):
            b, a = runs.pop(), runs.pop()
            merged = np.concatenate((a, b))
            del a, b
            merged.sort(kind="stable")      # two sorted halves: a merge, O(n)
            runs.append(merged)
