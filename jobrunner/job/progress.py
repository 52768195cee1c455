"""Progress: a tqdm bar with rows, tokens/s and ETA on a terminal; plain log lines otherwise."""
from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("jobrunner")
LOG_EVERY_S = 30.0


class Progress:
    """tokens/s counts every token the engine computes as it computes it (`counters`: the engine's
    `counters()`, a snapshot of its EngineCounters; a long prompt's prefill shows before its row ends),
    else finished rows' tokens."""

    def __init__(self, total: int | None, counters=None):
        self.total = total
        self.counters = counters
        self.computed_before = counters().tokens_computed if counters is not None else 0   # an engine serves many jobs
        self.bar = None
        self.last_log = time.time()
        self.start = time.time()
        if sys.stderr.isatty():
            from tqdm import tqdm       # tqdm loads only for a terminal's bar (tens of ms)
            self.bar = tqdm(total=total, unit="row", dynamic_ncols=True)

    def update(self, stats) -> None:
        done = stats.rows + stats.rows_skipped
        failed = stats.rows_failed + stats.rows_skipped_failed     # the done rows count as the summary counts them
        tokens = stats.prompt_tokens + stats.completion_tokens
        if self.counters is not None:
            tokens = self.counters().tokens_computed - self.computed_before
        elapsed = max(time.time() - self.start, 1e-9)
        if self.bar is not None:
            self.bar.n = done
            self.bar.set_postfix_str(f"{tokens / elapsed:,.0f} tok/s, {failed} errors", refresh=False)
            self.bar.refresh()
        elif time.time() - self.last_log >= LOG_EVERY_S:
            self.last_log = time.time()
            of = f"/{self.total}" if self.total else ""
            log.info("%d%s rows, %d failed, %.0f tokens/s", done, of, failed, tokens / elapsed)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
