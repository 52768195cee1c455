"""The job's loop: take units from the work source, submit their rows, step the engine, hand finished
rows to the emitter, end.

Every row read ends as exactly one output row (n > 1: one per sample), with its output or its error.
Rows already in the output are skipped, so running the same job again resumes it.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from typing import TYPE_CHECKING

from jobrunner.engine import NUMERICS_VERSION, EngineCounters, EngineFailure
from jobrunner.pipeline.ending import JobResult, verdict, write_ending
from jobrunner.pipeline.exit_codes import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK
from jobrunner.pipeline.pending import Interrupted, PendingRow, ShippedUnit
from jobrunner.common.threads import FixedThreads
from jobrunner.common.signal_interrupt import SignalInterrupt

if TYPE_CHECKING:
    from jobrunner.engine import Engine, EngineInfo
    from jobrunner.common.run_stats import JobStats
    from jobrunner.common.threads import ThreadGovernor
    from jobrunner.config.sections import OutputOptions, ParallelOptions
    from jobrunner.pipeline.build import JobParts
    from jobrunner.pipeline.contracts import JobProgress, WorkSource
    from jobrunner.pipeline.plan import JobPlanner

log = logging.getLogger("jobrunner")

IDLE_S = 0.005          # a remote work source with nothing yet and an idle engine: the wait between looks


class Job:
    """One worker's share of a job, built whole from its parts (jobrunner/pipeline/build.py: open_job). Its
    work source says which units it runs: alone (world 1) every one; in a data-parallel job every worker
    reads and plans the same dataset identically, runs only the units its work source claims, and writes
    its own parts; only rank 0 writes rows that never reach the planner."""

    def __init__(self, parts: JobParts, *, engine: Engine, work: WorkSource, progress: JobProgress,
                 stop: threading.Event, max_in_flight: int | None = None,
                 threads: ThreadGovernor | FixedThreads | None = None):
        self.parts = parts
        self.intake, self.emit, self.planner = parts.intake, parts.emit, parts.planner
        self.reuse, self.writer, self.stats = parts.reuse, parts.writer, parts.stats
        self.engine, self.work, self.progress = engine, work, progress
        self.threads = threads or FixedThreads()     # the CPU threads, following the machine's load or fixed
        # requests queued in the engine ahead of it
        self.max_in_flight = max_in_flight or max(2 * engine.info.max_num_seqs, 64)
        self.pending: dict[str, PendingRow] = {}    # row id -> its PendingRow, while in the planner or the engine
        self.stop = stop            # a signal asked the job to stop: the intake reads it too
        self.counters_before = engine.counters()   # an engine may serve several jobs

    @property
    def manifest(self) -> dict:
        return self.parts.manifest

    def run(self) -> JobResult:
        lost = None
        try:
            interrupted = self._run_units()
        except EngineFailure as e:          # a tensor-parallel rank died: the engine is gone, its rows with it
            lost, interrupted = e, False
        finally:
            self.reuse.close()
        self.writer.flush()                 # the rows that did finish are kept: a rerun skips them
        self.progress.close()
        if lost is not None and self.work.world > 1:
            raise lost      # its process ends; the coordinator hands the rows it had not written to the workers left
        parts = self.parts
        run = run_record(self.stats, self.planner, self.engine.info, self.engine.counters() - self.counters_before,
                         parts.parallel, parts.output, interrupted)
        if self.work.world > 1:     # a data-parallel worker: its coordinator sums the runs and marks the job complete
            if not interrupted:
                self.writer.close()
            return JobResult(EXIT_INTERRUPTED if interrupted else EXIT_OK, run, parts.output_url)
        return self._end(run, interrupted, lost)

    def _end(self, run: dict, interrupted: bool, lost: Exception | None) -> JobResult:
        """The whole output's summary, its ending written, the exit code. A lost engine (EngineFailure)
        keeps the rows written so far: EXIT_FAILED, and the result's `error` says why (the CLI prints it)."""
        parts, in_memory = self.parts, self.parts.in_memory
        url = parts.output_url
        summary = parts.summary(run)
        self.writer.close()
        if not in_memory:
            write_ending(parts.output, url, summary, self.writer.manifest, complete=not (interrupted or lost),
                         interrupted=interrupted)
        if lost is not None:
            rows = self.stats.rows
            message = (f"{lost}; the {rows} row{'s' if rows != 1 else ''} this run finished "
                       f"{'are' if rows != 1 else 'is'} written and kept: run the same command again to resume")
            return JobResult(EXIT_FAILED, summary, url, error=message)
        if interrupted:
            return JobResult(EXIT_INTERRUPTED, summary, url)
        code, why = verdict(parts.input, parts.output, url, summary, self.stats.rows,
                            read_any=bool(self.stats.rows or self.stats.rows_skipped),
                            where="the results" if in_memory else None)
        return JobResult(code, summary, url, error=why)

    def _run_units(self) -> bool:
        """Submit the units this worker claims and step the engine until all are done; True if interrupted."""
        engine = self.engine
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            units = self.planner.plan(self.intake.rows(), self.pending)
            for unit, mine in self.work.units(units, self.pending, self.writer):
                if unit is None:        # a remote work source has nothing yet: run what is in flight
                    self._idle()
                    continue
                if not mine:
                    for key in unit.items:
                        del self.pending[key]
                        self.reuse.drop(key)
                    continue
                if isinstance(unit, ShippedUnit):
                    self._adopt(unit)
                cached = self.reuse.take(unit.items)     # data-parallel: hits held for the claiming worker
                for key in unit.items:
                    if key in cached:
                        p = self.pending.pop(key)
                        self.emit.finish(p.row, p.notes, cached[key], from_cache=True)
                    else:
                        engine.add_request(self.pending[key].engine_request())
                while engine.num_in_flight >= self.max_in_flight:
                    self._step()
            while engine.has_unfinished():
                self._step()
        except Interrupted:
            return True
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        return False

    def _adopt(self, unit: ShippedUnit) -> None:
        """A shipped unit's rows become this job's, as the driver made them; its copies wait for their
        leader's result."""
        for p in unit.rows:
            self.reuse.adopt(p, unit.copies.get(p.id, ()))
            self.pending[p.id] = p

    def _idle(self) -> None:
        if self.engine.has_unfinished():
            self._step()
        else:
            if self.stop.is_set():
                raise Interrupted
            self.progress.update(self.stats)
            time.sleep(IDLE_S)

    def _step(self) -> None:
        if self.stop.is_set():
            raise Interrupted
        for out in self.engine.step():
            p = self.pending.pop(out.id)
            self.emit.finish(p.row, p.notes, out)
        self.writer.maybe_flush()       # rows that finished a while ago reach a part even when few come
        self.progress.update(self.stats)
        self.threads.tick()

    def _on_signal(self, signum, frame):
        if self.stop.is_set():          # a second Ctrl-C: stop at once
            raise SignalInterrupt
        self.stop.set()
        log.warning("signal %d: finishing what is written, then exiting", signum)


def run_record(stats: JobStats, planner: JobPlanner, info: EngineInfo, counters: EngineCounters,
               parallel: ParallelOptions, output: OutputOptions, interrupted: bool) -> dict:
    """This run's own figures (time, throughput, engine counters, cost) on an engine of `info` (a Ray
    driver's: a worker's, its counters none); whether it was batch-invariant (--deterministic) and by which
    version of the engine's numeric path."""
    record = stats.summary(
        device=info.device, devices=parallel.tensor_parallel, model_weight_bytes=info.weight_bytes,
        quantization=info.quantization, prefix=planner.prefix,      # as it runs: auto resolved, a checkpoint's own
        engine_counters=counters.as_dict(), device_hourly_cost=output.device_hourly_cost,
        load_s=info.load_s, interrupted=interrupted)
    return {**record, "batch_invariant": info.batch_invariant, "numerics_version": NUMERICS_VERSION}
