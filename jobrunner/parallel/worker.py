"""A worker: one engine, loaded once, running the rounds its coordinator opens.

In a round every member plans the rows not yet in the output into the same units (the `ready`
barrier makes all read the done ids first) and claims units as its engine has room for them, so a
fast worker takes more and all finish within about one engine queue of each other.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
import logging
import signal
import time
from dataclasses import dataclass, replace

from jobrunner.engine import EngineFailure
from jobrunner.config.job import JobConfig, JobConfigError
from jobrunner.dataset import rows_to_read
from jobrunner.pipeline.exit_codes import EXIT_CONFIG, EXIT_FAILED, EXIT_STORAGE
from jobrunner.pipeline import build      # build.load_engine, read at each call (tests replace it)
from jobrunner.pipeline.build import open_job
from jobrunner.pipeline.resolve import Resolved
from jobrunner.parallel import protocol
from jobrunner.parallel.protocol import Stop
from jobrunner.planner import WorkUnit, spread_units
from jobrunner.pipeline.contracts import RowWriter
from jobrunner.pipeline.pending import PendingRow
from jobrunner.parallel.merged_stats import worker_sketch
from jobrunner.common.signal_interrupt import SignalInterrupt

log = logging.getLogger("jobrunner")


def worker_config(cfg: JobConfig, threads: int | None) -> JobConfig:
    """cfg as a worker runs it: the coordinator (or the Ray driver) alone prepares, and overwrites, the
    output; the launcher shares the cores out (`threads` for its engine; None: cfg's)."""
    return replace(cfg, output=replace(cfg.output, overwrite=False),
                   engine=replace(cfg.engine, threads=threads or cfg.engine.threads))


def worker_loop(cfg: JobConfig, resolved: Resolved, rank: int, world: int, store, threads: int | None = None,
                before_exit=lambda: None) -> int:
    """One worker: load the engine once, then run rounds as the coordinator opens them. Returns an exit code.
    `resolved`: the launcher's (or this torchrun rank's) jobrunner.job.resolve, shared by every round.
    `before_exit()` runs just before the worker acknowledges the end (`exited`), after which the store may go:
    it stops the process's other users of the store."""
    stop: list = []

    def on_signal(signum, frame):   # between rounds; Job.run has its own handlers while it runs
        if stop:
            raise SignalInterrupt
        stop.append(signum)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, on_signal)
    cfg = worker_config(cfg, threads)
    try:
        engine = build.load_engine(cfg, resolved)
    except JobConfigError as e:
        protocol.set_loaded(store, rank, error=str(e))
        return EXIT_CONFIG
    protocol.set_loaded(store, rank, device=engine.info.device)
    try:
        for r in itertools.count():
            rnd = protocol.wait_round(store, r, stop)
            if rnd.slots is None or rank not in rnd.slots:
                before_exit()
                protocol.ack_exit(store)
                return rnd.exit_code
            _run_round(cfg, resolved, engine, store, r, rank, rnd.slots[rank], world, stop, members=len(rnd.slots))
    except Stop as e:
        return e.args[0]
    except EngineFailure as e:
        # A rank of this worker's tensor-parallel engine died. The rows it finished are written (Job.run
        # flushed them); this worker leaves without a result, as a dead one would, so that the coordinator
        # counts it lost and (launcher mode) hands the rows it had not written to the workers left.
        log.error("worker %d stops: %s", rank, e)
        return EXIT_FAILED
    finally:
        engine.close()          # its tensor-parallel ranks, if any


@dataclass(frozen=True)
class SharedUnits:
    """A data-parallel worker's work source: each planning window's units are spread over the workers,
    then come out largest first, each claimed or not (`claim(index)`).

    A window of fewer units than workers (a small job sharing one prefix is one unit) would leave
    workers idle, so its largest units are halved until each worker can get one (spread_units); each
    worker then computes the shared prefix once. The planner orders units for cache locality (a
    depth-first trie walk), so a big prefix group can come last, and whoever draws it finishes long
    after the others. Handing the units out longest first (LPT) lets the small ones fill in around the
    big ones. Across workers the locality is lost anyway; within a unit nothing changes. Both steps are
    deterministic, so every worker agrees on the units and their order.
    """
    claim: Callable[[int], bool]    # index -> whether this worker runs the unit (_Claim)
    rank: int
    world: int
    out_tokens: int         # tokens a row generates at most: n * max_tokens
    hits_now = False        # a result-cache hit waits in the plan for the worker that claims its unit

    @property
    def part_prefix(self) -> str:
        return f"part-r{self.rank}"

    def units(self, units: Iterable[WorkUnit], pending: dict[str, PendingRow],
              writer: RowWriter) -> Iterator[tuple[WorkUnit, bool]]:
        index = 0
        for batch in spread_windows(units, self.world, lambda key: pending[key].tokens, self.out_tokens):
            for unit in batch:
                yield unit, self.claim(index)
                index += 1


def spread_windows(units, world: int, tokens_of, out_tokens: int):
    """Each planning window's units (a window's rows all wait in the job's pending rows, token ids packed:
    none is submitted yet), spread over `world` workers, largest first (SharedUnits)."""
    def cost(u) -> int:
        """Tokens the engine computes for a unit: the shared prefix once, the rest, the outputs. Sorted
        by it, stable: ties keep the planner's order."""
        n = len(u.items)
        return u.prompt_tokens - u.shared_prefix_len * (n - 1) + n * out_tokens

    def spread(window):
        return sorted(spread_units(window, world, tokens_of, cost), key=cost, reverse=True)
    window = []
    for unit in units:
        window.append(unit)
        if unit.window_end:
            yield spread(window)
            window = []
    yield spread(window)


def _run_round(cfg, resolved, engine, store, r: int, rank: int, slot: int, world: int, stop: list,
               members: int) -> None:
    claim = _Claim(store, r, slot, members)     # members: this round's workers
    work = SharedUnits(claim, slot, world, cfg.sampling.n * cfg.sampling.max_tokens)
    try:
        # claim a unit only when the engine has room (max_in_flight): dynamic balance
        job = open_job(cfg, resolved, engine=engine, work=work, max_in_flight=engine.info.max_num_seqs,
                       progress=_StoreProgress(store, r, rank, rows_to_read(cfg.input, resolved.fmt)))
    except JobConfigError as e:
        protocol.set_ready(store, r, rank, error=str(e))
        raise Stop(EXIT_CONFIG) from None
    protocol.set_ready(store, r, rank, manifest=job.manifest)
    protocol.wait_go(store, r, stop)
    payload = {"rank": rank, "slot": slot, "round": r, "device": engine.info.device, "error": None}
    protocol.set_result(store, r, rank, run_claimed(job, payload, lambda: claim.units))


class _Claim:
    """Job's claim(index). Unit i < world goes to slot i, so every worker starts with a unit (the
    counter alone would let the first worker take them all while the others start up). Past those,
    indices come in order world, world + 1, ...; a ticket drawn from the counter is the next unit
    nobody holds. Every index is drawn by exactly one worker, and that worker reaches it, because all
    workers walk the same plan in the same order."""

    def __init__(self, store, r: int, slot: int = 0, world: int = 1):
        self.store, self.r, self.slot, self.world = store, r, slot, world
        self.ticket: int | None = None
        self.units = 0

    def __call__(self, index: int) -> bool:
        if index < self.world:
            return self._take(index == self.slot)
        while self.ticket is None or self.ticket < index:
            self.ticket = protocol.next_ticket(self.store, self.r) + self.world
        if self.ticket > index:
            return False
        self.ticket = None
        return self._take(True)

    def _take(self, mine: bool) -> bool:
        self.units += mine
        return mine


class _StoreProgress:
    """Job's progress object for a worker: publishes its counts for the coordinator's progress line."""

    def __init__(self, store, r: int, rank: int, total: int | None, every_s: float = 1.0):
        self.store, self.r, self.rank, self.total, self.every_s = store, r, rank, total, every_s
        self.last = 0.0

    def update(self, stats, force: bool = False) -> None:
        now = time.time()
        if force or now - self.last >= self.every_s:
            self.last = now
            protocol.set_progress(self.store, self.r, self.rank, stats, self.total)

    def close(self) -> None:
        pass


def run_claimed(job, payload: dict, units_of) -> dict:
    """Runs a worker's job over the units it claims; payload gains its exit code, summary, units, seconds
    and the sketch of its rows' figures (a storage failure: EXIT_STORAGE and the error, no summary)."""
    t0 = time.time()
    try:
        result = job.run()
        payload.update(exit_code=result.exit_code, summary=result.stats)
    except OSError as e:
        log.error("writing the output failed: %s", e)
        payload.update(exit_code=EXIT_STORAGE, summary=None, error=str(e))
    payload.update(units=units_of(), run_s=time.time() - t0, sketch=worker_sketch(job.stats))
    return payload
