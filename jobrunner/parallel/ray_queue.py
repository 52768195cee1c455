"""The work queue of a Ray job: one actor, the TCPStore counter's place (protocol.next_ticket).

Every worker of a round walks the same plan (Job's contract: the same rows, read against the round's
one snapshot of done ids, planned identically, each window's units largest first), so a unit is
named by its index in the plan. Units 0 .. members-1 go to slots 0 .. members-1 (every worker starts
with one); past those, a worker asks for the next ticket when its engine has room, and ticket t is
unit members + t. A ticket is drawn by exactly one worker, so each unit is run by exactly one.

The actor also keeps, per round, what the driver reads: each worker's progress and the tickets it
drew, and whether the driver asked the workers to stop (a signal). It holds no rows: a lost worker's
units are found again from the output directory (the parts are the truth), by the next round's plan.

    next_tickets(r, worker, k)  k tickets, in order, for `worker` in round r
    report(r, worker, progress) a worker's counts so far; returns True once the driver asked to stop
    done(r, worker)             the worker's claimed units are all written (its round ended normally)
    status(r)                   {"progress": {worker: counts}, "tickets": {worker: n}, "done": [workers]}
    stop()                      the workers stop at their next report, keeping what is written
"""
from __future__ import annotations


class WorkQueue:
    """Plain Python: the driver wraps it with ray.remote (so this module imports without Ray)."""

    def __init__(self):
        self._next: dict[int, int] = {}
        self._tickets: dict[tuple[int, int], int] = {}
        self._progress: dict[tuple[int, int], dict] = {}
        self._done: set[tuple[int, int]] = set()
        self._stop = False

    def next_tickets(self, r: int, worker: int, k: int = 1) -> list[int]:
        t = self._next.get(r, 0)
        self._next[r] = t + k
        self._tickets[r, worker] = self._tickets.get((r, worker), 0) + k
        return list(range(t, t + k))

    def report(self, r: int, worker: int, progress: dict) -> bool:
        self._progress[r, worker] = progress
        return self._stop

    def done(self, r: int, worker: int) -> None:
        self._done.add((r, worker))

    def status(self, r: int) -> dict:
        return {"progress": {w: p for (rr, w), p in self._progress.items() if rr == r},
                "tickets": {w: n for (rr, w), n in self._tickets.items() if rr == r},
                "done": sorted(w for rr, w in self._done if rr == r)}

    def stop(self) -> None:
        self._stop = True

    def stopping(self) -> bool:
        return self._stop
