"""One cache shard: a Parquet file of entries (key, value, check), sorted by key.

    <cache>/jobrunner-cache-v1/<bucket>/<created ns, 16 hex>-<random, 12 hex>.parquet

bucket: the first byte of the key in hex (256 buckets), so a lookup reads only its keys' buckets.
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
ROW_GROUP = 512                 # a hit reads one row group of its shard, not the whole file
SHARD_RE = re.compile(r"^([0-9a-f]{16})-[0-9a-f]{12}\.parquet$")


class ShardError(Exception):
    """A file in the cache that is not a readable shard."""


def bucket_of(key: bytes) -> str:
    return f"{key[0]:02x}"


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
        storage.atomic_write(fs, path, buf.getvalue())
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
        col = pf.read(columns=["key"]).column("key").combine_chunks()
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
    for g, group_rows in by_group.items():
        try:
            t = pf.read_row_group(g)
        except Exception as e:  # noqa: BLE001
            raise ShardError(f"{path}: damaged row group {g} ({type(e).__name__}: {e})") from None
        keys, values, checks = (t.column(c).to_pylist() for c in ("key", "value", "check"))
        for r in group_rows:
            i = r - int(starts[g])
            if i < len(keys) and checks[i] == check_of(keys[i], values[i]):
                out[r] = (keys[i], values[i])
    return out
