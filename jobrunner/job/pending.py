"""A row on its way through a job: made once by the intake (jobrunner/job/intake.py), held while it
waits in the planner or the engine, shipped as it is to another process (a Ray job's workers)."""
from __future__ import annotations

from array import array
from dataclasses import dataclass, replace


class Interrupted(Exception):
    """A signal asked the job to stop: raised between steps, caught by the loop that runs it."""


@dataclass(slots=True)
class PendingRow:
    """A row inside the planner or the engine: its request's parameters and, apart, its prompt's token
    ids as uint32 (4 bytes a token, not ~36 in a list of ints) while it waits; the engine gets them as a
    list when the row is submitted. `notes` are what the kind's request step noted for its columns step
    (jobs.row.RowNotes): they go where the row goes, so no kind keeps per-row state."""
    row: object                     # jobrunner.dataset.Row
    tokens: array                   # array("I"): the prompt's token ids
    request: object                 # the engine Request, its prompt_token_ids empty (they are `tokens`)
    notes: object                   # jobs.row.RowNotes

    @property
    def id(self) -> str:
        return self.row.id

    def engine_request(self):
        return replace(self.request, prompt_token_ids=self.tokens.tolist())

    def for_copy(self, row, notes) -> PendingRow:
        """A copy of this row (the same request) that runs itself: its leader's result is written, its own not."""
        return PendingRow(row, self.tokens, replace(self.request, id=row.id), notes if notes is not None else self.notes)


@dataclass(slots=True)
class ShippedUnit:
    """A work unit planned in another process, its rows with it: the leaders as planned, in the unit's
    order, and the copies (dedup) each leader's result is written for, as (row, notes)."""
    rows: list[PendingRow]
    copies: dict[str, list[tuple]]

    @property
    def items(self) -> list[str]:
        return [p.id for p in self.rows]

    @property
    def size(self) -> int:
        """Its rows to write: the leaders and their copies."""
        return len(self.rows) + sum(map(len, self.copies.values()))
