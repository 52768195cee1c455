"""The faces a job's loop (jobrunner/pipeline/loop.py: Job) runs on, each with its implementations:

    RowWriter    where output rows go: output.ResultWriter (parquet parts in the output directory) or
                 output.RowSink (tables in memory: jobrunner.generate)
    WorkSource   which planned units this process runs: plan.AllUnits (one process: every unit),
                 parallel/worker.py's SharedUnits (a data-parallel worker: the units it claims),
                 parallel/ray_worker.py's QueueUnits (a Ray worker: the driver's shipped units)
    JobProgress  where the counts go while it runs: progress.Progress (a bar or log lines), a
                 data-parallel worker's _StoreProgress, a Ray worker's QueueProgress

A job kind's face is jobrunner.jobs.kind.JobKind (below the product: the output's schema reads it too).
Structural (typing.Protocol): an implementation names none of these; tests/test_contracts.py checks that
each one offers its face."""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from jobrunner.common.idset import IdSet
    from jobrunner.common.run_stats import JobStats
    from jobrunner.pipeline.pending import PendingRow, ShippedUnit
    from jobrunner.planner import WorkUnit


@runtime_checkable
class RowWriter(Protocol):
    """Takes a job's output rows (Emitter.write) and says which rows earlier runs finished (the intake
    skips them). Rows of one write() call stay together; flush() makes what is written durable (a
    kill loses nothing before it); close() ends the writing."""

    @property
    def done_ids(self) -> IdSet: ...          # rows written with a result (skipped on resume)

    @property
    def failed_ids(self) -> IdSet: ...        # rows written as errors (run again)

    @property
    def done_repeats(self) -> IdSet: ...      # ids written more than once (a dataset's repeated id)

    def write(self, rows: list[dict]) -> None: ...

    def maybe_flush(self) -> None:
        """Flush if the oldest buffered row waited long enough (the loop asks after every engine step)."""
        ...

    def flush(self) -> None: ...

    def close(self, stats: dict | None = None) -> None: ...

    def write_stats(self, stats: Mapping[str, Any]) -> None: ...


@runtime_checkable
class WorkSource(Protocol):
    """Which units this process runs. `units` gets the planner's units (WorkUnits over the job's
    pending rows; a Ray worker's planner has none: its units come shipped), the pending rows and the
    writer, and yields (unit, whether this process runs it); (None, False): a remote source has
    nothing yet, and the loop steps its engine meanwhile. A unit not run here is dropped from the
    pending rows. The source names its parts' prefix and says whether a result-cache hit is written
    at once (`hits_now`) or waits for the worker that claims its unit."""
    rank: int
    world: int

    @property
    def part_prefix(self) -> str: ...

    @property
    def hits_now(self) -> bool: ...

    def units(self, units: Iterable[WorkUnit], pending: dict[str, PendingRow],
              writer: RowWriter) -> Iterator[tuple[WorkUnit | ShippedUnit | None, bool]]: ...


@runtime_checkable
class JobProgress(Protocol):
    """Where a running job's counts go (the loop calls update after each step and while it idles)."""

    def update(self, stats: JobStats) -> None: ...

    def close(self) -> None: ...
