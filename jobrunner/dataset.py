"""Streaming dataset reading through fsspec: parquet, JSONL, CSV, OpenAI batch JSONL.

Invariants:
- Memory is bounded by one batch of rows (plus one parquet record batch or one
  line): nothing reads a whole file.
- Row.index is the 0-based row number over the whole dataset (files in
  list_files order, blank lines not counted), so it is stable across runs.
- A row that cannot be parsed (malformed JSON, invalid UTF-8, wrong CSV field
  count, null id) becomes a Row with data=None and error set, naming its line
  (JSONL/CSV) or row number (parquet); reading goes on.  Problems with the
  dataset as a whole raise DatasetError with a message that says what to fix.
- Duplicate ids are passed through; the job reports them.
"""

from __future__ import annotations

import csv
import json
import lzma
import posixpath
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

__all__ = ["DatasetError", "Row", "FORMATS", "detect_format", "list_files",
           "dataset_columns", "read_rows", "count_rows"]

FORMATS = ("parquet", "jsonl", "csv", "openai-batch")
_ALIASES = {"json": "jsonl", "ndjson": "jsonl", "openai": "openai-batch", "pq": "parquet",
            "tsv": "csv"}
_COMPRESSION = {".gz": "gzip", ".gzip": "gzip", ".zst": "zstd", ".zstd": "zstd",
                ".bz2": "bz2", ".xz": "xz"}
_EXTENSIONS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl",
               ".json": "jsonl", ".csv": "csv", ".tsv": "csv"}
_OPENAI_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
_SNIFF_LINES = 1000          # JSONL records looked at to list columns
_CHUNK = 1 << 20             # bytes per read() when splitting lines
_LOST_ID = "\0lost-id"       # reader's marker: the dataset has ids, this row's is unknown
csv.field_size_limit(2**31 - 1)  # huge cells are rows, not errors


class DatasetError(Exception):
    """The dataset as a whole can't be used; the message says what to fix."""


@dataclass(slots=True)         # slots: a planning window holds tens of thousands of rows
class Row:
    index: int                # 0-based row number in the dataset
    # id column's value as str, else str(index); OpenAI batch: custom_id.  An error
    # row of a dataset with ids whose id can't be recovered gets f"row-{index}", so it
    # can't collide with a real id like "1".
    id: str
    data: dict | None         # column -> value; None when the row could not be parsed
    error: str | None = None  # e.g. "line 17: invalid JSON: ..."


# ---------------------------------------------------------------- files


def _ext(path: str) -> tuple[str, str | None]:
    """(data extension like ".csv", compression or None), ignoring a URL query."""
    name = posixpath.basename(path.split("?")[0].rstrip("/")).lower()
    stem, ext = posixpath.splitext(name)
    comp = _COMPRESSION.get(ext)
    if comp:
        ext = posixpath.splitext(stem)[1]
    return ext, comp


def _split_ext(path: str) -> tuple[str | None, str | None]:
    """(format from extension or None, compression or None)."""
    ext, comp = _ext(path)
    return _EXTENSIONS.get(ext), comp


def _delimiter(url: str) -> str:
    return "\t" if _ext(url)[0] == ".tsv" else ","


_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}   # URL protocol -> jobrunner extra


def missing_backend_message(url: str, err: ImportError) -> str:
    """What to install when fsspec has no filesystem for url's protocol."""
    protocol = url.split("://", 1)[0].lower() if "://" in url else ""
    extra = _EXTRAS.get(protocol)
    hint = f"pip install 'jobrunner[{extra}]'" if extra else "install the fsspec backend it names"
    return f"cannot open {url}: {err} ({hint})"


def _fs(url: str) -> tuple[Any, str]:
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as e:
        raise DatasetError(missing_backend_message(url, e)) from e
    except ValueError as e:
        raise DatasetError(f"cannot open dataset {url!r}: {e}") from e


def list_files(url: str) -> list[str]:
    """Files of a dataset: a single file, a glob, or a directory of parts.

    Sorted; files and folders named `_*` or `.*` (e.g. _SUCCESS, .crc) are ignored.
    Returned as URLs with the protocol of `url` (plain paths for plain paths).
    """
    fs, path = _fs(url)
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


def _open_binary(url: str) -> IO[bytes]:
    """A binary stream of the (decompressed) file; zstd falls back to pyarrow's codec."""
    comp = _split_ext(url)[1]
    try:
        if comp == "zstd" and "zstd" not in fsspec.available_compressions():
            return _ZstdStream(fsspec.open(url, "rb").open())  # no zstandard package
        return fsspec.open(url, "rb", compression=comp).open()
    except FileNotFoundError as e:
        raise DatasetError(f"dataset not found: {url}") from e
    except ImportError as e:
        raise DatasetError(missing_backend_message(url, e)) from e
    except (OSError, ValueError) as e:
        raise DatasetError(f"cannot open {url}: {e}") from e


def _iter_lines(f: IO[bytes]) -> Iterator[bytes]:
    """Lines (with their newline) from any object with read(n); bounded by one line."""
    pending: list[bytes] = []  # pieces of a line that spans chunks (no quadratic copying)
    while chunk := f.read(_CHUNK):
        start = 0
        while (nl := chunk.find(b"\n", start)) >= 0:
            piece = chunk[start:nl + 1]
            if pending:
                pending.append(piece)
                piece, pending = b"".join(pending), []
            yield piece
            start = nl + 1
        if start < len(chunk):
            pending.append(chunk[start:])
    if pending:
        yield b"".join(pending)


def _lines(url: str) -> Iterator[bytes]:
    """Raw lines of a text file, BOM removed; read failures raise DatasetError."""
    f = _open_binary(url)
    try:
        first = True
        it = _iter_lines(f)
        while True:
            try:
                line = next(it)
            except StopIteration:
                return
            except (OSError, EOFError, ValueError, zlib.error, lzma.LZMAError) as e:
                # a truncated or corrupt compressed file, a network error...
                raise DatasetError(f"cannot read {url}: {type(e).__name__}: {e}") from e
            if first:
                first = False
                if line.startswith(b"\xef\xbb\xbf"):
                    line = line[3:]
            yield line
    finally:
        f.close()


# ---------------------------------------------------------------- format


def _norm_format(fmt: str) -> str:
    f = (fmt or "auto").lower()
    f = _ALIASES.get(f, f)
    if f != "auto" and f not in FORMATS:
        raise DatasetError(f"unknown format {fmt!r}; use one of auto, {', '.join(FORMATS)}")
    return f


def _is_openai_record(rec: Any) -> bool:
    return isinstance(rec, dict) and "custom_id" in rec and "body" in rec


def _first_record(url: str) -> Any:
    for line in _lines(url):
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
    found = {_split_ext(p)[0] for p in files}
    if None in found or len(found) != 1:
        odd = [posixpath.basename(p) for p in files if _split_ext(p)[0] is None][:3]
        why = f"unrecognized extension ({', '.join(odd)})" if odd else f"mixed formats {sorted(found)}"
        raise DatasetError(f"cannot tell the format of {url}: {why}; pass --format "
                           f"{'|'.join(FORMATS)}")
    f = found.pop()
    if f == "jsonl" and _is_openai_record(_first_record(files[0])):
        return "openai-batch"
    return f


# ---------------------------------------------------------------- parsing helpers


def _id_str(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)
    return str(value)


def _decode(line: bytes) -> tuple[str | None, str | None]:
    """(text, None) or (None, error) for one line."""
    try:
        return line.decode("utf-8"), None
    except UnicodeDecodeError as e:
        return None, f"invalid UTF-8 (byte 0x{line[e.start]:02x} at offset {e.start})"


def _where(name: str | None, lineno: int) -> str:
    return f"{name} line {lineno}" if name else f"line {lineno}"


def _jsonl_sniff(url: str) -> list[str]:
    """Union of the keys of the first object records, in first-seen order."""
    cols: dict[str, None] = {}
    for n, line in enumerate(_lines(url)):
        if n >= _SNIFF_LINES:
            break
        text, _ = _decode(line)
        if not text or not text.strip():
            continue
        try:
            rec = json.loads(text)
        except (ValueError, RecursionError):
            continue
        if isinstance(rec, dict):
            cols.update(dict.fromkeys(rec))
    return list(cols)


def _check_not_json_array(url: str) -> None:
    if _ext(url)[0] != ".json":
        return
    for line in _lines(url):
        if line.strip():
            if line.lstrip().startswith(b"["):
                raise DatasetError(f"{url} holds a JSON array, not JSON Lines: "
                                   "write one JSON object per line (.jsonl)")
            return


def _openai_data(rec: Any) -> tuple[str | None, dict | None, str | None]:
    """(custom_id, data, error) for one OpenAI batch input record."""
    if not isinstance(rec, dict):
        return None, None, f"expected a JSON object, got {type(rec).__name__}"
    cid = rec.get("custom_id")
    cid = None if cid is None else _id_str(cid)
    body = rec.get("body")
    if cid is None:
        return None, None, "OpenAI batch record without custom_id"
    if not isinstance(body, dict):
        return cid, None, "OpenAI batch record without a body object"
    url = rec.get("url")
    if url is not None and url not in _OPENAI_ENDPOINTS:
        return cid, None, f"unsupported endpoint {url!r} (supported: {', '.join(_OPENAI_ENDPOINTS)})"
    messages, prompt = body.get("messages"), body.get("prompt")
    if messages is None and prompt is None:
        return cid, None, "OpenAI batch body without messages (or prompt)"
    if messages is not None and not isinstance(messages, list):
        return cid, None, "OpenAI batch body: messages must be a list"
    params = {k: v for k, v in body.items() if k not in ("messages", "prompt", "model")}
    data = {"messages": messages, "params": params, "model": body.get("model")}
    if prompt is not None:
        data["prompt"] = prompt
    return cid, data, None


# ---------------------------------------------------------------- per-format readers
# Each yields (id or None, data or None, error or None), one per row; read_rows
# numbers them and fills default ids.


def _read_jsonl(url: str, name: str | None, id_column: str | None, has_id: bool,
                openai: bool) -> Iterator[tuple[str | None, dict | None, str | None]]:
    if not openai:
        _check_not_json_array(url)
    lost = _LOST_ID if (has_id or openai) else None
    for lineno, line in enumerate(_lines(url), start=1):
        text, err = _decode(line)
        if err:
            rid = _salvage_id(line, "custom_id" if openai else id_column, has_id or openai)
            yield rid, None, f"{_where(name, lineno)}: {err}"
            continue
        if not text.strip():
            continue  # blank lines are not rows
        try:
            rec = json.loads(text)
        except ValueError as e:
            yield lost, None, f"{_where(name, lineno)}: invalid JSON: {e}"
            continue
        except RecursionError:
            yield lost, None, f"{_where(name, lineno)}: invalid JSON: nested too deeply"
            continue
        if openai:
            cid, data, err = _openai_data(rec)
            yield (lost if cid is None else cid), data, (f"{_where(name, lineno)}: {err}" if err else None)
        elif not isinstance(rec, dict):
            yield lost, None, f"{_where(name, lineno)}: expected a JSON object, got {type(rec).__name__}"
        else:
            yield _row_id(rec, id_column, has_id, name, lineno)


def _row_id(rec: dict, id_column: str | None, has_id: bool, name: str | None,
            lineno: int, what: str = "line") -> tuple[str | None, dict | None, str | None]:
    if id_column is None or not has_id:
        return None, rec, None
    value = rec.get(id_column)
    if value is None:
        where = _where(name, lineno) if what == "line" else f"{name + ' ' if name else ''}row {lineno}"
        return _LOST_ID, rec, f"{where}: missing or null id column {id_column!r}"
    return _id_str(value), rec, None


def _salvage_id(line: bytes, key: str | None, has_id: bool) -> str | None:
    """The id of a record with invalid UTF-8, when the id itself is intact."""
    if not has_id or key is None:
        return None
    try:
        rec = json.loads(line.decode("utf-8", errors="replace"))
    except (ValueError, RecursionError):
        return _LOST_ID
    value = rec.get(key) if isinstance(rec, dict) else None
    rid = None if value is None else _id_str(value)
    return rid if rid is not None and "\ufffd" not in rid else _LOST_ID


def _csv_text_lines(url: str, bad: dict[int, str]) -> Iterator[str]:
    """Decoded lines for csv.reader; lines with invalid UTF-8 are recorded in `bad`."""
    for lineno, line in enumerate(_lines(url), start=1):
        text, err = _decode(line)
        if err:
            bad[lineno] = err
            text = line.decode("utf-8", errors="replace")
        yield text


def _csv_header(url: str) -> list[str]:
    reader = csv.reader(_csv_text_lines(url, {}), delimiter=_delimiter(url))
    for header in reader:
        if header:
            return header
    return []


def _read_csv(url: str, name: str | None, id_column: str | None,
              columns: Sequence[str] | None) -> Iterator[tuple[str | None, dict | None, str | None]]:
    # All cells are strings. Multi-line quoted cells are fine: a row's error names its last line.
    bad: dict[int, str] = {}
    reader = csv.reader(_csv_text_lines(url, bad), delimiter=_delimiter(url))
    header: list[str] | None = None
    has_id, keep = False, None
    start = 1  # first line of the record being read
    while True:
        try:
            cells = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            if header is None:
                raise DatasetError(f"cannot read the CSV header of {url}: {e}") from e
            yield (_LOST_ID if has_id else None), None, f"{_where(name, reader.line_num)}: invalid CSV: {e}"
            start = reader.line_num + 1
            continue
        end = reader.line_num
        if header is None:
            if not cells:
                start = end + 1
                continue
            if bad:
                raise DatasetError(f"CSV header of {url} is not valid UTF-8 (line {min(bad)})")
            if len(set(cells)) != len(cells):
                dup = sorted({c for c in cells if cells.count(c) > 1})
                raise DatasetError(f"CSV header of {url} repeats column names {dup}; rename them")
            header, start = cells, end + 1
            has_id = id_column is not None and id_column in header
            keep = None if columns is None else [c for c in header if c in columns or c == id_column]
            continue
        lines = range(start, end + 1)
        start = end + 1
        lost = _LOST_ID if has_id else None
        if bad and (errs := [(n, bad.pop(n)) for n in lines if n in bad]):
            n, err = errs[0]
            rid = lost
            if has_id and len(cells) == len(header):  # the id cell may be intact
                cell = cells[header.index(id_column)]
                rid = cell if "\ufffd" not in cell else lost
            yield rid, None, f"{_where(name, n)}: {err}"
            continue
        if not cells:
            continue  # blank line
        if len(cells) != len(header):
            yield lost, None, (f"{_where(name, end)}: expected {len(header)} fields "
                               f"(as in the header), got {len(cells)}")
            continue
        rec = dict(zip(header, cells))
        if keep is not None:
            rec = {c: rec[c] for c in keep}
        yield _row_id(rec, id_column, has_id, name, end)


def _parquet_file(url: str) -> tuple[IO[bytes], pq.ParquetFile]:
    if _split_ext(url)[1]:
        raise DatasetError(f"{url}: compressed parquet files are not supported "
                           "(parquet compresses internally); decompress it first")
    fs, path = _fs(url)
    if isinstance(fs, LocalFileSystem):  # native reads: faster, no Python calls from arrow threads
        try:
            f = pa.OSFile(path, "rb")
        except FileNotFoundError as e:
            raise DatasetError(f"dataset not found: {url}") from e
        except (OSError, pa.ArrowException) as e:
            raise DatasetError(f"cannot open {url}: {e}") from e
    else:
        f = _open_binary(url)
    try:
        return f, pq.ParquetFile(f)
    except (pa.ArrowException, OSError) as e:
        f.close()
        raise DatasetError(f"cannot read parquet file {url}: {e}") from e


def _read_parquet(url: str, name: str | None, id_column: str | None, columns: Sequence[str] | None,
                  batch_rows: int) -> Iterator[tuple[str | None, dict | None, str | None]]:
    f, pf = _parquet_file(url)
    try:
        names = pf.schema_arrow.names
        has_id = id_column is not None and id_column in names
        cols = None if columns is None else [c for c in names if c in columns or c == id_column]
        rownum = 0
        batches = pf.iter_batches(batch_size=batch_rows, columns=cols)
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except (pa.ArrowException, OSError) as e:
                raise DatasetError(f"cannot read parquet file {url}: {e}") from e
            for rec in batch.to_pylist():
                rownum += 1
                yield _row_id(rec, id_column, has_id, name, rownum, what="row")
    finally:
        f.close()


# ---------------------------------------------------------------- public API


def dataset_columns(url: str, fmt: str = "auto") -> list[str]:
    """Column names, from the first file's schema/header/first records (cheap)."""
    f = detect_format(url, fmt)
    first = list_files(url)[0]
    if f == "parquet":
        fh, pf = _parquet_file(first)
        try:
            return list(pf.schema_arrow.names)
        finally:
            fh.close()
    if f == "csv":
        return _csv_header(first)
    if f == "openai-batch":
        return ["messages", "params", "model"]
    _check_not_json_array(first)
    return _jsonl_sniff(first)


def read_rows(url: str, fmt: str = "auto", id_column: str | None = "id", batch_rows: int = 1024,
              columns: Sequence[str] | None = None) -> Iterator[list[Row]]:
    """Rows in batches of at most `batch_rows` (the last may be smaller).

    id_column: rows take their id from it when the dataset has that column (a
    null/missing value is then an error row); else, or with None, id = str(index).
    A caller that requires the column checks `dataset_columns` first.
    columns: keep only these (plus the id column); None keeps all.
    """
    if batch_rows < 1:
        raise ValueError("batch_rows must be >= 1")
    f = detect_format(url, fmt)
    files = list_files(url)
    id_col = None if f == "openai-batch" else id_column
    batch: list[Row] = []
    index = 0
    for path in files:
        name = posixpath.basename(path) if len(files) > 1 else None
        rows: Iterable[tuple[str | None, dict | None, str | None]]
        if f == "parquet":
            rows = _read_parquet(path, name, id_col, columns, batch_rows)
        elif f == "csv":
            rows = _read_csv(path, name, id_col, columns)
        else:
            has_id = id_col is not None and id_col in _jsonl_sniff(path)
            rows = _read_jsonl(path, name, id_col, has_id, openai=(f == "openai-batch"))
        for rid, data, err in rows:
            if data is not None and columns is not None and f == "jsonl":
                data = {k: v for k, v in data.items() if k in columns or k == id_col}
            if rid is None:
                rid = str(index)
            elif rid == _LOST_ID:
                rid = f"row-{index}"
            batch.append(Row(index, rid, None if err else data, err))
            index += 1
            if len(batch) >= batch_rows:
                yield batch
                batch = []
    if batch:
        yield batch


def count_rows(url: str, fmt: str = "auto") -> int | None:
    """The number of rows read_rows yields (error rows included), or None when counting is too dear.

    Parquet: from the footers.  JSONL and CSV: a scan of the raw bytes in large chunks, for files
    of at most COUNT_MAX_BYTES together (stored size; a remote dataset is read once more).
    """
    f = detect_format(url, fmt)
    files = list_files(url)
    if f == "parquet":
        total = 0
        for path in files:
            fh, pf = _parquet_file(path)
            try:
                total += pf.metadata.num_rows
            finally:
                fh.close()
        return total
    size = _stored_size(files)
    if size is None or size > COUNT_MAX_BYTES:
        return None
    count = _count_csv if f == "csv" else _count_jsonl
    return sum(count(path) for path in files)


COUNT_MAX_BYTES = 8 << 30   # count_rows scans text datasets up to this size
_COUNT_CHUNK = 8 << 20      # bytes per read() when counting


def _stored_size(files: list[str]) -> int | None:
    total = 0
    for path in files:
        fs, p = _fs(path)
        try:
            size = fs.size(p)
        except (OSError, NotImplementedError):
            return None
        if size is None:
            return None
        total += size
    return total


def _chunk_lines(url: str) -> Iterator[list[bytes]]:
    """The file's lines (newline removed, BOM removed), a large chunk's worth at a time."""
    f = _open_binary(url)
    tail, first = b"", True
    try:
        while chunk := f.read(_COUNT_CHUNK):
            if first:
                chunk, first = chunk.removeprefix(b"\xef\xbb\xbf"), False
            lines = (tail + chunk).split(b"\n")
            tail = lines.pop()      # a line that goes on in the next chunk
            yield lines
        if tail:
            yield [tail]            # the last line, without its newline
    except (OSError, EOFError, ValueError, zlib.error, lzma.LZMAError) as e:
        raise DatasetError(f"cannot read {url}: {type(e).__name__}: {e}") from e
    finally:
        f.close()


def _count_jsonl(url: str) -> int:
    # a JSON record holds no raw newline: every line that isn't blank is a row (an error row if bad)
    return sum(sum(1 for line in lines if line.strip()) for lines in _chunk_lines(url))


def _count_csv(url: str) -> int:
    # Without a quote character a line is a record (an error row if bad) and an empty line is
    # skipped; the first record is the header.  A quoted cell may hold newlines: then parse.
    n = 0
    for lines in _chunk_lines(url):
        if any(b'"' in line for line in lines):
            return sum(1 for _ in _read_csv(url, None, None, None))
        n += sum(1 for line in lines if line not in (b"", b"\r"))
    return max(n - 1, 0)
