"""Reading an output directory back: its parts, its values as the rows gave them, its summary.

Invariants:
- Parts are read one at a time, in name order, and only the columns asked for (bounded memory).
- A damaged part is skipped with a warning, never fatal to a reader; a part that vanished while
  listed (set aside by a resuming writer) is skipped silently.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from jobrunner.common import storage
from jobrunner.output import layout
from jobrunner.output.layout import MANIFEST, PART_RE, STATS_JSON, OutputError
from jobrunner.output.manifest import load_manifest
from jobrunner.output.values import EXTRA_JSON, FIXED_COLUMNS, arrow_schema, kinds_of

log = logging.getLogger("jobrunner")

__all__ = ["Columns", "iter_result_parts", "read_results", "stored_values", "read_stats", "read_manifest"]

# columns to read: all (None), these names, or a function of the part's names
Columns = list[str] | Callable[[list[str]], list[str]] | None


def _read_part(fs: Any, path: str, columns: Columns = None) -> pa.Table:
    """A part's table; columns: see iter_result_parts."""
    # ParquetFile, not pq.read_table: read_table goes through pyarrow.dataset, whose
    # threads reading a Python file object can abort the interpreter at exit.
    with fs.open(path, "rb") as f:
        pf = pq.ParquetFile(f)
        if columns is not None:
            names = pf.schema_arrow.names
            wanted = set(columns(names) if callable(columns) else columns)
            columns = [c for c in names if c in wanted]
        return pf.read(columns=columns, use_threads=False)


def iter_result_parts(output_url: str, columns: Columns = None) -> Iterator[pa.Table]:
    """Each readable part as a table (damaged ones are skipped with a warning).

    columns: None reads every column; a list reads those of them the part has; a function gets
    the part's column names and returns the ones to read.  Tables keep the part's schema metadata.
    """
    fs, root = storage.url_fs(output_url)
    for name in layout.part_names(fs, root):
        try:
            yield _read_part(fs, storage.join(root, name), columns)
        except FileNotFoundError:
            continue
        except (pa.ArrowException, OSError) as e:
            log.warning("%s: part %s is damaged and is skipped (%s); a resumed job sets it aside and does its "
                        "rows again", output_url, name, e)


def read_results(output_url: str) -> pa.Table:
    """All result rows of an output directory as one table (parts in name order)."""
    tables = list(iter_result_parts(output_url))
    if not tables:
        return arrow_schema(dict(FIXED_COLUMNS)).empty_table()
    return pa.concat_tables(tables, promote_options="permissive")


def stored_values(table: pa.Table, name: str) -> list[Any]:
    """A column's Python values as the rows gave them: JSON-kind cells decoded, and values that
    went to extra_json put back (also for a column the part's pinned schema lacks)."""
    n = table.num_rows
    values = table.column(name).to_pylist() if name in table.column_names else [None] * n
    if (kinds_of(table.schema) or {}).get(name) == "json":
        values = [None if v is None else json.loads(v) for v in values]
    if EXTRA_JSON in table.column_names:
        for i, extra in enumerate(table.column(EXTRA_JSON).to_pylist()):
            if extra is not None and values[i] is None:
                values[i] = json.loads(extra).get(name)
    return values


def read_stats(output_url: str) -> dict | None:
    """The job summary in _stats.json; None when the output has none yet (no run finished or was
    interrupted: jobrunner.output.summary computes one from the parts).  Raises OutputError when
    output_url holds no jobrunner output."""
    fs, root = storage.url_fs(output_url)
    try:
        with fs.open(storage.join(root, STATS_JSON), "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        pass
    names = layout.names(fs, root)
    if MANIFEST not in names and not any(PART_RE.match(n) for n in names):
        raise OutputError(f"no jobrunner output at {output_url}")
    return None


def read_manifest(output_url: str) -> dict | None:
    """The output's _manifest.json; None when it has none, OutputError when it is unreadable."""
    fs, root = storage.url_fs(output_url)
    return load_manifest(fs, root)
