"""RowSink: a job's result rows kept in memory (jobrunner.generate), with a ResultWriter's face and no
files: no output directory, no manifest, no _stats.json.

Invariants, as ResultWriter's parts keep them:
- Rows of one write() call land in the same table; a table is made of part_rows rows at most
  (values.to_table under the pinned schema: the job's declared one, else the first table's, from
  its rows), so `table()` is what reading back the parts of the same rows would give
  (readers.read_results: the tables concatenated in order).
- Nothing was done before: done_ids is empty (a generate call runs every row it is given).
- Asked to (`keep_rows`), it also keeps each row as written, its values as the kind made them (a
  list stays a list, not a table's JSON text): the tables are made all the same (the job's summary).
"""
from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa

from jobrunner.common.idset import IdSet
from jobrunner.output.values import FIXED_COLUMNS, arrow_schema, infer_kinds, kinds_of, norm_row, to_table

__all__ = ["RowSink"]


class RowSink:
    in_memory = True            # Job: its summary is summed over these tables, no output directory

    def __init__(self, schema: pa.Schema | None = None, part_rows: int = 10000):
        assert schema is None or kinds_of(schema) is not None, "a declared schema records its kinds"
        self.schema, self.part_rows = schema, part_rows
        self.done_ids = self.failed_ids = self.done_repeats = IdSet()   # nothing done before: rows in memory start anew
        self._tables: list[pa.Table] = []
        self._buffer: list[dict] = []
        self._kept: list[dict] | None = None      # the rows as written, once keep_rows() asked for them

    def keep_rows(self) -> list[dict]:
        """From now on every row written is also kept as written: the list they are appended to, in the
        order they are written (EngineSession.run_rows: results as values, no table read back)."""
        if self._kept is None:
            self._kept = []
        return self._kept

    def write(self, rows: list[dict]) -> None:
        self._buffer.extend(norm_row(r) for r in rows)
        if self._kept is not None:
            self._kept.extend(rows)
        if len(self._buffer) >= self.part_rows:
            self.flush()

    def maybe_flush(self) -> None:
        """Nothing to do: no kill can lose rows that are in memory only."""

    def flush(self) -> None:
        if not self._buffer:
            return
        if self.schema is None:
            self.schema = arrow_schema(infer_kinds(self._buffer))
        self._tables.append(to_table(self._buffer, self.schema))
        self._buffer = []

    def close(self, stats: dict | None = None) -> None:
        self.flush()

    def write_stats(self, stats: dict) -> None:
        """Nothing to write: the summary is the caller's (JobResult.stats)."""

    def tables(self, columns: Callable[[list[str]], list[str]] | None = None) -> list[pa.Table]:
        """The tables so far, with the columns asked for that they have (all: None)."""
        self.flush()
        if columns is None:
            return list(self._tables)
        return [t.select([c for c in t.column_names if c in set(columns(t.column_names))]) for t in self._tables]

    def table(self) -> pa.Table:
        """Every row as one table (empty: the fixed columns), as read_results reads parts."""
        tables = self.tables()
        if not tables:
            return arrow_schema(dict(FIXED_COLUMNS)).empty_table()
        return pa.concat_tables(tables, promote_options="permissive")
