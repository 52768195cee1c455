"""Identical rows computed once: the first row of a request key (the leader) runs; each later row
with that key (a copy) waits for the leader's result and gets it under its own id.

Decisions depend only on the rows read, never on timing, so data-parallel workers, which read
the same rows, agree: a copy belongs to the worker that runs its leader (the others drop it).
Keys are remembered for a window of `window_rows` keyed rows (bounded memory): a copy of a leader
from an earlier window runs again (or comes from the result cache). The results of the window's
finished leaders are kept for copies still to come.
"""
from __future__ import annotations

from jobrunner.engine import RequestOutput


class Dedup:
    def __init__(self, window_rows: int):
        self.window_rows = window_rows
        self.leaders: dict[bytes, str] = {}             # key -> leader id, this window
        self.window_ids: set[str] = set()               # the leaders' ids, this window
        self.results: dict[str, RequestOutput] = {}     # leader id -> result, leaders of this window done
        self.dropped: set[str] = set()                  # leaders of this window another worker runs
        self.waiting: dict[str, list] = {}              # leader id -> copies (row, notes) waiting for its result
        self._count = 0

    def admit(self, row, key: bytes, notes=None) -> tuple[bool, RequestOutput | None]:
        """(runs, result): runs is True for a leader (it goes on to run); a copy gets (False, the
        leader's result) when the leader is done, else (False, None): it waits, with `notes` (the job
        kind's on it: jobs.row.RowNotes), or another worker has it."""
        self._count += 1
        if self._count > self.window_rows:
            self.leaders.clear()
            self.window_ids.clear()
            self.results.clear()
            self.dropped.clear()
            self._count = 1
        leader = self.leaders.get(key)
        if leader is None:
            self.leaders[key] = row.id
            self.window_ids.add(row.id)
            return True, None
        if leader in self.results:
            return False, self.results[leader]
        if leader not in self.dropped:
            self.waiting.setdefault(leader, []).append((row, notes))
        return False, None

    def finish(self, leader_id: str, out: RequestOutput) -> list:
        """A leader's result: the copies (row, notes) waiting for it; later copies in the window get it at admit."""
        if leader_id in self.window_ids:
            self.results[leader_id] = out
        return self.waiting.pop(leader_id, [])

    def release(self, leader_id: str, key: bytes | None) -> list:
        """A leader whose result another process writes, with its copies (returned): forgotten, so that
        a later copy leads anew rather than waiting for a result that never comes."""
        if key is not None and self.leaders.get(key) == leader_id:
            del self.leaders[key]
        self.window_ids.discard(leader_id)
        return self.waiting.pop(leader_id, [])

    def drop(self, leader_id: str) -> None:
        """A leader this worker does not run: its copies are another worker's."""
        self.waiting.pop(leader_id, None)
        if leader_id in self.window_ids:
            self.dropped.add(leader_id)
