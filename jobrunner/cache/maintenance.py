"""`jobrunner cache stats | prune`: what a cache holds, and dropping whole shards by age or size.

A shard's age is its creation time (in its name); its size is its index's and its values'. Pruning
deletes whole shards, oldest first, index before values, so a job reading the cache meanwhile
either reads a shard or finds it gone (a miss: recomputed). Temporary files and values without an
index (a writer killed mid-write) are removed too once a day old.
"""
from __future__ import annotations

import re
import time

import pyarrow.parquet as pq

from jobrunner.common import storage
from jobrunner.cache.shards import LAYOUT, SHARD_RE, VALUES_RE, created_ns, values_path
from jobrunner.common.run_stats import utc_iso

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$", re.I)
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
STALE_TMP_S = 86400


def parse_duration(text: str) -> float:
    """'30d' -> seconds; s, m, h, d and w units. ValueError with what to write."""
    m = _DURATION.match(text or "")
    if not m:
        raise ValueError(f"cannot read duration {text!r}; write e.g. 90m, 12h, 30d or 2w")
    return float(m.group(1)) * _SECONDS[m.group(2).lower()]


def _files(url: str):
    """(bucket dir, name, size) of every file under the cache's layout directory."""
    fs, root = storage.url_fs(url)
    base = storage.join(root, LAYOUT)
    buckets = [storage.join(base, name) for name in storage.list_names(fs, base)]
    out = []
    for b in buckets:
        try:
            for e in fs.ls(b, detail=True):
                out.append((b.rstrip("/"), e["name"].rstrip("/").rsplit("/", 1)[-1], e.get("size") or 0))
        except (FileNotFoundError, NotADirectoryError):
            continue
    return fs, out


def cache_stats(url: str) -> dict:
    """Shards, entries, bytes, the oldest and newest shard, and files that are not readable shards.
    ValueError when url holds no cache (a mistyped path must not read as an empty cache)."""
    fs, root = storage.url_fs(url)
    if not fs.isdir(storage.join(root, LAYOUT)):
        raise ValueError(f"no result cache there (no {LAYOUT}/ directory); a job writes one with --cache {url}")
    fs, files = _files(url)
    shards = _shards(files)
    entries, unreadable = 0, 0
    for d, n, _ in shards:
        try:
            with fs.open(f"{d}/{n}", "rb") as f:
                entries += pq.ParquetFile(f).metadata.num_rows
        except Exception:  # noqa: BLE001 - counted, not fatal
            unreadable += 1
    times = [created_ns(n) / 1e9 for _, n, _ in shards]
    return {"url": url, "shards": len(shards), "entries": entries, "bytes": sum(s for _, _, s in shards),
            "buckets": len({d for d, _, _ in shards}), "unreadable_shards": unreadable,
            "other_files": len(files) - 2 * len(shards),
            "oldest": utc_iso(min(times)) if times else None, "newest": utc_iso(max(times)) if times else None}


def prune(url: str, older_than_s: float | None = None, max_size: int | None = None, now: float | None = None) -> dict:
    """Delete shards created more than older_than_s ago, then the oldest until at most max_size
    bytes remain; and stale temporaries. Returns what was removed and what is left."""
    fs, files = _files(url)
    now = time.time() if now is None else now
    shards = sorted((created_ns(n) / 1e9, f"{d}/{n}", s) for d, n, s in _shards(files))
    # oldest first: what either rule drops is a prefix of shards
    cut = sum(1 for s in shards if older_than_s is not None and now - s[0] > older_than_s)
    if max_size is not None:
        size = sum(s[2] for s in shards[cut:])
        while cut < len(shards) and size > max_size:
            size -= shards[cut][2]
            cut += 1
    drop = shards[:cut]
    indexed = {values_path(f"{d}/{n}") for d, n, _ in files if SHARD_RE.match(n)}
    leftovers = [f"{d}/{n}" for d, n, _ in files
                 if n.startswith("_tmp-") or (VALUES_RE.match(n) and f"{d}/{n}" not in indexed)]
    stale = [p for p in leftovers if _tmp_age(fs, p, now) > STALE_TMP_S]
    for path in [q for _, p, _ in drop for q in (p, values_path(p))] + stale:
        try:
            fs.rm(path)
        except FileNotFoundError:      # another prune got there first
            pass
    return {"shards_removed": len(drop), "bytes_removed": sum(s[2] for s in drop), "temporaries_removed": len(stale),
            "shards_left": len(shards) - cut, "bytes_left": sum(s[2] for s in shards[cut:])}


def _shards(files) -> list[tuple[str, str, int]]:
    """(dir, index name, bytes of index and values) of every shard with both files."""
    sizes = {f"{d}/{n}": s for d, n, s in files}
    return [(d, n, s + sizes[values_path(f"{d}/{n}")]) for d, n, s in files
            if SHARD_RE.match(n) and values_path(f"{d}/{n}") in sizes]


def _tmp_age(fs, path: str, now: float) -> float:
    try:
        return now - fs.modified(path).timestamp()
    except Exception:  # noqa: BLE001 - no modification time: leave it
        return 0.0


