"""What an output's parts hold of its dataset, row by row: what a resumed job skips.

A dataset may repeat an id. The id's first row (occurrence 1) is its own: computed, or an error row of
its own; each later row (occurrence 2, 3, ...) becomes a duplicate error row (`duplicate_error`),
written as it is read, often before the id's own row is computed. So done-ness is kept per
occurrence: a duplicate's error row never makes its id done, and a resume after a kill at any moment
computes the id's own row once and writes each duplicate's error row once.

    DoneRows.ids      the ids whose own row is in a part (an IdSet: 16 bytes an id)
    DoneRows.failed   of those, the ids whose own row is an error row
    DoneRows.repeats  `repeat_key(id, k)` of each later occurrence k whose duplicate error row is in a
                      part; a set of its own, so no key ever meets a real id

Invariant: an id's duplicate error rows are written in the order their rows are read (the emitter
writes them at once, a part is the buffer in order), so the m a part holds are occurrences 2 .. m+1.
"""
from __future__ import annotations

import re
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc

from jobrunner.common.idset import IdSet

__all__ = ["DUPLICATE_ERROR_RE", "DoneRows", "Occurrences", "duplicate_error", "is_duplicate_error", "repeat_key"]

# an OpenAI batch line's errors are prefixed with its line (job/emit.py)
DUPLICATE_ERROR_RE = r"^(?:line \d+: )?duplicate id "


def duplicate_error(id: str) -> str:
    """The error of a row whose id an earlier row of the dataset has."""
    return f"duplicate id {id!r}: an earlier row has the same id"


def is_duplicate_error(error) -> bool:
    return isinstance(error, str) and re.match(DUPLICATE_ERROR_RE, error) is not None


def repeat_key(id: str, occurrence: int) -> str:
    """The key of an id's later occurrence (2, 3, ...) in DoneRows.repeats."""
    return f"{occurrence}:{id}"


class Occurrences:
    """Each row's occurrence of its id, as a dataset is read in order: 1 for the id's first row, 2, 3, ...
    for its repeats. Ids read are kept as an IdSet; counts only for ids that repeat."""

    def __init__(self):
        self.seen = IdSet()
        self.repeated: dict[str, int] = {}      # id -> its occurrences so far, for ids read twice or more

    def number(self, ids: Sequence[str]) -> list[int]:
        out = []
        for id, repeat in zip(ids, self.seen.add_new(ids)):
            if repeat:
                k = self.repeated[id] = self.repeated.get(id, 1) + 1
                out.append(k)
            else:
                out.append(1)
        return out


class DoneRows:
    """The rows an output's parts hold, by occurrence (see the module doc); `add` a part at a time."""

    def __init__(self):
        self.ids, self.failed, self.repeats = IdSet(), IdSet(), IdSet()
        self._duplicates: dict[str, int] = {}     # id -> its duplicate error rows added so far

    def add(self, keys: list[str], errors: pa.ChunkedArray | pa.Array | None) -> None:
        """A part's rows: their keys (id keys, in order) and their error column (None: the part has none)."""
        if errors is None or pa.types.is_null(errors.type):     # no error row
            self.ids.update(keys)
            return
        failed = pc.is_valid(errors).to_pylist()
        duplicate = pc.fill_null(pc.match_substring_regex(errors, DUPLICATE_ERROR_RE), False).to_pylist()
        self.ids.update(k for k, dup in zip(keys, duplicate) if not dup)
        self.failed.update(k for k, bad, dup in zip(keys, failed, duplicate) if bad and not dup)
        for k, dup in zip(keys, duplicate):
            if dup:
                m = self._duplicates[k] = self._duplicates.get(k, 0) + 1
                self.repeats.add(repeat_key(k, m + 1))

    def contains(self, ids: Sequence[str], occurrences: Sequence[int]) -> list[bool]:
        """Whether each row (its id, its occurrence: Occurrences.number) is in the parts already."""
        own = self.ids.contains_many(ids)
        return [d if k == 1 else repeat_key(id, k) in self.repeats for id, k, d in zip(ids, occurrences, own)]
