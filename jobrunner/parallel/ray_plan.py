"""The plan of a Ray job, made once by its driver and shared through Ray's object store.

The driver plans with the job's own parts (job.build.open_parts on a loaded worker's engine info,
tokenizer and config: no model here): the intake reads the rows not yet in the output and makes
each row's request once, dedups and looks up the result cache (a hit, and its copies, are written
here, in `part-plan` parts; so are rows that fail before the engine), and the planner orders them
window by window. Each window's units, spread over the workers and largest first
(worker.spread_windows), go to the object store in bundles of about `bundle_rows` rows (one big unit
alone), their refs to the queue actor (ray_queue.py); the window's rows then leave the driver. A
bundle is a list of job.pending.ShippedUnit: each leader's PendingRow as the intake made it, and its
copies. The driver ships a window only once the queue holds less than a window of rows (it holds at
most two).

refill() puts a lost worker's unwritten rows back: its held bundles, less the rows its parts have.
"""
from __future__ import annotations

import logging

from jobrunner.engine import EngineCounters
from jobrunner.pipeline.loop import run_record
from jobrunner.pipeline.pending import Interrupted, ShippedUnit
from jobrunner.parallel.worker import spread_windows

log = logging.getLogger("jobrunner")

BUNDLE_ROWS = 64            # rows of small units per object at most (docs/RAY.md: the queue's calls)
MIN_BUNDLE_ROWS = 16        # and at least, but in a window too small to give each worker two bundles
BUNDLES_PER_WORKER = 8      # a window's bundles per worker, between those bounds: the end of a window balances


class Shipper:
    """Plans a job with its parts (job.build.JobParts) and ships every unit to the queue, running none;
    `shipped_rows` counts the rows shipped, copies included: each must come back written in a part.
    `wait_room(rows)` is the driver's: it returns once the queue holds under `rows` (watching the
    workers meanwhile)."""

    def __init__(self, ray, queue, world: int, out_tokens: int, window_rows: int, wait_room):
        self.ray, self.queue, self.world, self.out_tokens = ray, queue, world, out_tokens
        self.window_rows, self.wait_room = window_rows, wait_room
        self.seq = 0
        self.shipped_rows = 0
        self.bundles = 0
        self.bundle_bytes = 0       # the largest window's, pickled: docs/RAY.md

    def ship(self, parts, info) -> dict:
        """Plans and ships every row of the job; returns the planning run's record (its rows: those
        written here). info: the workers' engine's, for the record."""
        pending = {}
        interrupted = False
        try:
            units = parts.planner.plan(parts.intake.rows(), pending)
            for window in spread_windows(units, self.world, lambda key: pending[key].tokens, self.out_tokens):
                if window:
                    self.wait_room(self.window_rows)
                    self._ship(window, pending, parts.reuse)
        except Interrupted:
            interrupted = True
        finally:
            parts.reuse.close()
        parts.writer.flush()
        return run_record(parts.stats, parts.planner, info, EngineCounters(), parts.parallel, parts.output,
                          interrupted)

    def _ship(self, window, pending: dict, reuse) -> None:
        rows = sum(len(u.items) for u in window)
        floor = min(MIN_BUNDLE_ROWS, max(1, rows // (2 * self.world)))
        target = max(floor, min(BUNDLE_ROWS, rows // (self.world * BUNDLES_PER_WORKER)))
        bundles, bundle, size = [], [], 0
        for unit in window:
            shipped = _shipped(unit, pending, reuse)
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


def _shipped(unit, pending: dict, reuse) -> ShippedUnit:
    """A unit's rows as shipped: they leave the driver's pending rows, and the copies waiting for each
    leader go with it (later copies of its request lead anew)."""
    rows, copies = [], {}
    for key in unit.items:
        rows.append(pending.pop(key))
        waiting = reuse.release(key)
        if waiting:
            copies[key] = waiting
        reuse.drop(key)
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
    for p in unit.rows:
        left = [(row, notes) for row, notes in unit.copies.get(p.id, ()) if row.id not in written]
        if p.id not in written:
            rows.append(p)
            if left:
                copies[p.id] = left
        else:           # the leader's result is in a part, the copies' not: they run themselves
            rows += [p.for_copy(row, notes) for row, notes in left]
    return ShippedUnit(rows, copies)
