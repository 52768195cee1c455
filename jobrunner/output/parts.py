"""ResultWriter: result rows buffered and written as atomic, resumable parquet parts.

Invariants:
- done = what all readable part*.parquet files found at open hold, by occurrence (output/done.py:
  what a resumed job skips): done_ids, the ids whose own row is written (a duplicate's error row
  never makes its id done), failed_ids, those of them with an error row (a resumed job's progress
  counts them failed, as the summary does), done_repeats, the later occurrences whose duplicate error
  row is written. IdSets (16 bytes an id); rows written since are not added, since the caller knows
  them. Given (`done_ids=`), the caller's instead, and no part's ids are read (a Ray job's workers:
  its driver read them once and planned the rest, parallel/ray_plan.py). A part that can't be read
  is renamed _corrupt-<name> and its rows are not done.
- Rows passed in one write() call always land in the same part (a multi-sample
  row is never half written).
- A part is flushed once part_rows rows are buffered, or once the oldest buffered row has
  waited flush_seconds (checked on write() and maybe_flush(), which a job calls after every
  engine step): a kill loses at most flush_seconds of finished rows.
- The schema: the one the parts found at open have (a resumed job keeps it, whoever wrote it),
  else the one the job declared (`schema`, jobrunner.output.schema): every part of a job then has
  it, whatever rows it holds.  Without either, the first part pins one from its rows
  (values.infer_kinds), and waits for a row without an error to do so (error rows alone lack the
  kind's columns; they are no work to redo).
- A part never replaces another: its number is past every part of this prefix, and it is
  written under a temporary name and renamed (storage.atomic_write).
- Each part records, in its schema metadata "jobrunner.run" (RUN_METADATA), what `run_record` gives
  at its flush: the writing run's time so far (JobStats.time_record), so a run killed before it wrote
  _stats.json still counts in the summary (output/summary.py); a part written without one records none.
- Data-parallel workers sharing a directory: the launcher calls prepare_output
  once (it alone may --overwrite), each worker uses its own part_prefix and
  closes with stats=None; the launcher then calls completion.mark_complete (or write_stats
  when the job is not complete).  Workers declare the same schema, so their parts agree.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from jobrunner.common import storage
from jobrunner.common.idset import IdSet
from jobrunner.output import layout
from jobrunner.output.completion import mark_complete, write_stats
from jobrunner.output.done import DoneRows
from jobrunner.output.layout import MANIFEST_TMP_RE, PART_RE, PREFIX_RE, OutputError
from jobrunner.output.manifest import prepare_output, write_manifest
from jobrunner.output.values import EXTRA_JSON, arrow_schema, id_key, infer_kinds, kinds_of, norm_row, to_table

log = logging.getLogger("jobrunner")

__all__ = ["ResultWriter", "RUN_METADATA"]

RUN_METADATA = b"jobrunner.run"     # a part's schema metadata: its run's time record, JSON (see the module doc)


def _extras(t: pa.Table) -> list[str | None]:
    return t.column(EXTRA_JSON).to_pylist() if EXTRA_JSON in t.column_names else [None] * t.num_rows


def _key(value: Any, extra: str | None) -> str | None:
    """A row's key: its id's, or for a null id the "id" its extra_json holds; None if neither."""
    if value is not None:
        return id_key(value)
    try:
        key = json.loads(extra).get("id") if extra else None
    except (ValueError, AttributeError):
        return None
    return key if isinstance(key, str) else None


class ResultWriter:
    """Buffers result rows and writes them as atomic, resumable parquet parts.

    Not thread-safe; one writer per process and part_prefix.
    """

    clock = staticmethod(time.monotonic)    # seconds; tests replace it

    def __init__(self, output_url: str, manifest: dict, part_rows: int = 10000,
                 overwrite: bool = False, part_prefix: str = "part", flush_seconds: float = 60.0,
                 schema: pa.Schema | None = None, done_ids: IdSet | None = None,
                 run_record: Callable[[], dict] | None = None):
        if part_rows < 1:
            raise ValueError("part_rows must be >= 1")
        if not flush_seconds > 0:
            raise ValueError("flush_seconds must be > 0")
        if not PREFIX_RE.match(part_prefix):
            raise ValueError(f"part_prefix must look like 'part' or 'part-r1', got {part_prefix!r}")
        self.output_url = output_url
        self.part_rows = part_rows
        self.flush_seconds = flush_seconds
        self.part_prefix = part_prefix
        self.run_record = run_record    # the writing run's time record at each flush (RUN_METADATA)
        self.manifest = prepare_output(output_url, manifest, overwrite)
        self.fs, self.root = storage.url_fs(output_url)
        self._own_re = re.compile(rf"^(?:_corrupt-(?:\d+-)?)?{re.escape(part_prefix)}-(\d+)\.parquet$")
        self._tmp_re = re.compile(rf"^_tmp-{re.escape(part_prefix)}-\d+\.parquet\.[0-9a-f]+$")
        self._buffer: list[dict[str, Any]] = []
        self._oldest: float | None = None      # clock() when the oldest buffered row came; None: buffer empty
        self._ok_buffered = False               # a buffered row has no error (see maybe_flush)
        self._schema: pa.Schema | None = None   # pinned: by the parts found at open, else `schema`
        self.done = DoneRows()          # what the parts found at open hold; see the module doc
        self.parts: list[str] = []      # all valid part files at open, plus ours since
        self.corrupt: list[str] = []    # parts set aside at open (new names)
        self._next = 0
        self._scan(read_ids=done_ids is None)
        if done_ids is not None:       # the caller's: it read the parts (a Ray job's driver planned the rows)
            self.done.ids = done_ids
        if self._schema is None and schema is not None:
            assert kinds_of(schema) is not None, "a declared schema records its kinds (values.arrow_schema)"
            self._schema = schema

    # -- resume

    def _scan(self, read_ids: bool = True) -> None:
        """Read every part's id column; set damaged parts aside; find our next part number. Without
        read_ids (the caller has the done ids), only the schema of the first part that records one."""
        names = layout.names(self.fs, self.root)
        for name in names:
            # our own stale temp part from a killed run, or anyone's stale manifest temp
            # (a writer racing with this loses one informative manifest update, no data)
            if self._tmp_re.match(name) or MANIFEST_TMP_RE.match(name):
                try:
                    self.fs.rm(storage.join(self.root, name))
                except FileNotFoundError:
                    pass
        for name in names:
            if not PART_RE.match(name):
                continue
            if not read_ids:
                if self._schema is None:
                    self._schema = self._read_schema(name)
                self.parts.append(name)
                continue
            ids, schema, errors = self._read_part_ids(name)
            if ids is None:
                self.corrupt.append(self._set_aside(name, names))
                continue
            self.done.add(ids, errors)
            self.parts.append(name)
            if self._schema is None and schema is not None:
                self._schema = schema
        seqs = [int(m.group(1)) for n in layout.names(self.fs, self.root) if (m := self._own_re.match(n))]
        self._next = max(seqs, default=-1) + 1

    def _read_schema(self, name: str) -> pa.Schema | None:
        try:
            with self.fs.open(storage.join(self.root, name), "rb") as f:
                schema = pq.read_schema(f)
        except (FileNotFoundError, pa.ArrowException, OSError):
            return None
        return schema if kinds_of(schema) is not None else None

    def written_ids(self, part_prefix: str) -> IdSet:
        """The ids in the parts of another writer of this directory (a lost Ray worker's: ray_plan.refill)."""
        theirs = re.compile(rf"^{re.escape(part_prefix)}-\d+\.parquet$")
        ids = IdSet()
        for name in layout.names(self.fs, self.root):
            if theirs.match(name):
                ids.update(self._read_part_ids(name)[0] or ())
        return ids

    @property
    def done_ids(self) -> IdSet:
        return self.done.ids

    @property
    def failed_ids(self) -> IdSet:
        return self.done.failed

    @property
    def done_repeats(self) -> IdSet:
        return self.done.repeats

    @property
    def buffered(self) -> int:
        """Rows written to this writer and not yet in a part."""
        return len(self._buffer)

    def _read_part_ids(self, name: str) -> tuple[list[str] | None, pa.Schema | None, pa.ChunkedArray | None]:
        """(the part's row keys, its schema if it records its kinds, its error column or None); (None, None,
        None) when damaged. A null id's key is in extra_json (a value the id column's type can't hold:
        values.py)."""
        try:
            with self.fs.open(storage.join(self.root, name), "rb") as f:
                pf = pq.ParquetFile(f)
                schema = pf.schema_arrow
                cols = ["id"] + [c for c in (EXTRA_JSON, "error") if c in schema.names]
                t = pf.read(columns=cols, use_threads=False)
                if t.num_rows != pf.metadata.num_rows:
                    return None, None, None
                ids = [_key(v, extra) for v, extra in zip(t.column("id").to_pylist(), _extras(t))]
                if None in ids:
                    return None, None, None
                errors = t.column("error") if "error" in t.column_names else None
                return ids, (schema if kinds_of(schema) is not None else None), errors
        except FileNotFoundError:
            return [], None, None  # moved aside by another writer meanwhile
        except (pa.ArrowException, OSError, KeyError, ValueError, EOFError):
            return None, None, None

    def _set_aside(self, name: str, names: list[str]) -> str:
        new = f"_corrupt-{name}"
        k = 1
        while new in names:
            new, k = f"_corrupt-{k}-{name}", k + 1
        log.warning("%s: part %s is damaged; set aside as %s, its rows will be done again", self.output_url,
                    name, new)
        try:
            self.fs.mv(storage.join(self.root, name), storage.join(self.root, new))
        except FileNotFoundError:
            pass  # another writer set it aside first
        return new

    # -- writing

    def write(self, rows: list[dict]) -> None:
        """Buffer rows; flush a part once part_rows are buffered or the oldest has waited
        flush_seconds. One call's rows share a part."""
        self._buffer.extend(norm_row(r) for r in rows)
        if self._buffer and self._oldest is None:
            self._oldest = self.clock()
        self._ok_buffered = self._ok_buffered or any(r.get("error") is None for r in rows)
        if len(self._buffer) >= self.part_rows:
            self.flush()
        else:
            self.maybe_flush()

    def maybe_flush(self) -> None:
        """Flush when the oldest buffered row has waited flush_seconds (cheap: call it often).

        The very first part waits for a row without an error: it pins the schema, which error rows
        alone would leave without the job's own columns (and error rows cost no work to redo).
        """
        if self._oldest is None or (self._schema is None and not self._ok_buffered):
            return
        if self.clock() - self._oldest >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        """Write the buffered rows as the next part (atomic), then update the manifest."""
        if not self._buffer:
            return
        rows = self._buffer
        if self._schema is None:
            self._schema = self._pinned_by_others() or arrow_schema(infer_kinds(rows))
        table = self._with_run(to_table(rows, self._schema))
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, compression="zstd", row_group_size=max(len(rows), 1))
        data = sink.getvalue().to_pybytes()
        name = f"{self.part_prefix}-{self._next:05d}.parquet"
        while self.fs.exists(storage.join(self.root, name)):  # never replace a part (another process?)
            self._next += 1
            name = f"{self.part_prefix}-{self._next:05d}.parquet"
        try:
            storage.atomic_write(self.fs, storage.join(self.root, name), data)
        except Exception as e:
            # what failed, only: the caller says what to do (api_errors: fix the storage, run again to resume)
            raise OutputError(f"writing {name} to {self.output_url} failed: {e}") from e
        self._next += 1
        self._buffer, self._oldest, self._ok_buffered = [], None, False
        self.parts.append(name)
        write_manifest(self.fs, self.root, self.output_url, self.manifest, complete=False)

    def _with_run(self, table: pa.Table) -> pa.Table:
        """The table with this run's record in its metadata (not the one a schema read from a part holds)."""
        meta = {k: v for k, v in (table.schema.metadata or {}).items() if k != RUN_METADATA}
        if self.run_record is not None:
            meta[RUN_METADATA] = json.dumps({**self.run_record(), "part_prefix": self.part_prefix}).encode()
        return table.replace_schema_metadata(meta)

    def _pinned_by_others(self) -> pa.Schema | None:
        """The schema of a part another writer wrote since we opened (shared directories)."""
        for name in layout.names(self.fs, self.root):
            if PART_RE.match(name):
                try:
                    with self.fs.open(storage.join(self.root, name), "rb") as f:
                        schema = pq.read_schema(f)
                except (pa.ArrowException, OSError, ValueError):
                    continue
                if kinds_of(schema):
                    return schema
        return None

    def close(self, stats: dict | None = None) -> None:
        """Flush; with stats, write _stats.json/_stats.parquet and mark the job complete.

        Data-parallel workers close with stats=None; the launcher writes the stats.
        """
        self.flush()
        if stats is not None:
            mark_complete(self.output_url, stats, self.manifest)

    def write_stats(self, stats: Mapping[str, Any]) -> None:
        """_stats.json/_stats.parquet without marking the job complete (e.g. interrupted)."""
        write_stats(self.output_url, stats)

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.flush()  # keep what is done, even on an exception or interrupt
