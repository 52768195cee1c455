"""One output directory opened for reading figures: its summary, manifest, configuration, and a lazy
polars scan over its parts.

Invariants:
- Nothing is read eagerly but _stats.json and _manifest.json: `scan()` is lazy, and every query over
  it reads only the columns it names (projection pushdown), a batch at a time under the streaming
  engine (`collect`): memory is bounded by the figures kept, not by the output's size.
- Parts on a remote fsspec URL are copied to a local temporary directory first (disk, not memory),
  since polars reads local paths lazily and fsspec files whole; the copy lives as long as the Output.
- The schema is the first part's (layout's invariant: every part has it); a part lacking a column
  gets nulls.
- A row is counted by its first sample (sample_index null or 0), as the summary counts it.
"""
from __future__ import annotations

import shutil
import tempfile
import weakref
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property

import polars as pl
from fsspec.implementations.local import LocalFileSystem

from jobrunner.common import storage
from jobrunner.output import read_manifest, read_stats
from jobrunner.output import layout
from jobrunner.output.summary import job_summary, stored_name
from jobrunner.jobs import KINDS

__all__ = ["Output", "open_output", "collect", "first_samples"]


def collect(lf: pl.LazyFrame) -> pl.DataFrame:
    """A query's result under the streaming engine (batches, bounded memory)."""
    return lf.collect(engine="streaming")


@dataclass
class Output:
    url: str
    stats: dict                         # _stats.json, or the summary of the parts so far (partial)
    manifest: dict                      # {} when there is none
    paths: list[str]                    # the parts, local paths, in name order
    part_times: list[float | None]      # each part's modification time (epoch s), None where unknown
    partial: bool = False               # no run wrote _stats.json
    _tmp: str | None = field(default=None, repr=False)     # the local copies' directory (a remote output's parts)

    @property
    def config(self) -> dict:
        return self.manifest.get("config") or {}

    @property
    def kind(self) -> str:
        return self.config.get("kind") or "generate"

    @property
    def columns(self) -> list[str]:
        return list(self.schema)

    @cached_property
    def schema(self) -> pl.Schema:
        """The first part's schema (every part has it); empty when there is no part."""
        return pl.Schema(pl.read_parquet_schema(self.paths[0])) if self.paths else pl.Schema({})

    def reference_column(self) -> str | None:
        """The reference column's stored name (output/columns.py renames it under a result column)."""
        ref = self.config.get("reference_column")
        return stored_name(ref, KINDS[self.kind].result_columns, set(self.columns)) if ref else None

    def scan(self) -> pl.LazyFrame:
        """Every part's rows, lazily, with `row` (their order: part name order, then within a part)."""
        if not self.paths:
            return pl.LazyFrame(schema={"row": pl.UInt32, "id": pl.String, "error": pl.String})
        return pl.scan_parquet(self.paths, row_index_name="row", missing_columns="insert",
                               extra_columns="ignore")

    def has(self, name: str) -> bool:
        return name in self.schema


def first_samples(out: Output) -> pl.LazyFrame:
    """One row per input row: its first sample (summary._add_rows's `first`)."""
    lf = out.scan()
    return lf.filter(pl.col("sample_index").fill_null(0) == 0) if out.has("sample_index") else lf


def open_output(url: str) -> Output:
    """The output at url (any fsspec URL); OutputError when there is none."""
    stats = read_stats(url)         # OutputError: no jobrunner output here
    manifest = read_manifest(url) or {}
    partial = stats is None
    if partial:             # killed before any run ended: the rows' figures from the parts so far
        stats = job_summary(url, manifest.get("config") or {})
    fs, root = storage.url_fs(url)
    names = layout.part_names(fs, root)
    tmp = tempfile.mkdtemp(prefix="jobrunner-report-") if names and not isinstance(fs, LocalFileSystem) else None
    paths, times = [], []
    for name in names:
        src = storage.join(root, name)
        times.append(_mtime(fs, src))
        if tmp is None:
            paths.append(src)
        else:
            dst = f"{tmp}/{name}"
            fs.get(src, dst)
            paths.append(dst)
    out = Output(url, stats, manifest, paths, times, partial, tmp)
    if tmp is not None:
        weakref.finalize(out, shutil.rmtree, tmp, True)
    return out


def _mtime(fs, path: str) -> float | None:
    """A file's modification time as epoch seconds, from whatever the filesystem's info says."""
    try:
        info = fs.info(path)
    except (OSError, ValueError):
        return None
    for key in ("mtime", "LastModified", "updated", "last_modified", "created"):
        v = info.get(key)
        if isinstance(v, (int, float)):
            return float(v)
        if hasattr(v, "timestamp"):
            return v.timestamp()
        if isinstance(v, str):
            try:
                return datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None
