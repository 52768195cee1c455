"""A dataset's files: listing them, their extensions and compression, and reading their lines.

Every read goes through open_binary (decompressing by extension) and is bounded: lines() holds
one line at a time, however long the file, and no line longer than its bound (a LongLine stands for it).
"""

from __future__ import annotations

import lzma
import posixpath
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import fsspec
import pyarrow as pa

from jobrunner.common import storage
from jobrunner.dataset.rows import DatasetError

_COMPRESSION = {".gz": "gzip", ".gzip": "gzip", ".zst": "zstd", ".zstd": "zstd",
                ".bz2": "bz2", ".xz": "xz"}
_EXTENSIONS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl",
               ".json": "jsonl", ".csv": "csv", ".tsv": "csv"}
_CHUNK = 1 << 20             # bytes per read() when splitting lines
DEFAULT_MAX_ROW_BYTES = 4 << 20     # --max-row-bytes: a longer line, cell or row is an error row
SNIFF_LINE_BYTES = 64 << 20  # lines looked at for columns, types and the format: past this, skipped
# Errors of reading a truncated or corrupt compressed file, a network error...
READ_ERRORS = (OSError, EOFError, ValueError, zlib.error, lzma.LZMAError)


def ext(path: str) -> tuple[str, str | None]:
    """(data extension like ".csv", compression or None), ignoring a URL query."""
    name = posixpath.basename(path.split("?")[0].rstrip("/")).lower()
    stem, e = posixpath.splitext(name)
    comp = _COMPRESSION.get(e)
    if comp:
        e = posixpath.splitext(stem)[1]
    return e, comp


def split_ext(path: str) -> tuple[str | None, str | None]:
    """(format from extension or None, compression or None)."""
    e, comp = ext(path)
    return _EXTENSIONS.get(e), comp


def open_fs(url: str) -> tuple[Any, str]:
    """storage.url_fs with its errors as DatasetError.

    The path has no trailing "/" (fsspec already strips it for local, memory and s3 paths);
    list_files doesn't rely on either, it strips the directory's path itself.
    """
    try:
        return storage.url_fs(url)
    except ImportError as e:
        raise DatasetError(storage.missing_backend_message(url, e)) from e
    except ValueError as e:
        raise DatasetError(f"cannot open dataset {url!r}: {e}") from e


def list_files(url: str) -> list[str]:
    """Files of a dataset: a single file, a glob, or a directory of parts.

    Sorted; files and folders named `_*` or `.*` (e.g. _SUCCESS, .crc) are ignored.
    Returned as URLs with the protocol of `url` (plain paths for plain paths).
    """
    fs, path = open_fs(url)
    try:
        if any(ch in path for ch in "*?["):
            paths = [p for p in fs.glob(path) if fs.isfile(p)]
            base = ""
        elif fs.isdir(path):
            paths = fs.find(path)
            base = path.rstrip("/")
        elif fs.isfile(path):
            return [url]
        else:
            raise DatasetError(f"dataset not found: {url} (check the path or URL)")
    except (OSError, PermissionError) as e:
        raise DatasetError(f"cannot list dataset {url}: {e}") from e

    def hidden(p: str) -> bool:
        rel = p[len(base):] if base and p.startswith(base) else posixpath.basename(p)
        return any(part.startswith(("_", ".")) for part in rel.split("/") if part)

    paths = sorted(p for p in paths if not hidden(p))
    if not paths:
        raise DatasetError(f"dataset not found: {url} matches no data files")
    has_protocol = "://" in url or "::" in url
    return [fs.unstrip_protocol(p) if has_protocol else p for p in paths]


class _ZstdStream:
    """read()/close() over pyarrow's zstd codec; closes the raw file too."""

    def __init__(self, raw: IO[bytes]):
        self._raw = raw
        self._stream = pa.CompressedInputStream(raw, "zstd")

    def read(self, n: int = -1) -> bytes:
        return self._stream.read() if n is None or n < 0 else self._stream.read(n)

    def close(self) -> None:
        self._stream.close()
        self._raw.close()


def open_binary(url: str) -> IO[bytes]:
    """A binary stream of the (decompressed) file; zstd falls back to pyarrow's codec."""
    comp = split_ext(url)[1]
    try:
        if comp == "zstd" and "zstd" not in fsspec.available_compressions():
            return _ZstdStream(fsspec.open(url, "rb").open())  # no zstandard package
        return fsspec.open(url, "rb", compression=comp).open()
    except FileNotFoundError as e:
        raise DatasetError(f"dataset not found: {url}") from e
    except ImportError as e:
        raise DatasetError(storage.missing_backend_message(url, e)) from e
    except (OSError, ValueError) as e:
        raise DatasetError(f"cannot open {url}: {e}") from e


@dataclass(frozen=True, slots=True)
class LongLine:
    """In place of a line over the bound: read, never held. quotes: its '"' characters, so that a CSV
    reader keeps its place in a quoted field that goes on past the line."""
    size: int       # its bytes, newline included
    quotes: int


def iter_lines(f: IO[bytes], max_bytes: int = SNIFF_LINE_BYTES) -> Iterator[bytes | LongLine]:
    """Lines (with their newline) from any object with read(n): one line held at a time, of at most
    max_bytes; a longer one is read through in chunks and given as a LongLine (linear, whatever its length)."""
    pending: list[bytes] = []  # pieces of a line that spans chunks (no quadratic copying)
    held = 0                   # bytes in pending
    long: LongLine | None = None    # the line being read through, once it is over max_bytes
    while chunk := f.read(_CHUNK):
        start = 0
        while start < len(chunk):
            nl = chunk.find(b"\n", start)
            end = len(chunk) if nl < 0 else nl + 1
            piece = chunk[start:end]
            start = end
            if long is None and held + len(piece) - (nl >= 0) > max_bytes:      # the newline not counted
                long = LongLine(held + len(piece), sum(p.count(b'"') for p in pending) + piece.count(b'"'))
                pending, held = [], 0
            elif long is not None:
                long = LongLine(long.size + len(piece), long.quotes + piece.count(b'"'))
            else:
                pending.append(piece)
                held += len(piece)
            if nl < 0:
                continue
            if long is not None:
                yield long
            else:
                yield pending[0] if len(pending) == 1 else b"".join(pending)
            pending, held, long = [], 0, None
    if long is not None:
        yield long
    elif pending:
        yield b"".join(pending)


def lines(url: str, max_bytes: int = SNIFF_LINE_BYTES) -> Iterator[bytes | LongLine]:
    """Raw lines of a text file, BOM removed, each a LongLine past max_bytes; read failures raise
    DatasetError."""
    f = open_binary(url)
    try:
        first = True
        it = iter_lines(f, max_bytes)
        while True:
            try:
                line = next(it)
            except StopIteration:
                return
            except READ_ERRORS as e:
                raise DatasetError(f"cannot read {url}: {type(e).__name__}: {e}") from e
            if first:
                first = False
                if isinstance(line, bytes) and line.startswith(b"\xef\xbb\xbf"):
                    line = line[3:]
            yield line
    finally:
        f.close()


def decode(line: bytes) -> tuple[str | None, str | None]:
    """(text, None) or (None, error) for one line."""
    try:
        return line.decode("utf-8"), None
    except UnicodeDecodeError as e:
        return None, f"invalid UTF-8 (byte 0x{line[e.start]:02x} at offset {e.start})"
