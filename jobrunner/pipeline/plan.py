"""Which units a job runs, in which order: the job's planner over its pending rows, and the work
source of a job in one process (every unit). A data-parallel worker's work source is
jobrunner/parallel/worker.py's SharedUnits, a Ray worker's parallel/ray_worker.py's QueueUnits."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jobrunner.config.lora import LoraOptions
from jobrunner.planner import PlanItem, PrefixStats, WorkUnit, plan, prefix_stats
from jobrunner.planner.window import split_windows

if TYPE_CHECKING:
    from jobrunner.pipeline.contracts import RowWriter
    from jobrunner.pipeline.pending import PendingRow

# A planning window: rows read, tokenized and ordered together. Rows bound it for usual prompts
# (~80 MB at 50,000 rows); tokens bound it for long ones (~8 bytes a token while a row waits:
# its encoding for the planner and its packed token ids; ~0.5 GB at 64M tokens).
WINDOW_ROWS = 50_000
WINDOW_TOKENS = 64_000_000


@dataclass
class JobPlanner:
    """PendingRows -> work units: ordered so shared prefixes run back to back (--plan), or in dataset
    order; either way the prefix figures of each window are measured into `prefix`."""
    ordered: bool
    block_size: int
    lora: LoraOptions = LoraOptions()      # its adapters' rows are grouped, each apart (LoraOptions.plan_tokens)
    prefix: PrefixStats = field(init=False)

    def __post_init__(self):
        self.prefix = PrefixStats(block_size=self.block_size)

    def plan(self, rows, pending: dict):
        """The units of `rows` (PendingRows); each row waits in `pending` (id -> row) from the moment it
        enters the plan until its unit's runner takes it."""
        def items():
            for p in rows:
                pending[p.id] = p
                yield self.item(p.id, p.request.adapter, p.tokens)     # packed ids: the planner encodes them as such
        return self.units(items())

    def item(self, key, adapter: str | None, tokens) -> PlanItem:
        """A row's plan item: its tokens, after its LoRA adapter's mark."""
        return PlanItem(key, self.lora.plan_tokens(adapter, tokens))

    def units(self, items):
        if self.ordered:
            yield from plan(items, window_rows=WINDOW_ROWS, block_size=self.block_size, stats=self.prefix,
                            window_tokens=WINDOW_TOKENS)
            return
        for window in split_windows(items, WINDOW_ROWS, WINDOW_TOKENS, lambda it: len(it.tokens)):
            self.prefix.merge(prefix_stats([it.tokens for it in window], block_size=self.block_size))
            for i, it in enumerate(window, 1):
                yield WorkUnit([it.key], len(it.tokens), len(it.tokens), window_end=i == len(window))


class AllUnits:
    """The work source of a job in one process: every unit, in the planner's order; a result-cache hit
    is written as soon as it is found. A work source names its parts' prefix; `units` gets the planner's
    units, the job's pending rows and its writer, and yields (unit, whether this worker runs it): a
    contracts.WorkSource."""
    rank, world, part_prefix, hits_now = 0, 1, "part", True

    def units(self, units: Iterable[WorkUnit], pending: dict[str, PendingRow],
              writer: RowWriter) -> Iterator[tuple[WorkUnit, bool]]:
        for unit in units:
            yield unit, True
