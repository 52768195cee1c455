"""Which format a dataset is in: given (--format, with aliases), else from its files' extension."""

from __future__ import annotations

import json
import posixpath
from typing import Any

from jobrunner.openai import batch as openai_batch
from jobrunner.dataset.files import LongLine, lines, list_files, split_ext
from jobrunner.dataset.rows import DatasetError

FORMATS = ("parquet", "jsonl", "csv", openai_batch.FORMAT)
_ALIASES = {"json": "jsonl", "ndjson": "jsonl", "openai": openai_batch.FORMAT, "pq": "parquet",
            "tsv": "csv"}


def _norm_format(fmt: str) -> str:
    f = (fmt or "auto").lower()
    f = _ALIASES.get(f, f)
    if f != "auto" and f not in FORMATS:
        raise DatasetError(f"unknown format {fmt!r}; use one of auto, {', '.join(FORMATS)}")
    return f


def _first_record(url: str) -> Any:
    for line in lines(url):
        if isinstance(line, LongLine):
            return None
        if line.strip():
            try:
                return json.loads(line)
            except (ValueError, RecursionError):
                return None
    return None


def detect_format(url: str, fmt: str = "auto") -> str:
    """parquet|jsonl|csv|openai-batch, from `fmt`, else the extension (+sniffing JSONL)."""
    f = _norm_format(fmt)
    if f != "auto":
        return f
    files = list_files(url)
    found = {split_ext(p)[0] for p in files}
    if None in found or len(found) != 1:
        odd = [posixpath.basename(p) for p in files if split_ext(p)[0] is None][:3]
        why = f"unrecognized extension ({', '.join(odd)})" if odd else f"mixed formats {sorted(found)}"
        raise DatasetError(f"cannot tell the format of {url}: {why}; pass --format "
                           f"{'|'.join(FORMATS)}")
    f = found.pop()
    if f == "jsonl" and openai_batch.is_openai_record(_first_record(files[0])):
        return openai_batch.FORMAT
    return f
