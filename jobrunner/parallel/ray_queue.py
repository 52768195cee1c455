"""The work queue of a Ray job: one actor holding the planned units' object refs (ray_plan.py).

The driver plans the job once and puts each window's units in the object store, a bundle of small
units (or one big unit) per object; `put` hands the queue their refs, numbered in the plan's order
(each window's units largest first). Workers ask `next` when their engine has room and get the
lowest-numbered bundle: the earliest window first, in it the largest unit first. A ref travels
wrapped in a list, so that Ray passes it along instead of fetching the bundle into this actor.

The queue knows which bundles each worker holds: handed out, not yet written to a part. A worker
confirms bundles once their rows are in its parts (`confirm`, with its progress); a worker whose
actor died leaves its held bundles to the driver (`take`), which drops the rows its parts already
have and puts the rest back (`put`, with their old numbers: they go first). So every unit's rows are
written exactly once, without a second pass.

    put(bundles)                [(seq, rows, [ref])]: queued; returns the rows queued now
    next(worker, wait_s)        (seq, [ref]) to run, "wait" (nothing within wait_s: ask again) or None (the
                                end); an empty queue answers as soon as bundles come (an async actor: waiting
                                asks cost nothing, and no worker polls)
    confirm(worker, seqs)       these bundles' rows are in the worker's parts
    leave(worker, ran)          the worker's run ended normally: bundles it held and did not run go back
    take(worker)                the held bundles of a worker that died, for the driver to put back
    close()                     the plan is whole: `next` ends once nothing is queued
    report(worker, counts, seqs) progress (and confirm); returns True once the driver asked to stop
    status()                    {"progress": {worker: counts}, "handed": n, "queued_rows": n, "held": n}
    stop()                      the workers stop at their next report, keeping what is written
"""
from __future__ import annotations

import asyncio
import heapq


class WorkQueue:
    """Plain Python: the driver wraps it with ray.remote (so this module imports without Ray)."""

    def __init__(self):
        self._heap: list[tuple[int, int, list]] = []        # (seq, rows, [ref])
        self._held: dict[int, dict[int, tuple[int, int, list]]] = {}     # worker -> seq -> bundle
        self._progress: dict[int, dict] = {}
        self._queued_rows = 0
        self._handed = 0
        self._closed = False
        self._stop = False
        self._gone: set[int] = set()        # slots of runs whose worker died (take)
        self._arrived: asyncio.Event | None = None     # set when bundles come, the plan ends or the job stops

    def put(self, bundles: list) -> int:
        for seq, rows, ref in bundles:
            heapq.heappush(self._heap, (seq, rows, ref))
            self._queued_rows += rows
        self._wake()
        return self._queued_rows

    async def next(self, worker: int, wait_s: float = 0.0):
        if not self._heap and not (self._stop or self._closed) and wait_s > 0:
            if self._arrived is None:
                self._arrived = asyncio.Event()
            try:
                await asyncio.wait_for(self._arrived.wait(), wait_s)
            except asyncio.TimeoutError:
                pass
        return self._take(worker)

    def _wake(self) -> None:
        if self._arrived is not None:
            self._arrived.set()
            self._arrived = None

    def _take(self, worker: int):
        if worker in self._gone:        # an ask that reached the actor after its worker died: nothing for it
            return None
        if self._stop or not self._heap:
            return None if (self._stop or self._closed) else "wait"
        bundle = heapq.heappop(self._heap)
        self._queued_rows -= bundle[1]
        self._held.setdefault(worker, {})[bundle[0]] = bundle
        self._handed += 1
        return bundle[0], bundle[2]

    def confirm(self, worker: int, seqs) -> None:
        held = self._held.get(worker, {})
        for s in seqs:
            held.pop(s, None)

    def leave(self, worker: int, ran) -> None:
        held = self._held.pop(worker, {})
        for s in set(held) - set(ran):
            self.put([held[s]])

    def take(self, worker: int) -> list:
        self._gone.add(worker)          # a run's slot is never used again
        return list(self._held.pop(worker, {}).values())

    def close(self) -> None:
        self._closed = True
        self._wake()

    def report(self, worker: int, counts: dict, seqs=()) -> bool:
        self._progress[worker] = counts
        self.confirm(worker, seqs)
        return self._stop

    def status(self) -> dict:
        return {"progress": dict(self._progress), "handed": self._handed, "queued_rows": self._queued_rows,
                "queued": len(self._heap), "held": sum(len(h) for h in self._held.values())}

    def stop(self) -> None:
        self._stop = True
        self._wake()
