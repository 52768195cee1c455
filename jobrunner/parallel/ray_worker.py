"""A Ray job's worker: an actor with one engine, loaded once, running the rounds its driver opens.

A round is a data-parallel worker's Job (job_parts.open_job with worker.SharedUnits: the same plan
as every other worker's, each window's units largest first), its units claimed from the queue actor
(QueueClaim), its progress sent there too (QueueProgress), and the round's one snapshot of done ids
as the ids its writer skips. Its parts are written with the usual atomic protocol under its own
prefix (`part-r<slot>`), so the output is a local run's. The config and jobrunner.resolve's Resolved
are the driver's, as JSON (as the data-parallel launcher passes them): resolved once per job.

The Job meets Ray only through QueueClaim, its work source's claim:
    claim(index) -> bool    run unit `index` of the plan? (called for every unit, in order)
    complete()              every unit claimed is written (the round ended normally)
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import deque
from dataclasses import replace

from jobrunner.config import JobConfigError
from jobrunner.job import EXIT_CONFIG
from jobrunner.job_parts import open_job
from jobrunner.parallel.launcher import config_from_json
from jobrunner.parallel.worker import SharedUnits, run_claimed, total_rows
from jobrunner.resolve import Resolved

log = logging.getLogger("jobrunner")

CLAIM_BATCH = 1         # tickets a worker draws at once (one more draw is always in flight); docs/RAY.md
REPORT_EVERY_S = 1.0    # a worker's progress to the queue actor; the stop flag comes back with it


class QueueClaim:
    """The work source: units 0 .. members-1 by slot, then tickets from the queue actor (ray_queue.py).
    A late worker (slot >= members) starts on tickets only."""

    def __init__(self, queue, r: int, worker: int, slot: int, members: int, batch: int = CLAIM_BATCH):
        self.queue, self.r, self.worker, self.slot, self.members, self.batch = queue, r, worker, slot, members, batch
        self.tickets: deque[int] = deque()
        self.ahead = None       # the next draw, already asked for: the actor's round trip hides behind a unit
        self.units = 0

    def claim(self, index: int) -> bool:
        import ray
        if index < self.members:
            mine = index == self.slot
        else:
            if not self.tickets:
                drawn = ray.get(self.ahead if self.ahead is not None else self._draw())
                self.ahead = self._draw()       # reserved for this worker: it reaches that unit (or the plan ends)
                self.tickets.extend(t + self.members for t in drawn)
            mine = self.tickets[0] == index     # held tickets are >= index: the plan is walked in order
            if mine:
                self.tickets.popleft()
        self.units += mine
        return mine

    __call__ = claim        # SharedUnits' `claim(index)`

    def _draw(self):
        return self.queue.next_tickets.remote(self.r, self.worker, self.batch)

    def complete(self) -> None:
        import ray
        ray.get(self.queue.done.remote(self.r, self.worker))


class QueueProgress:
    """Job's progress object: counts to the queue actor every REPORT_EVERY_S; once the driver asks to
    stop (a signal), sets the job's `stop` event: the job stops at its next step, keeping what is written."""

    def __init__(self, queue, r: int, worker: int, total: int | None, stop: threading.Event):
        self.queue, self.r, self.worker, self.total, self.stop = queue, r, worker, total, stop
        self.last = 0.0

    def update(self, stats, force: bool = False) -> None:
        import ray
        now = time.time()
        if force or now - self.last >= REPORT_EVERY_S:
            self.last = now
            counts = {"rows": stats.rows, "skipped": stats.rows_skipped, "failed": stats.rows_failed,
                      "tokens": stats.prompt_tokens + stats.completion_tokens, "total": self.total}
            if ray.get(self.queue.report.remote(self.r, self.worker, counts)):
                self.stop.set()

    def close(self) -> None:
        pass


class RayWorker:
    """Plain Python: the driver wraps it with ray.remote and the worker's resources. `rank` names the actor
    (its figures in _stats.json are `rank<rank>`); the part prefix follows the round's slot. `config` and
    `resolved`: the driver's JobConfig (launcher.config_to_json) and Resolved (Resolved.to_json)."""

    def __init__(self, config: str, resolved: str, rank: int, threads: int):
        from jobrunner.job_parts import load_engine
        if not logging.getLogger().handlers:
            logging.basicConfig(level=logging.INFO, stream=sys.stderr, datefmt="%H:%M:%S",
                                format=f"%(asctime)s worker {rank} %(levelname)s %(message)s")
        self.rank = rank
        cfg = config_from_json(config)
        # the driver alone prepares (and overwrites) the output; it shares the cores out
        self.cfg = replace(cfg, output=replace(cfg.output, overwrite=False),
                           engine=replace(cfg.engine, threads=threads))
        self.resolved = Resolved.from_json(resolved)
        self.engine, self.error = None, None
        try:
            self.engine = load_engine(self.cfg, self.resolved)
        except JobConfigError as e:
            self.error = str(e)

    def ready(self) -> dict:
        """The engine is loaded (or why not: a config error, exit 2). Answers once __init__ is done."""
        import ray
        ctx = ray.get_runtime_context()
        return {"rank": self.rank, "error": self.error, "pid": os.getpid(), "node": ctx.get_node_id(),
                "device": self.engine.info.device if self.engine is not None else None}

    def run_round(self, r: int, slot: int, members: int, world: int, queue, done_ids) -> dict:
        """One pass over the rows not in `done_ids` (the round's snapshot, the same for every member); the
        result payload is parallel.stats.merge_stats' record of this worker, plus its manifest."""
        cfg, engine = self.cfg, self.engine
        claim = QueueClaim(queue, r, self.rank, slot, members)
        work = SharedUnits(claim, slot, world, cfg.sampling.n * cfg.sampling.max_tokens)
        stop = threading.Event()
        payload = {"rank": self.rank, "slot": slot, "round": r, "device": engine.info.device,
                   "error": None, "manifest": None}
        try:
            # claim a unit only when the engine has room (max_in_flight); parts written since the round
            # opened are this round's own work, so the writer skips the snapshot's ids, not the parts'
            job = open_job(cfg, self.resolved, engine=engine, work=work, max_in_flight=engine.info.max_num_seqs,
                           progress=QueueProgress(queue, r, self.rank, total_rows(cfg, self.resolved), stop),
                           done_ids=done_ids, stop=stop)
        except JobConfigError as e:
            return {**payload, "exit_code": EXIT_CONFIG, "summary": None, "error": str(e), "config_error": True}
        payload["manifest"] = {k: v for k, v in job.manifest.items() if k != "config"}
        run_claimed(job, claim, payload)
        claim.complete()
        return payload

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()     # its tensor-parallel ranks, if any
