"""The files of an output directory, on any fsspec URL, and which of them are ours.

Layout of an output directory:

    _manifest.json              job configuration, fingerprint, parts (informative; manifest.py)
    _lease.json                 the one job writing here now: host, pid, heartbeat (lease.py)
    part-00000.parquet          result rows; written as _tmp-... then renamed (parts.py)
    part-r1-00000.parquet       parts of another process (part_prefix="part-r1")
    _corrupt-part-00007.parquet a damaged part set aside on resume (its rows are redone)
    _stats.json, _stats.parquet job summary (completion.py)
    results.openai.jsonl        optional, jobrunner.openai.batch.write_openai_batch_output
    errors.openai.jsonl         beside it: the lines that failed (one line in one of the two per input line)
    report.html                 optional, `jobrunner report` (jobrunner/report/)

Invariants:
- A file named part*.parquet is always complete: it appears by rename only (storage.atomic_write).
  The listing of part files is the truth about what is done; the manifest's parts
  list is informative, so several writers (distinct part_prefix) can share a dir.
- Files named _* are not parts: glob "part*.parquet" (not "*.parquet", which would
  also match _stats.parquet) or use pyarrow.dataset, which skips _* files.
"""

from __future__ import annotations

import re
from typing import Any

from jobrunner.common import storage

MANIFEST = "_manifest.json"
LEASE = "_lease.json"
STATS_JSON = "_stats.json"
STATS_PARQUET = "_stats.parquet"
FORMAT_MARK = "jobrunner-output"            # the manifest's "format": this directory is ours

PART_RE = re.compile(r"^part[^/]*\.parquet$")
MANIFEST_TMP_RE = re.compile(r"^_tmp-_manifest\.json\.[0-9a-f]+$")
LEASE_RE = re.compile(r"^(?:_tmp-)?_lease\.json(?:\.[0-9a-f]+)?$")    # the lease, or its rewrite's temporary
PREFIX_RE = re.compile(r"^part[A-Za-z0-9_]*(-[A-Za-z0-9_]+)*$")   # a writer's part_prefix
# every name jobrunner writes in an output directory (what --overwrite may delete)
OURS_RE = re.compile(r"^(?:_manifest\.json|_lease\.json|_stats\.json|_stats\.parquet|report\.html"
                     r"|(?:results|errors)\.openai\.jsonl"
                     r"|(?:_corrupt-(?:\d+-)?)?part[^/]*\.parquet|_tmp-.+)$")


class OutputError(Exception):
    """The output directory can't be used as asked; the message says why and what to do."""


def output_fs(output_url: str) -> tuple[Any, str]:
    """storage.url_fs, with a missing fsspec backend said as an OutputError."""
    try:
        return storage.url_fs(output_url)
    except ImportError as e:  # fsspec's "Install s3fs to access S3"
        raise OutputError(storage.missing_backend_message(output_url, e)) from None


def names(fs: Any, root: str) -> list[str]:
    """Sorted names in root, listed afresh; [] when root does not exist."""
    return storage.list_names(fs, root)


def part_names(fs: Any, root: str) -> list[str]:
    """The part files in root, in name order; OutputError when root does not exist."""
    if not fs.exists(root):
        raise OutputError(f"output not found: {root}")
    return [n for n in names(fs, root) if PART_RE.match(n)]


def entries(fs: Any, root: str) -> dict[str, str]:
    """name -> "file" | "directory" (or another type) of each entry of root."""
    try:
        fs.invalidate_cache(root)
    except Exception:  # noqa: BLE001 - cache invalidation is best effort
        pass
    return {e["name"].rstrip("/").rsplit("/", 1)[-1]: e.get("type", "file")
            for e in fs.ls(root, detail=True)}
