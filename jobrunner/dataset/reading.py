"""read_rows and dataset_columns: any format's rows, numbered over the whole dataset."""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Iterator, Sequence

from jobrunner import openai_batch
from jobrunner.dataset.csv_reader import csv_header, read_csv
from jobrunner.dataset.files import list_files
from jobrunner.dataset.formats import detect_format
from jobrunner.dataset.jsonl import check_not_json_array, jsonl_columns, read_jsonl
from jobrunner.dataset.parquet import parquet_columns, read_parquet
from jobrunner.dataset.rows import LOST_ID, Row

# Each format's reader yields (id or None, data or None, error or None), one per row; read_rows
# numbers them and fills default ids.
_Parsed = Iterable[tuple[str | None, dict | None, str | None]]


def dataset_columns(url: str, fmt: str = "auto") -> list[str]:
    """Column names, from the first file's schema/header/first records (cheap)."""
    f = detect_format(url, fmt)
    first = list_files(url)[0]
    if f == "parquet":
        return parquet_columns(first)
    if f == "csv":
        return csv_header(first)
    if f == openai_batch.FORMAT:
        return list(openai_batch.COLUMNS)
    check_not_json_array(first)
    return jsonl_columns(first)


def _parsed(f: str, path: str, name: str | None, id_col: str | None, columns: Sequence[str] | None,
            batch_rows: int) -> _Parsed:
    """The rows of one file of a dataset in format f."""
    if f == "parquet":
        return read_parquet(path, name, id_col, columns, batch_rows)
    if f == "csv":
        return read_csv(path, name, id_col, columns)
    has_id = id_col is not None and id_col in jsonl_columns(path)
    return read_jsonl(path, name, id_col, has_id, openai=(f == openai_batch.FORMAT))


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
    id_col = None if f == openai_batch.FORMAT else id_column
    batch: list[Row] = []
    index = 0
    for path in files:
        name = posixpath.basename(path) if len(files) > 1 else None
        for rid, data, err in _parsed(f, path, name, id_col, columns, batch_rows):
            if data is not None and columns is not None and f == "jsonl":
                data = {k: v for k, v in data.items() if k in columns or k == id_col}
            if rid is None:
                rid = str(index)
            elif rid == LOST_ID:
                rid = f"row-{index}"
            batch.append(Row(index, rid, None if err else data, err))
            index += 1
            if len(batch) >= batch_rows:
                yield batch
                batch = []
    if batch:
        yield batch
