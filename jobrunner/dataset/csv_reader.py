"""CSV and TSV (by extension): a header line, then records; every cell is a string.

The delimiter: the job's --csv-delimiter, else a tab for .tsv, else sniffed from the header line
(the most frequent of , ; tab | outside quotes; a comma when none is there), so a semicolon CSV
as spreadsheets in many locales export it reads as it is.

Multi-line quoted cells are fine: a row's error names its last line. A record over --max-row-bytes is an
error row, its lines past the bound read through and never held (`_Lines`).  An unclosed quote is not
(it would swallow the rest of the file into one cell): check_quotes finds it before any row runs.
(Named csv_reader so that `import csv` here is the standard library's.)
"""

from __future__ import annotations

import csv
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from jobrunner.dataset.files import DEFAULT_MAX_ROW_BYTES, SNIFF_LINE_BYTES, LongLine, decode, ext, lines, list_files
from jobrunner.dataset.rows import LOST_ID, DatasetError, row_id, too_long, where

csv.field_size_limit(2**31 - 1)  # huge cells are rows, not errors


@dataclass(frozen=True, slots=True)
class _Header:
    names: list[str]
    id_column: str | None
    has_id: bool              # the id column is one of names
    keep: list[str] | None    # the columns read_csv keeps (None: all)


SNIFFED = (",", ";", "\t", "|")


def _delimiter(url: str, given: str | None) -> str:
    if given is not None:
        return given
    if ext(url)[0] == ".tsv":
        return "\t"
    return sniff_delimiter(url)


def sniff_delimiter(url: str) -> str:
    """The most frequent of SNIFFED outside quotes in the first non-empty line (a comma on ties or none)."""
    for line in lines(url):
        if isinstance(line, LongLine):
            continue
        text = decode(line)[0] or line.decode("utf-8", errors="replace")
        if not text.strip():
            continue
        unquoted = "".join(text.split('"')[::2])
        counts = {d: unquoted.count(d) for d in SNIFFED}
        best = max(SNIFFED, key=lambda d: (counts[d], d == ","))
        return best if counts[best] else ","
    return ","


class _Lines:
    """Decoded lines for csv.reader; lines with invalid UTF-8 are recorded in `bad`, and so is each line
    of a record past max_bytes (its lines since `new_record`), given to the reader as only its quotes'
    parity: the record ends where it did, its cells are never held whole."""

    def __init__(self, url: str, max_bytes: int = SNIFF_LINE_BYTES):
        self.bad: dict[int, str] = {}
        self.max_bytes = max_bytes
        self._record_bytes = 0
        self._lines = self._read(url)

    def __iter__(self) -> Iterator[str]:
        return self._lines

    def new_record(self) -> None:
        self._record_bytes = 0

    def _read(self, url: str) -> Iterator[str]:
        for lineno, line in enumerate(lines(url, self.max_bytes), start=1):
            long = isinstance(line, LongLine)
            self._record_bytes += line.size if long else len(line)
            if long or self._record_bytes > self.max_bytes:
                self.bad.setdefault(lineno, too_long(self._record_bytes, self.max_bytes))
                yield '"' * ((line.quotes if long else line.count(b'"')) % 2) + "\n"
                continue
            text, err = decode(line)
            if err:
                self.bad[lineno] = err
                text = line.decode("utf-8", errors="replace")
            yield text


def check_quotes(url: str, max_lines: int, delimiter: str | None = None) -> None:
    """DatasetError naming the line where a quoted field opens that runs to the end of the file, or
    over more than max_lines lines (an unclosed quote that a later quote happens to close)."""
    for path in list_files(url):
        source = _Lines(path)
        reader = csv.reader(source, delimiter=_delimiter(path, delimiter), strict=True)
        start = 1       # the first line of the record being read
        while True:
            source.new_record()
            try:
                next(reader)
            except StopIteration:
                break
            except csv.Error as e:
                if "unexpected end of data" in str(e):
                    raise DatasetError(f"{path} line {start}: a quoted field opens here and is never closed "
                                       "(it runs to the end of the file); close the quote, or write a quote "
                                       "inside a quoted field as \"\"") from None
                # another quoting fault: read_csv makes its row an error row
            if reader.line_num - start + 1 > max_lines:
                raise DatasetError(f"{path} line {start}: a quoted field opens here and runs over "
                                   f"{reader.line_num - start + 1} lines, more than --csv-max-lines {max_lines}; "
                                   "close the quote, or raise --csv-max-lines if a cell is really that long")
            start = reader.line_num + 1


def csv_header(url: str, delimiter: str | None = None) -> list[str]:
    """The column names: the first non-empty record."""
    reader = csv.reader(_Lines(url), delimiter=_delimiter(url, delimiter))
    for header in reader:
        if header:
            return header
    return []


def _header(url: str, cells: list[str], bad: dict[int, str], id_column: str | None,
            columns: Sequence[str] | None) -> _Header:
    """The header record, checked (valid UTF-8, distinct names)."""
    if bad:
        raise DatasetError(f"CSV header of {url}: line {min(bad)}: {bad[min(bad)]}")
    if len(set(cells)) != len(cells):
        dup = sorted({c for c in cells if cells.count(c) > 1})
        raise DatasetError(f"CSV header of {url} repeats column names {dup}; rename them")
    has_id = id_column is not None and id_column in cells
    keep = None if columns is None else [c for c in cells if c in columns or c == id_column]
    return _Header(cells, id_column, has_id, keep)


def _row(cells: list[str], first: int, last: int, h: _Header, bad: dict[int, str],
         name: str | None) -> tuple[str | None, dict | None, str | None] | None:
    """A reader's (id, data, error) for the record on lines first..last; None for a blank line."""
    lost = LOST_ID if h.has_id else None
    if bad and (errs := [(n, bad.pop(n)) for n in range(first, last + 1) if n in bad]):
        n, err = errs[0]
        rid = lost
        if h.has_id and len(cells) == len(h.names):  # the id cell may be intact
            cell = cells[h.names.index(h.id_column)]
            rid = cell if "\ufffd" not in cell else lost
        return rid, None, f"{where(name, n)}: {err}"
    if not cells:
        return None  # blank line
    if len(cells) != len(h.names):
        return lost, None, (f"{where(name, last)}: expected {len(h.names)} fields "
                            f"(as in the header), got {len(cells)}")
    rec = dict(zip(h.names, cells))
    if h.keep is not None:
        rec = {c: rec[c] for c in h.keep}
    return row_id(rec, h.id_column, h.has_id, name, last)


def read_csv(url: str, name: str | None, id_column: str | None, columns: Sequence[str] | None,
             delimiter: str | None = None,
             max_row_bytes: int = DEFAULT_MAX_ROW_BYTES) -> Iterator[tuple[str | None, dict | None, str | None]]:
    """(id or None, data or None, error or None) per record after the header; a record over
    max_row_bytes is an error row."""
    source = _Lines(url, max_row_bytes)
    bad = source.bad
    reader = csv.reader(source, delimiter=_delimiter(url, delimiter))
    h: _Header | None = None
    start = 1  # first line of the record being read
    while True:
        source.new_record()
        try:
            cells = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            if h is None:
                raise DatasetError(f"cannot read the CSV header of {url}: {e}") from e
            yield (LOST_ID if h.has_id else None), None, f"{where(name, reader.line_num)}: invalid CSV: {e}"
            start = reader.line_num + 1
            continue
        first, start = start, reader.line_num + 1
        if h is None:
            if cells:
                h = _header(url, cells, bad, id_column, columns)
        elif (row := _row(cells, first, reader.line_num, h, bad, name)) is not None:
            yield row
