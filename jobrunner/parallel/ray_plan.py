"""The plan of a Ray job, made once by its driver and shared through Ray's object store.

The driver runs the job's planning half as a Job (job_parts.open_job) whose engine is EngineFace (a
loaded worker's tokenizer and figures: no model here) and whose work source is ShipUnits: it reads
the rows not yet in the output, makes each kind's request, dedups and looks up the result cache (a
hit, and its copies, are written here, in `part-plan` parts; so are rows that fail before the engine),
and plans them window by window. Each window's units, spread over the workers and largest first
(worker.spread_windows), go to the object store in bundles of about `bundle_rows` rows (one big unit
alone), their refs to the queue actor (ray_queue.py); the window's rows then leave the driver. A
bundle is a list of job.ShippedUnit: each leader row with its tokenizer ids, and its copies. The
driver ships a window only once the queue holds less than a window of rows (it holds at most two).

refill() puts a lost worker's unwritten rows back: its held bundles, less the rows its parts have.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from engine import EngineCounters
from jobrunner.job.loop import ShippedRow, ShippedUnit
from jobrunner.parallel.worker import spread_windows

log = logging.getLogger("jobrunner")

BUNDLE_ROWS = 64            # rows of small units per object at most (docs/RAY.md: the queue's calls)
MIN_BUNDLE_ROWS = 16        # and at least, but in a window too small to give each worker two bundles
BUNDLES_PER_WORKER = 8      # a window's bundles per worker, between those bounds: the end of a window balances


@dataclass
class EngineFace:
    """What the planning half of a Job reads of an engine, from a loaded worker (RayWorker.face)."""
    info: object                # engine.EngineInfo
    tokenizer: object
    config: object              # engine.EngineConfig
    num_in_flight = 0

    def counters(self) -> EngineCounters:
        return EngineCounters()

    def has_unfinished(self) -> bool:
        return False

    def add_request(self, request):
        raise AssertionError("the driver's plan runs no row")

    def close(self) -> None:
        pass


class ShipUnits:
    """The driver's work source: every unit shipped to the queue, none run here (Job drops its rows);
    `shipped_rows` counts the rows shipped, copies included: each must come back written in a part.
    `wait_room(rows)` is the driver's: it returns once the queue holds under `rows` (watching the
    workers meanwhile); `job` is set once the Job is open (its pending rows and reuse are read)."""
    rank, hits_now, part_prefix, runs_rows = 0, True, "part-plan", False

    def __init__(self, ray, queue, world: int, out_tokens: int, window_rows: int, wait_room):
        self.ray, self.queue, self.world, self.out_tokens = ray, queue, world, out_tokens
        self.window_rows, self.wait_room = window_rows, wait_room
        self.job = None
        self.seq = 0
        self.shipped_rows = 0
        self.bundles = 0
        self.bundle_bytes = 0       # the largest window's, pickled: docs/RAY.md

    def units(self, units, tokens_of):
        for window in spread_windows(units, self.world, tokens_of, self.out_tokens):
            if window:
                self.wait_room(self.window_rows)
                self._ship(window)
            for unit in window:
                yield unit, False

    def _ship(self, window) -> None:
        rows = sum(len(u.items) for u in window)
        floor = min(MIN_BUNDLE_ROWS, max(1, rows // (2 * self.world)))
        target = max(floor, min(BUNDLE_ROWS, rows // (self.world * BUNDLES_PER_WORKER)))
        bundles, bundle, size = [], [], 0
        for unit in window:
            shipped = self._shipped(unit)
            bundle.append(shipped)
            size += shipped.size
            if size >= target:
                bundles.append((bundle, size))
                bundle, size = [], 0
        if bundle:
            bundles.append((bundle, size))
        queued = []
        for units, n in bundles:
            queued.append((self.seq, n, [self.ray.put(units)]))
            self.seq += 1
        self.ray.get(self.queue.put.remote(queued))
        self.shipped_rows += sum(n for _, n, _ in queued)
        self.bundles += len(bundles)

    def _shipped(self, unit) -> ShippedUnit:
        pending, reuse = self.job.pending, self.job.reuse
        rows, copies = [], {}
        for key in unit.items:
            p = pending[key]
            rows.append(ShippedRow(p.row, p.raw if p.raw is not None else p.tokens))
            waiting = reuse.release(key)
            if waiting:
                copies[key] = [ShippedRow(c, None, notes) for c, notes in waiting]
        return ShippedUnit(rows, copies)


def refill(ray, queue, held: list, written) -> tuple[int, int]:
    """A lost worker's held bundles back in the queue, less the rows in its parts (`written`: an IdSet);
    a copy whose leader is written but not itself leads in its place. Returns (rows put back, bundles)."""
    back, rows = [], 0
    for seq, _, (ref,) in held:
        units = []
        for unit in ray.get(ref):
            unit = _unwritten(unit, written)
            if unit.rows:
                units.append(unit)
        n = sum(u.size for u in units)
        if units:
            back.append((seq, n, [ray.put(units)]))
            rows += n
    if back:
        ray.get(queue.put.remote(back))
    return rows, len(back)


def _unwritten(unit: ShippedUnit, written) -> ShippedUnit:
    rows, copies = [], {}
    for s in unit.rows:
        left = [c for c in unit.copies.get(s.row.id, ()) if c.row.id not in written]
        if s.row.id not in written:
            rows.append(s)
            if left:
                copies[s.row.id] = left
        else:           # the leader's result is in a part, the copies' not: they run themselves
            rows += [ShippedRow(c.row, s.ids, c.notes) for c in left]
    return ShippedUnit(rows, copies)
