"""read_rows and dataset_columns: any format's rows, numbered over the whole dataset."""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import pyarrow as pa

from jobrunner.openai import batch as openai_batch
from jobrunner.dataset.csv_reader import csv_header, read_csv
from jobrunner.dataset.files import DEFAULT_MAX_ROW_BYTES, list_files
from jobrunner.dataset.formats import detect_format
from jobrunner.dataset.jsonl import check_not_json_array, jsonl_columns, jsonl_types, read_jsonl
from jobrunner.dataset.parquet import parquet_columns, parquet_schema, read_parquet
from jobrunner.dataset.rows import LOST_ID, Row, id_str
from jobrunner.openai.row_options import row_options
from jobrunner.jobs.row import NO_OPTIONS

# Each format's reader yields (id value or None, data or None, error or None), one per row; read_rows
# numbers them, gives each its key (id_str of the value) and fills default ids.
_Parsed = Iterable[tuple[Any, dict | None, str | None]]
# OpenAI batch rows' data (openai_batch.parse_record, openai_embeddings): None: JSON values
_OPENAI_TYPES = {"messages": None, "params": None, "model": pa.string(), "prompt": pa.string(), "input": None,
                 "endpoint": pa.string(), "line": pa.int64()}


def dataset_columns(url: str, fmt: str = "auto", csv_delimiter: str | None = None) -> list[str]:
    """Column names, from the first file's schema/header/first records (cheap). csv_delimiter: None
    for a CSV's own (csv_reader: by extension, else sniffed)."""
    f = detect_format(url, fmt)
    first = list_files(url)[0]
    if f == "parquet":
        return parquet_columns(first)
    if f == "csv":
        return csv_header(first, csv_delimiter)
    if f == openai_batch.FORMAT:
        return list(openai_batch.COLUMNS)
    check_not_json_array(first)
    return jsonl_columns(first)


def input_types(url: str, fmt: str, id_column: str | None,
                csv_delimiter: str | None = None) -> tuple[pa.DataType, dict[str, pa.DataType | None]]:
    """(the id column's Arrow type, each column's) as the output keeps them, from the first file:
    Parquet's own schema; CSV: strings; JSONL: as jsonl_types infers them from the first records
    (None: JSON values). Rows numbered by index (no id column) have string ids."""
    f = detect_format(url, fmt)
    first = list_files(url)[0]
    if f == openai_batch.FORMAT:
        return pa.string(), dict(_OPENAI_TYPES)
    if f == "parquet":
        types = {field.name: field.type for field in parquet_schema(first)}
    elif f == "csv":
        types = dict.fromkeys(csv_header(first, csv_delimiter), pa.string())
    else:
        check_not_json_array(first)
        id_type, types = jsonl_types(first, id_column)
        if id_column in types:
            types[id_column] = {str: pa.string(), int: pa.int64(), float: pa.float64(),
                                bool: pa.bool_()}.get(id_type, pa.string())
    return (types.get(id_column) or pa.string()), types


def _parsed(f: str, path: str, name: str | None, id_col: str | None, columns: Sequence[str] | None,
            batch_rows: int, id_type: type | None, csv_delimiter: str | None, max_row_bytes: int) -> _Parsed:
    """The rows of one file of a dataset in format f."""
    if f == "parquet":
        return read_parquet(path, name, id_col, columns, batch_rows, max_row_bytes)
    if f == "csv":
        return read_csv(path, name, id_col, columns, csv_delimiter, max_row_bytes)
    has_id = id_col is not None and id_col in jsonl_columns(path)
    return read_jsonl(path, name, id_col, has_id, openai=(f == openai_batch.FORMAT), id_type=id_type,
                      max_row_bytes=max_row_bytes)


def read_rows(url: str, fmt: str = "auto", id_column: str | None = "id", batch_rows: int = 1024,
              columns: Sequence[str] | None = None, csv_delimiter: str | None = None,
              max_row_bytes: int = DEFAULT_MAX_ROW_BYTES) -> Iterator[list[Row]]:
    """Rows in batches of at most `batch_rows` (the last may be smaller).

    id_column: rows take their id from it when the dataset has that column (a null, missing or
    non-scalar value is then an error row that keeps its data; in JSONL so is an id of another type
    than the first file's first id: 1 and "1" never collide); else, or with None, id = str(index).
    Row.id is the id's key (a str), Row.id_value its value as the input has it.
    A caller that requires the column checks `dataset_columns` first.
    columns: keep only these (plus the id column); None keeps all.
    csv_delimiter: a CSV's delimiter; None: its own (csv_reader: by extension, else sniffed).
    max_row_bytes: a longer line (JSONL), record (CSV) or row (Parquet) is an error row, never held whole.
    """
    if batch_rows < 1:
        raise ValueError("batch_rows must be >= 1")
    f = detect_format(url, fmt)
    files = list_files(url)
    id_col = None if f == openai_batch.FORMAT else id_column
    id_type = jsonl_types(files[0], id_col)[0] if f == "jsonl" and id_col is not None else None
    batch: list[Row] = []
    index = 0
    for path in files:
        name = posixpath.basename(path) if len(files) > 1 else None
        for value, data, err in _parsed(f, path, name, id_col, columns, batch_rows, id_type, csv_delimiter,
                                        max_row_bytes):
            if data is not None and columns is not None and f == "jsonl":
                data = {k: v for k, v in data.items() if k in columns or k == id_col}
            if value is None:
                value = str(index)
            elif isinstance(value, str) and value == LOST_ID:
                value = f"row-{index}"      # the id column's type may not hold it: see output/values.py
            options = row_options(data) if data is not None and f == openai_batch.FORMAT else NO_OPTIONS
            batch.append(Row(index, id_str(value), data, err, value, options))
            index += 1
            if len(batch) >= batch_rows:
                yield batch
                batch = []
    if batch:
        yield batch
