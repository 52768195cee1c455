"""One cache shard: a Parquet index of entries sorted by key, beside the file of their values.

    <cache>/jobrunner-cache-v1/<bucket>/<created ns, 16 hex>-<random, 12 hex>.parquet   the index
    <cache>/jobrunner-cache-v1/<bucket>/<created ns, 16 hex>-<random, 12 hex>.values    the values

The index has one row an entry, sorted by key: key (16 bytes), offset and length of its record in
the values file. A record is 8 bytes of check (blake2b of the value, keyed by the key) then the
value (the encoded RequestOutput, jobrunner/cache/codec.py). A hit costs one range read of its
record, however large the shard; a batch reads a shard's records in offset order (one open
locally, one concurrent cat_ranges on an object store). Values in Parquet instead would cost a
whole row group's decoding per hit: with random keys, a batch would decode most of the cache.

bucket: the key's first BUCKET_BITS bits in hex, so a lookup reads only its keys' buckets; at 10M
entries a bucket's keys are 2.5 MB.

A shard is written once and never changed: the values first, then the index, each locally to a
temporary name and renamed, on an object store as one PUT (an object appears whole or not at
all); a reader lists indexes only, so it never sees a shard without its values. Names are unique,
so writers never collide, and sort by creation time, so among equal keys the newest wins.

Safety: a file that is not a readable index of this layout (truncated, garbage, another schema)
raises ShardError; a record whose check fails (a damaged or truncated values file) is a miss.
Either way the caller warns and recomputes: never a wrong row.
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

from jobrunner.common import storage

LAYOUT = "jobrunner-cache-v1"
MARK = b"jobrunner-cache"
SCHEMA = pa.schema([("key", pa.binary(16)), ("offset", pa.int64()), ("length", pa.int32())], metadata={MARK: b"1"})
BUCKET_BITS = 6
CHECK_BYTES = 8
SHARD_RE = re.compile(r"^([0-9a-f]{16})-[0-9a-f]{12}\.parquet$")
VALUES_RE = re.compile(r"^([0-9a-f]{16})-[0-9a-f]{12}\.values$")


class ShardError(Exception):
    """A file in the cache that is not a readable shard index."""


def bucket_of(key: bytes) -> str:
    return f"{key[0] >> (8 - BUCKET_BITS):02x}"


def shard_name() -> str:
    return f"{time.time_ns():016x}-{secrets.token_hex(6)}.parquet"


def values_path(index_path: str) -> str:
    return index_path.removesuffix(".parquet") + ".values"


def created_ns(name: str) -> int:
    return int(name[:16], 16)


def check_of(key: bytes, value: bytes) -> bytes:
    return hashlib.blake2b(value, digest_size=CHECK_BYTES, key=key).digest()


def write_shard(fs, path: str, entries: dict[bytes, bytes]) -> None:
    """Entries (key -> value) as one shard whose index is at path: values, then index."""
    keys = sorted(entries)
    records = [check_of(k, entries[k]) + entries[k] for k in keys]
    lengths = np.array([len(r) for r in records], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(records) else lengths
    index = pa.table([pa.array(keys, pa.binary(16)), pa.array(offsets, pa.int64()),
                      pa.array(lengths, pa.int32())], schema=SCHEMA)
    buf = io.BytesIO()
    pq.write_table(index, buf, compression="zstd", write_page_checksum=True)
    _write_once(fs, values_path(path), b"".join(records))
    _write_once(fs, path, buf.getvalue())


def _write_once(fs, path: str, data: bytes) -> None:
    if isinstance(fs, LocalFileSystem):
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        # temp + rename; no fsync: a shard lost to a power cut is only work to redo, and one left
        # empty or short fails its checks and is skipped
        storage.atomic_write_with(fs, path, lambda f: f.write(data))
    else:           # an object store: one PUT is atomic and the name is new (write-once)
        fs.pipe_file(path, data)


def read_index(fs, path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The shard's keys (sorted, numpy 'S16': 16 bytes a key), record offsets and lengths."""
    try:
        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f, page_checksum_verification=True)
            if (pf.schema_arrow.metadata or {}).get(MARK) != b"1" or not pf.schema_arrow.equals(
                    SCHEMA, check_metadata=False):
                raise ShardError(f"{path}: a Parquet file, but not a jobrunner cache shard")
            t = pf.read(use_threads=False)
    except ShardError:
        raise
    except Exception as e:  # noqa: BLE001 - any unreadable file is skipped, whatever the reason
        raise ShardError(f"{path}: not a readable shard index ({type(e).__name__}: {e})") from None
    col = t.column("key").combine_chunks()
    if col.null_count or t.column("offset").null_count or t.column("length").null_count:
        raise ShardError(f"{path}: null fields")
    keys = np.frombuffer(col.buffers()[1], dtype="S16", count=len(col), offset=col.offset * 16).copy()
    return keys, t.column("offset").to_numpy(), t.column("length").to_numpy().astype(np.int32)


def read_records(fs, path: str, wanted: list[tuple[bytes, int, int]]) -> dict[bytes, bytes]:
    """key -> value for (key, offset, length) records of the shard at path whose check holds."""
    wanted = sorted(wanted, key=lambda w: w[1])
    vpath = values_path(path)
    try:
        if isinstance(fs, LocalFileSystem):
            with open(vpath, "rb") as f:
                blobs = []
                for _, offset, length in wanted:
                    f.seek(offset)
                    blobs.append(f.read(length))
        else:
            blobs = fs.cat_ranges([vpath] * len(wanted), [w[1] for w in wanted], [w[1] + w[2] for w in wanted],
                                  on_error="return")
    except Exception as e:  # noqa: BLE001
        raise ShardError(f"{vpath}: unreadable ({type(e).__name__}: {e})") from None
    out = {}
    for (key, _, length), blob in zip(wanted, blobs):
        if isinstance(blob, bytes) and len(blob) == length and blob[:CHECK_BYTES] == check_of(key, blob[CHECK_BYTES:]):
            out[key] = blob[CHECK_BYTES:]
    return out
