"""Row emitting: a row's result (from the engine, the result cache or the row it copies) or its error,
as output rows: the row's id and input columns, the kind's result columns, counted and written."""
from __future__ import annotations

from typing import TYPE_CHECKING

from jobrunner.output.columns import RUN_COLUMNS, input_names, reserved_columns

if TYPE_CHECKING:
    from jobrunner.cache.reuse import Reuse
    from jobrunner.common.run_stats import JobStats
    from jobrunner.jobs.kind import JobKind
    from jobrunner.pipeline.contracts import RowWriter


class Emitter:
    """Writes output rows through `writer` (a ResultWriter or a RowSink) and counts them in `stats`.
    `reuse` hands each finished leader's waiting copies on; `rank`: only rank 0 of a data-parallel job
    writes error rows (every worker reads the same rows); `fmt` "openai-batch": errors name their line."""

    def __init__(self, kind: JobKind, writer: RowWriter, stats: JobStats, reuse: Reuse, *, id_column: str, fmt: str,
                 rank: int = 0, speculative: bool = False):
        self.kind, self.writer, self.stats, self.reuse = kind, writer, stats, reuse
        self.id_column, self.fmt, self.rank = id_column, fmt, rank
        self.speculative = speculative      # rows say their drafted and accepted tokens (--speculative)
        self.reserved = reserved_columns(kind.result_columns)
        self.input_names: dict[tuple, dict[str, str]] = {}

    def finish(self, row, notes, out, from_cache: bool = False) -> None:
        """A leader's result (from the engine or the cache), and the same result for its waiting copies
        (each with its own notes)."""
        copies = self.reuse.finished(row.id, out, from_cache)
        self.output(row, notes, out, reused=from_cache)
        for copy, copy_notes in copies:
            self.output(copy, copy_notes, out, reused=True)

    def output(self, row, notes, out, reused: bool) -> None:
        """The row's output rows: its own columns and notes (a copy's, not its leader's) over `out`."""
        base = self._base(row)
        base.update(prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens, queue_s=out.queue_s,
                    prefill_s=out.prefill_s, decode_s=out.decode_s, error=out.error, reused=reused)
        if self.speculative:
            base.update(draft_tokens=out.draft_tokens, accepted_tokens=out.accepted_tokens)
        if reused:      # not computed here: no prefix-cache hits, no timings (null, not the original's)
            base.update(dict.fromkeys(RUN_COLUMNS))
        elif not out.computed:      # refused by the engine's checks: no step ran it, no timings (not computed)
            base.update(dict.fromkeys(("queue_s", "prefill_s", "decode_s")))
        rows = []
        for cols in self.kind.columns(out, row.data, row.options, notes):
            r = dict(base)
            r.update(cols)
            if r["error"] is None and r.get("finish_reason") == "error":     # every failed row says why
                r["error"] = "the row ended in an error that gave no message"
            if r["error"] is not None:
                r["finish_reason"] = "error"
            rows.append(r)
        self._write(rows)

    def error(self, row, message: str, prompt_tokens: int = 0) -> None:
        """An error row: the row never reached the engine. prompt_tokens: its prompt's, where it has one
        (a prompt over the context); its timings are then null, as an engine-refused row's (not computed)."""
        if self.rank != 0:
            return
        line = (row.data or {}).get("line") if self.fmt == "openai-batch" else None
        if line is not None and not message.startswith("line "):    # as the reader's own errors name it
            message = f"line {line}: {message}"
        r = self._base(row)
        timing = None if prompt_tokens else 0.0
        r.update(output=None, finish_reason="error", prompt_tokens=prompt_tokens, cached_tokens=0, completion_tokens=0,
                 queue_s=timing, prefill_s=timing, decode_s=timing, error=message, reused=False)
        self._write([r])

    def _base(self, row) -> dict:
        """The id and the row's input columns, renamed where a result column takes the name."""
        data = row.data or {}
        keys = tuple(k for k in data if k != self.id_column)
        names = self.input_names.get(keys)
        if names is None:       # JSONL rows may differ in their keys; most share one set
            names = self.input_names[keys] = input_names(keys, self.reserved)
        base = {"id": row.id if row.id_value is None else row.id_value}     # the id as the input types it
        base.update((names[k], data[k]) for k in keys)
        return base

    def _write(self, rows: list[dict]) -> None:
        self.stats.add_row(rows[0])
        for extra in rows[1:]:
            self.stats.add_sample(extra)
        self.writer.write(rows)
