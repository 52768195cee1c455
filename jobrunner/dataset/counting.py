"""count_rows: how many rows a dataset has, when that is cheap enough to find out before reading it."""

from __future__ import annotations

from collections.abc import Iterator

from jobrunner.dataset.csv_reader import read_csv
from jobrunner.dataset.files import READ_ERRORS, list_files, open_binary, open_fs
from jobrunner.dataset.formats import detect_format
from jobrunner.dataset.parquet import parquet_rows
from jobrunner.dataset.rows import DatasetError

COUNT_MAX_BYTES = 8 << 30   # count_rows scans text datasets up to this size
_COUNT_CHUNK = 8 << 20      # bytes per read() when counting


def count_rows(url: str, fmt: str = "auto") -> int | None:
    """The number of rows read_rows yields (error rows included), or None when counting is too dear.

    Parquet: from the footers.  JSONL and CSV: a scan of the raw bytes in large chunks, for files
    of at most COUNT_MAX_BYTES together (stored size; a remote dataset is read once more).
    """
    f = detect_format(url, fmt)
    files = list_files(url)
    if f == "parquet":
        return sum(parquet_rows(path) for path in files)
    size = _stored_size(files)
    if size is None or size > COUNT_MAX_BYTES:
        return None
    count = _count_csv if f == "csv" else _count_jsonl
    return sum(count(path) for path in files)


def rows_to_read(source, fmt: str) -> int | None:
    """The rows a job reads of `source` (the config's input section: its dataset, at most its --limit);
    None when they cannot be counted cheaply."""
    try:
        n = count_rows(source.dataset, fmt)
    except Exception:  # noqa: BLE001 - a count is informative only (a progress bar's total)
        return None
    return min(n, source.limit) if (n is not None and source.limit) else n


def _stored_size(files: list[str]) -> int | None:
    total = 0
    for path in files:
        fs, p = open_fs(path)
        try:
            size = fs.size(p)
        except (OSError, NotImplementedError):
            return None
        if size is None:
            return None
        total += size
    return total


def _line_marks(url: str) -> Iterator[tuple[int, int, bool]]:
    """Per large chunk of the file (BOM removed): (the lines ending in it that are not blank, those that
    are not empty (b"" or b"\\r"), whether it holds a quote); last, the line after the last newline's. A
    line's bytes are never joined: one line of any length is counted in one pass, one chunk held."""
    f = open_binary(url)
    blank, start = True, b""    # the line so far: all whitespace; its bytes while it has at most one, else None
    first = True
    try:
        while chunk := f.read(_COUNT_CHUNK):
            if first:
                chunk, first = chunk.removeprefix(b"\xef\xbb\xbf"), False
            pieces = chunk.split(b"\n")
            not_blank = not_empty = 0
            for piece in pieces[:-1]:       # each ends a line
                not_blank += not (blank and not piece.strip())
                not_empty += not (start is not None and len(start) + len(piece) <= 1
                                  and start + piece in (b"", b"\r"))
                blank, start = True, b""
            tail = pieces[-1]               # a line that goes on in the next chunk
            blank = blank and not tail.strip()
            start = start + tail if start is not None and len(start) + len(tail) <= 1 else None
            yield not_blank, not_empty, b'"' in chunk
        yield int(not blank), int(not (start is not None and start in (b"", b"\r"))), False
    except READ_ERRORS as e:
        raise DatasetError(f"cannot read {url}: {type(e).__name__}: {e}") from e
    finally:
        f.close()


def _count_jsonl(url: str) -> int:
    # a JSON record holds no raw newline: every line that isn't blank is a row (an error row if bad)
    return sum(not_blank for not_blank, _, _ in _line_marks(url))


def _count_csv(url: str) -> int:
    # Without a quote character a line is a record (an error row if bad) and an empty line is
    # skipped; the first record is the header.  A quoted cell may hold newlines: then parse.
    n = 0
    for _, not_empty, quoted in _line_marks(url):
        if quoted:
            return sum(1 for _ in read_csv(url, None, None, None))
        n += not_empty
    return max(n - 1, 0)
