"""The end of a job: its summary (_stats.json, _stats.parquet) and the manifest marked complete.

Invariants:
- mark_complete reads no part: the manifest's parts list comes from a directory listing, so
  finishing costs the same however many parts the output holds.
- The stats are written before the manifest says complete: a complete output always has them.
- write_stats alone does not mark the job complete (an interrupted or failed run).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from jobrunner.common import storage
from jobrunner.output import layout
from jobrunner.output.layout import STATS_JSON, STATS_PARQUET
from jobrunner.output.manifest import load_manifest, write_manifest
from jobrunner.output.values import arrow_array, is_float, is_int, scrub, to_json, to_json_pretty

__all__ = ["write_stats", "mark_complete"]


def write_stats(output_url: str, stats: Mapping[str, Any]) -> None:
    """_stats.json (the dict) and _stats.parquet (one row; nested values as JSON strings)."""
    fs, root = storage.url_fs(output_url)
    text = to_json_pretty(dict(stats)).encode("utf-8", "replace")
    storage.atomic_write(fs, storage.join(root, STATS_JSON), text)
    arrays, names = [], []
    for k, v in stats.items():
        value, kind = _stat_cell(v)
        arrays.append(arrow_array([value], kind))
        names.append(scrub(str(k)))
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_arrays(arrays, names=names), sink)
    storage.atomic_write(fs, storage.join(root, STATS_PARQUET), sink.getvalue().to_pybytes())


def _stat_cell(v: Any) -> tuple[Any, str]:
    """(value, kind) of one stats value: scalars keep their type, the rest is JSON text."""
    if isinstance(v, bool):
        return v, "bool"
    if is_int(v):
        return int(v), "int"
    if is_float(v) and not isinstance(v, numbers.Integral):
        return float(v), "float"
    if isinstance(v, str):
        return v, "string"
    return (None if v is None else to_json(v)), "string"


def mark_complete(output_url: str, stats: Mapping[str, Any], manifest: dict | None = None) -> dict:
    """Write the job's stats, then rewrite _manifest.json as complete; returns the manifest.

    manifest: the one to write (a ResultWriter's own, or prepare_output's for a launcher whose
    workers wrote the parts), updated in place; None: the one on disk.  No part is read.  A failed
    manifest update only warns.
    """
    fs, root = storage.url_fs(output_url)
    if manifest is None:
        manifest = load_manifest(fs, root)
        if manifest is None:
            raise layout.OutputError(f"no jobrunner output at {output_url}")
    write_stats(output_url, stats)
    write_manifest(fs, root, output_url, manifest, complete=True)
    return manifest
