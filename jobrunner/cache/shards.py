"""One cache shard: a Parquet file of entries (key, value, check), sorted by key.

    <cache>/jobrunner-cache-v1/<bucket>/<created ns, 16 hex>-<random, 12 hex>.parquet

bucket: the key's first BUCKET_BITS bits in hex, so a lookup reads only its keys' buckets. 64
buckets: a batch of lookups reads one row-group set per bucket and shard (about a millisecond in
pyarrow however small), so fewer, larger shards cost less per batch; at 10M entries a bucket's keys
are still only 2.5 MB.
A shard is written once and never changed: locally to a temporary name and renamed, on an object
store as one PUT (an object appears whole or not at all). Its name is unique, so writers never
collide, and sorts by creation time, so among equal keys the newest wins (--cache-mode refresh).

Safety: a file that is not a readable shard of this layout (truncated, garbage, another schema)
raises ShardError; `check` (8 bytes of blake2b over key and value) catches a damaged entry in a
readable file. Either way the caller warns and recomputes: never a wrong row.
"""
from __future__ import annotations

import hashlib
import io
import re
import secrets
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from jobrunner import storage

LAYOUT = "jobrunner-cache-v1"
MARK = b"jobrunner-cache"
SCHEMA = pa.schema([("key", pa.binary(16)), ("value", pa.large_binary()), ("check", pa.binary(8))],
                   metadata={MARK: b"1"})
BUCKET_BITS = 6
ROW_GROUP = 512                 # a hit reads one row group of its shard, not the whole file
SHARD_RE = re.compile(r"^([0-9a-f]{16})-[0-9a-f]{12}\.parquet$")


class ShardError(Exception):
    """A file in the cache that is not a readable shard."""


def bucket_of(key: bytes) -> str:
    return f"{key[0] >> (8 - BUCKET_BITS):02x}"


def shard_name() -> str:
    return f"{time.time_ns():016x}-{secrets.token_hex(6)}.parquet"


def created_ns(name: str) -> int:
    return int(SHARD_RE.match(name).group(1), 16)


def check_of(key: bytes, value: bytes) -> bytes:
    return hashlib.blake2b(value, digest_size=8, key=key).digest()


def write_shard(fs, path: str, entries: dict[bytes, bytes]) -> None:
    """Entries (key -> value) as one shard at path, appearing whole or not at all."""
    keys = sorted(entries)
    values = [entries[k] for k in keys]
    table = pa.table([pa.array(keys, pa.binary(16)), pa.array(values, pa.large_binary()),
                      pa.array([check_of(k, v) for k, v in zip(keys, values)], pa.binary(8))], schema=SCHEMA)
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=ROW_GROUP, compression="zstd", write_page_checksum=True)
    if isinstance(fs, LocalFileSystem):
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        # temp + rename; no fsync: a shard lost to a power cut is only work to redo, and one left
        # empty or short fails to read and is skipped
        storage.atomic_write_with(fs, path, lambda f: f.write(buf.getvalue()))
    else:           # an object store: one PUT is atomic and the name is new (write-once)
        fs.pipe_file(path, buf.getvalue())


def _open(fs, path: str) -> pq.ParquetFile:
    try:
        f = fs.open(path, "rb")
        pf = pq.ParquetFile(f, page_checksum_verification=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is skipped, whatever the reason
        raise ShardError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    meta = pf.schema_arrow.metadata or {}
    if meta.get(MARK) != b"1" or not pf.schema_arrow.equals(SCHEMA, check_metadata=False):
        raise ShardError(f"{path}: a Parquet file, but not a jobrunner cache shard")
    return pf


def read_keys(fs, path: str) -> np.ndarray:
    """The shard's keys, sorted, as a numpy 'S16' array (16 bytes a key in memory)."""
    try:
        pf = _open(fs, path)
        col = pf.read(columns=["key"], use_threads=False).column("key").combine_chunks()
        if col.null_count:
            raise ShardError(f"{path}: null keys")
        keys = np.frombuffer(col.buffers()[1], dtype="S16", count=len(col), offset=col.offset * 16).copy()
    except ShardError:
        raise
    except Exception as e:  # noqa: BLE001
        raise ShardError(f"{path}: damaged ({type(e).__name__}: {e})") from None
    return keys


def read_values(fs, path: str, rows: list[int]) -> dict[int, tuple[bytes, bytes]]:
    """Row index -> (key, value) for the given rows whose check holds; reads only their row groups."""
    pf = _open(fs, path)
    starts = np.cumsum([0] + [pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups)])
    out = {}
    by_group: dict[int, list[int]] = {}
    for r in rows:
        by_group.setdefault(int(np.searchsorted(starts, r, side="right") - 1), []).append(r)
    groups = sorted(by_group)
    try:
        t = pf.read_row_groups(groups, use_threads=False)
    except Exception as e:  # noqa: BLE001
        raise ShardError(f"{path}: damaged ({type(e).__name__}: {e})") from None
    keys, values, checks = (t.column(c) for c in ("key", "value", "check"))
    at = 0                          # the first row of group g in t
    for g in groups:
        for r in by_group[g]:
            i = at + r - int(starts[g])
            k, v, c = keys[i].as_py(), values[i].as_py(), checks[i].as_py()
            if c == check_of(k, v):
                out[r] = (k, v)
        at += int(starts[g + 1] - starts[g])
    return out
