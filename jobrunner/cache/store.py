"""The result cache's store: lookups of batches of keys and buffered writes, over shards in buckets.

Layout and shard format: jobrunner/cache/shards.py. The index is two-level: a bucket's listing
names its shards, and each shard's key column (read alone) says where an entry is. No index of
the whole cache is ever in memory: a lookup reads the shard indexes of its keys' buckets only,
keeps them (30 bytes a key, sorted) in an LRU bounded by `max_index_bytes`, binary-searches them,
and reads the record of each hit by its offset (shards.py).

What a lookup of a batch costs: per bucket touched the first time in a job (or again after the
LRU dropped it), one listing and one index read per shard; then numpy binary search
(microseconds) and one range read per hit. Large batches (jobrunner/cache/reuse.py: LOOKUP_ROWS) amortize
the per-bucket and per-shard costs.

A store's view of the cache is its bucket listings at first use plus what it wrote itself:
entries other jobs write meanwhile are seen by the next job. Writes go to a buffer (seen by
lookups at once) and become shards of up to flush_entries entries, one shard per bucket touched.
A failed write warns and is dropped: the cache only ever saves work, never holds a job up.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np

from jobrunner.common import storage
from jobrunner.cache.shards import CHECK_BYTES, LAYOUT, SHARD_RE, VALUES_RE, ShardError, bucket_of, read_index, read_records, shard_name, write_shard

log = logging.getLogger("jobrunner")


def open_store(url: str | None):
    """The CacheStore at url, or None without one; ValueError when the URL cannot be opened (its message
    says what to install), before any work starts."""
    if not url:
        return None
    try:
        return CacheStore(url)
    except ImportError as e:
        raise ValueError(f"--cache: {storage.missing_backend_message(url, e)}") from None
    except (ValueError, OSError) as e:
        raise ValueError(f"--cache {url}: cannot open it ({e})") from None


class _BucketIndex:
    """A bucket's keys over its shards, sorted, each with its shard, record offset and length; equal
    keys oldest first. 30 bytes a key."""

    def __init__(self, names: list[str], indexes: list[tuple]):
        self.names = list(names)
        self._set([(i, *ix) for i, ix in enumerate(indexes)])

    def _set(self, parts: list[tuple]):
        """parts: (shard index or an array of them, keys, offsets, lengths), oldest first."""
        def cat(arrays, dtype):
            return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.empty(0, dtype)
        keys = cat([p[1] for p in parts], "S16")
        order = np.argsort(keys, kind="stable")          # stable: older shards first among equal keys
        self.keys = keys[order]
        self.shard = cat([np.broadcast_to(np.asarray(p[0], np.int32), len(p[1])) for p in parts], np.int32)[order]
        self.offset = cat([p[2] for p in parts], np.int64)[order]
        self.length = cat([p[3] for p in parts], np.int32)[order]

    def add(self, name: str, keys: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> None:
        """A shard this process wrote (the newest)."""
        self.names.append(name)
        self._set([(self.shard, self.keys, self.offset, self.length), (len(self.names) - 1, keys, offsets, lengths)])

    def find(self, queries: np.ndarray) -> list[tuple[int, int, int] | None]:
        """Per query key: (shard index, offset, length) of its newest entry, or None."""
        if not len(self.keys):
            return [None] * len(queries)
        at = np.searchsorted(self.keys, queries, side="right") - 1
        ok = (at >= 0) & (self.keys[np.maximum(at, 0)] == queries)
        return [(int(self.shard[a]), int(self.offset[a]), int(self.length[a])) if hit else None
                for a, hit in zip(at, ok)]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.shard.nbytes + self.offset.nbytes + self.length.nbytes


class CacheStore:
    """A cache at an fsspec URL. Not thread-safe: one per process (data-parallel workers: one each)."""

    def __init__(self, url: str, *, max_index_bytes: int = 64 * 2**20, flush_entries: int = 20_000):
        self.url = url
        self.fs, root = storage.url_fs(url)
        self.base = storage.join(root, LAYOUT)
        self.max_index_bytes, self.flush_entries = max_index_bytes, flush_entries
        self._listings: dict[str, list[str]] = {}            # bucket -> shard names (snapshot + own)
        self._index: OrderedDict[str, _BucketIndex] = OrderedDict()     # LRU
        self._bad: set[str] = set()                         # shard paths found damaged (warned once)
        self._buffer: dict[bytes, bytes] = {}
        self.lookups = self.hits = self.entries_written = 0

    # --- reads ------------------------------------------------------------------------------

    def get_many(self, keys: list[bytes]) -> dict[bytes, bytes]:
        """key -> value for the keys found (the newest entry of each)."""
        keys = list(dict.fromkeys(keys))
        found = {k: self._buffer[k] for k in keys if k in self._buffer}
        by_bucket: dict[str, list[bytes]] = {}
        for k in keys:
            if k not in found:
                by_bucket.setdefault(bucket_of(k), []).append(k)
        for bucket, ks in by_bucket.items():
            found.update(self._get_bucket(bucket, ks))
        self.lookups += len(keys)
        self.hits += len(found)
        return found

    def _get_bucket(self, bucket: str, keys: list[bytes]) -> dict[bytes, bytes]:
        index = self._bucket_index(bucket)
        hits: dict[int, list[tuple[bytes, int, int]]] = {}      # shard -> [(key, offset, length)]
        for k, where in zip(keys, index.find(np.array(keys, dtype="S16"))):
            if where is not None:
                hits.setdefault(where[0], []).append((k, where[1], where[2]))
        found = {}
        for shard, wanted in hits.items():
            path = self._path(bucket, index.names[shard])
            if path in self._bad:
                continue
            try:
                got = read_records(self.fs, path, wanted)
            except (ShardError, OSError) as e:
                self._warn_bad(path, e)
                continue
            if len(got) < len(wanted):
                log.warning("result cache: %d entries of %s failed their check; recomputing them",
                            len(wanted) - len(got), path)
            found.update(got)
        return found

    def _bucket_index(self, bucket: str) -> _BucketIndex:
        index = self._index.get(bucket)
        if index is not None:
            self._index.move_to_end(bucket)
            return index
        names, indexes = [], []
        for name in self._listing(bucket):
            path = self._path(bucket, name)
            try:
                indexes.append(read_index(self.fs, path))
                names.append(name)
            except (ShardError, OSError) as e:
                self._warn_bad(path, e)
        index = self._index[bucket] = _BucketIndex(names, indexes)
        self._evict()
        return index

    def _listing(self, bucket: str) -> list[str]:
        if bucket not in self._listings:
            names = storage.list_names(self.fs, storage.join(self.base, bucket))
            for name in names:
                if not SHARD_RE.match(name) and not VALUES_RE.match(name) and not name.startswith("_tmp-"):
                    log.warning("result cache: %s is not a cache shard; skipped", self._path(bucket, name))
            self._listings[bucket] = [n for n in names if SHARD_RE.match(n)]
        return self._listings[bucket]

    def _evict(self) -> None:
        total = sum(i.nbytes for i in self._index.values())
        while total > self.max_index_bytes and len(self._index) > 1:
            _, old = self._index.popitem(last=False)
            total -= old.nbytes

    def _warn_bad(self, path: str, e: Exception) -> None:
        if path not in self._bad:
            self._bad.add(path)
            log.warning("result cache: skipping %s; its rows are recomputed", e)

    def _path(self, bucket: str, name: str) -> str:
        return storage.join(storage.join(self.base, bucket), name)

    # --- writes -----------------------------------------------------------------------------

    def put(self, key: bytes, value: bytes) -> None:
        self._buffer[key] = value
        if len(self._buffer) >= self.flush_entries:
            self.flush()

    def flush(self) -> None:
        """The buffered entries as shards, one per bucket; a failed write is logged and dropped."""
        by_bucket: dict[str, dict[bytes, bytes]] = {}
        for k, v in self._buffer.items():
            by_bucket.setdefault(bucket_of(k), {})[k] = v
        self._buffer = {}
        for bucket, entries in sorted(by_bucket.items()):
            name = shard_name()
            try:
                write_shard(self.fs, self._path(bucket, name), entries)
            except Exception as e:  # noqa: BLE001 - a cache write never fails the job
                log.warning("result cache: could not write %d entries to %s: %s", len(entries), self.url, e)
                continue
            self.entries_written += len(entries)
            if bucket in self._listings:
                self._listings[bucket].append(name)
            if bucket in self._index:
                self._index[bucket].add(name, *_index_of(entries))


def _index_of(entries: dict[bytes, bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The index write_shard writes for entries: sorted keys, record offsets and lengths."""
    keys = sorted(entries)
    lengths = np.array([CHECK_BYTES + len(entries[k]) for k in keys], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if keys else lengths
    return np.array(keys, dtype="S16"), offsets, lengths.astype(np.int32)
