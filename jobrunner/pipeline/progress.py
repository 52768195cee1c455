"""Progress: a tqdm bar with rows, tokens/s and ETA on a terminal; plain log lines otherwise (a cron or
Airflow log): rows done of the total with the percentage, the rows in flight (started, not finished), and
an ETA from this run's rate of finished rows."""
from __future__ import annotations

import logging
import sys
import time

from jobrunner.common.durations import duration

log = logging.getLogger("jobrunner")
LOG_EVERY_S = 30.0
TERMINAL_DATEFMT, PLAIN_DATEFMT = "%H:%M:%S", "%Y-%m-%d %H:%M:%S"


def log_datefmt(stream=None) -> str:
    """The log lines' time: the time of day on a terminal, the date too in a file (nights appended to one
    log told apart)."""
    stream = sys.stderr if stream is None else stream
    return TERMINAL_DATEFMT if getattr(stream, "isatty", lambda: False)() else PLAIN_DATEFMT


class Progress:
    """tokens/s counts every token the engine computes as it computes it (`counters`: the engine's
    `counters()`, a snapshot of its EngineCounters; a long prompt's prefill shows before its row ends),
    else finished rows' tokens. in_flight: the rows the engine holds now (started, not finished)."""

    def __init__(self, total: int | None, counters=None, in_flight=None):
        self.total = total
        self.counters = counters
        self.in_flight = in_flight
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
            in_flight = self.in_flight() if self.in_flight is not None else None
            log.info("%s", progress_line(done, self.total, stats.rows, elapsed, failed=failed,
                                         tokens_per_s=tokens / elapsed, in_flight=in_flight))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def progress_line(done: int, total: int | None, computed: int, elapsed: float, *, failed: int,
                  tokens_per_s: float, in_flight: int | None = None, more: str = "") -> str:
    """One plain progress line: "120/300 rows (40.0%), 64 in flight, 2 failed, 512 tokens/s, ETA 45 s".
    done: the rows finished, those an earlier run wrote included; computed: those this run finished in
    `elapsed` seconds, whose rate gives the ETA; in_flight: rows started and not finished (None: not known);
    more: what else the caller shows, before the ETA."""
    parts = [f"{done:,}/{total:,} rows ({done / total:.1%})" if total else f"{done:,} rows"]
    if in_flight is not None:
        parts.append(f"{in_flight:,} in flight")
    parts += [f"{failed:,} failed", f"{tokens_per_s:,.0f} tokens/s"] + ([more] if more else [])
    if total:
        left = max(total - done, 0)
        parts.append(f"ETA {duration(round(left * elapsed / computed))}" if computed else "ETA once the first rows finish")
    return ", ".join(parts)


