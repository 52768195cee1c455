"""A Ray job's worker: an actor with one engine, loaded once, running the units its driver planned.

A run is a data-parallel worker's Job (job.build.open_job) whose work source is QueueUnits: bundles
of planned units (job.pending.ShippedUnit: rows as the driver made them, copies) fetched from the object store by the
refs the queue actor (ray_queue.py) hands out, as the engine has room. Nothing is read or planned
here. Its progress goes to the queue too (QueueProgress), with the bundles whose rows are all in its
parts, which the queue then forgets (a lost worker's other bundles go back to the queue). Parts are
written with the usual atomic protocol under the run's prefix (`part-r<slot>`), so the output is a
local run's. The config and jobrunner.job.resolve's Resolved are the driver's, as JSON (as the
data-parallel launcher passes them): resolved once per job. This module imports Ray: the driver imports it
once connected (ray_driver.RayDriver.start_workers), and an actor's process to unpickle the class.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import ray
from ray.actor import ActorHandle

from jobrunner import engine
from jobrunner.engine import cache_root
from jobrunner.config.job import JobConfigError
from jobrunner.dataset import DatasetError
from jobrunner.common.idset import IdSet
from jobrunner.pipeline.exit_codes import EXIT_CONFIG
from jobrunner.pipeline.progress import log_datefmt
from jobrunner.pipeline import build
from jobrunner.pipeline.build import open_job
from jobrunner.parallel.launcher import config_from_json
from jobrunner.parallel.worker import run_claimed, worker_config
from jobrunner.pipeline.resolve import Resolved
from jobrunner.pipeline.pending import PendingRow, ShippedUnit
from jobrunner.planner import WorkUnit
from jobrunner.output import ResultWriter

log = logging.getLogger("jobrunner")

REPORT_EVERY_S = 1.0    # a worker's progress to the queue actor; the stop flag comes back with it
WAIT_S = 1.0            # the queue actor holds an ask this long while it is empty (docs/RAY.md: the queue's calls)


@dataclass
class QueueUnits:
    """The work source: the queue's bundles, in the order handed out; the next ask is always in flight
    (its round trip hides behind a bundle). The job's pending rows and writer, which it hands in with
    the plan, tell which bundles are written (`written`)."""
    queue: ActorHandle      # the WorkQueue actor (ray_queue.py)
    rank: int               # the run's slot: its parts' prefix
    world: int
    hits_now = False        # the driver wrote the hits
    pending: dict[str, PendingRow] = field(default_factory=dict)
    writer: ResultWriter | None = None      # the Job's (a Ray worker writes parts), handed in with the plan
    ran: list[int] = field(default_factory=list)        # bundles taken, in order
    running: dict[int, list[str]] = field(default_factory=dict)     # bundle -> leader ids, rows not all done
    finished: dict[int, int] = field(default_factory=dict)          # bundle -> parts the writer had then
    count: int = 0          # units taken

    @property
    def part_prefix(self) -> str:
        return f"part-r{self.rank}"

    def units(self, units: Iterable[WorkUnit], pending: dict[str, PendingRow],
              writer: ResultWriter) -> Iterator[tuple[ShippedUnit | None, bool]]:
        self.pending, self.writer = pending, writer
        ask = self.queue.next.remote(self.rank, WAIT_S)
        while True:
            if not ray.wait([ask], timeout=0)[0]:
                yield None, False       # the answer is not here yet: the Job steps its engine meanwhile
                continue
            reply = ray.get(ask)
            if reply is None:
                return
            ask = self.queue.next.remote(self.rank, WAIT_S)
            if reply == "wait":
                continue
            seq, (ref,) = reply
            yield from self.hand_out(seq, ray.get(ref))

    def hand_out(self, seq: int, bundle: list[ShippedUnit]) -> Iterator[tuple[ShippedUnit, bool]]:
        """A bundle's units to the Job one by one, as its engine has room. Its rows count as running only
        once its last unit is the Job's (the Job adopts a unit as it gets it): before, a later unit's rows
        are in no pending set, and the bundle would be confirmed written while they were never run."""
        self.ran.append(seq)
        self.count += len(bundle)
        for i, unit in enumerate(bundle):
            if i == len(bundle) - 1:
                self.running[seq] = [p.id for u in bundle for p in u.rows]
            yield unit, True

    def written(self) -> list[int]:
        """Bundles whose rows are all in parts (a unit's copies are written with its leader): those
        finished while the writer held nothing, or before a part it has written since."""
        pending, writer = self.pending, self.writer
        parts, empty = len(writer.parts), writer.buffered == 0
        for seq, ids in list(self.running.items()):
            if not any(i in pending for i in ids):
                self.finished[seq] = parts
                del self.running[seq]
        done = [s for s, p in self.finished.items() if empty or parts > p]
        for s in done:
            del self.finished[s]
        return done


class QueueProgress:
    """Job's progress object: counts and written bundles to the queue actor every REPORT_EVERY_S; once
    the driver asks to stop (a signal), sets the job's `stop` event: it stops at its next step."""

    def __init__(self, queue, work: QueueUnits, stop: threading.Event):
        self.queue, self.work, self.stop = queue, work, stop
        self.last = 0.0

    def update(self, stats, force: bool = False) -> None:
        now = time.time()
        if force or now - self.last >= REPORT_EVERY_S:
            self.last = now
            counts = {"rows": stats.rows, "failed": stats.rows_failed,
                      "tokens": stats.prompt_tokens + stats.completion_tokens}
            if ray.get(self.queue.report.remote(self.work.rank, counts, self.work.written())):
                self.stop.set()

    def close(self) -> None:
        pass


class RayWorker:
    """Plain Python: the driver wraps it with ray.remote and the worker's resources. `rank` names the actor
    (its figures in _stats.json are `rank<rank>`); each run's slot names its parts. load's `config` and
    `resolved`: the driver's JobConfig (launcher.config_to_json) and Resolved (Resolved.to_json)."""

    def __init__(self, rank: int):
        engine.Engine           # torch and the engine's modules, while the driver checks the job
        if not logging.getLogger().handlers:
            logging.basicConfig(level=logging.INFO, stream=sys.stderr, datefmt=log_datefmt(),
                                format=f"%(asctime)s worker {rank} %(levelname)s %(message)s")
        self.rank = rank
        self.engine = None

    def load(self, config: str, resolved: str, threads: int, fingerprint: str) -> dict:
        """Loads the engine; returns where (or why not: a config error, exit 2). fingerprint: the output's
        (the driver's, JSON: its paths as given, where config's are made absolute for this process)."""
        cfg = config_from_json(config)
        self.cfg = worker_config(cfg, threads)       # the driver shares the cores out
        self.resolved = Resolved.from_json(resolved)
        self.fingerprint = json.loads(fingerprint)
        error = None
        try:
            self.engine = build.load_engine(self.cfg, self.resolved)
        except JobConfigError as e:
            error = str(e)
        return {"rank": self.rank, "error": error, "pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
                "device": self.engine.info.device if self.engine is not None else None, "cache": str(cache_root())}

    def face(self):
        """What the driver plans with: this engine's (info, tokenizer, config)."""
        return self.engine.info, self.engine.tokenizer, self.engine.config

    def run(self, run: int, slot: int, world: int, queue) -> dict:
        """Runs bundles from the queue until it ends; the result payload is parallel.stats.merge_stats'
        record of this run."""
        cfg, engine = self.cfg, self.engine
        work = QueueUnits(queue, slot, world)
        stop = threading.Event()
        payload = {"rank": self.rank, "slot": slot, "round": run, "device": engine.info.device, "error": None}
        try:
            # the driver read the done ids and planned the rest: no part's ids are read here
            job = open_job(cfg, self.resolved, engine=engine, work=work, max_in_flight=engine.info.max_num_seqs,
                           progress=QueueProgress(queue, work, stop), done_ids=IdSet(), stop=stop, reader=list,
                           fingerprint=self.fingerprint)
        except (JobConfigError, DatasetError) as e:      # the dataset as the driver read it, not found here
            return {**payload, "exit_code": EXIT_CONFIG, "summary": None, "error": f"ray: worker {self.rank}: {e}",
                    "config_error": True}
        run_claimed(job, payload, lambda: work.count)
        ray.get(queue.leave.remote(slot, work.ran))     # its parts are closed: every bundle it ran is written
        return payload

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()     # its tensor-parallel ranks, if any
