"""Parquet: record batches read one at a time, only the columns asked for; a row over --max-row-bytes
sized from its columns' offsets and turned into an error row before any of it becomes Python."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import IO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from jobrunner.dataset.files import DEFAULT_MAX_ROW_BYTES, open_binary, open_fs, split_ext
from jobrunner.dataset.rows import LOST_ID, DatasetError, id_problem, row_id, too_long


def parquet_file(url: str) -> tuple[IO[bytes], pq.ParquetFile]:
    """(the open file, which the caller closes; the ParquetFile over it)."""
    if split_ext(url)[1]:
        raise DatasetError(f"{url}: compressed parquet files are not supported "
                           "(parquet compresses internally); decompress it first")
    fs, path = open_fs(url)
    if isinstance(fs, LocalFileSystem):  # native reads: faster, no Python calls from arrow threads
        try:
            f = pa.OSFile(path, "rb")
        except FileNotFoundError as e:
            raise DatasetError(f"dataset not found: {url}") from e
        except (OSError, pa.ArrowException) as e:
            raise DatasetError(f"cannot open {url}: {e}") from e
    else:
        f = open_binary(url)
    try:
        return f, pq.ParquetFile(f)
    except (pa.ArrowException, OSError) as e:
        f.close()
        raise DatasetError(f"cannot read parquet file {url}: {e}") from e


def parquet_columns(url: str) -> list[str]:
    """The file's column names, from its footer."""
    return list(parquet_schema(url).names)


def parquet_schema(url: str) -> pa.Schema:
    """The file's Arrow schema, from its footer."""
    fh, pf = parquet_file(url)
    try:
        return pf.schema_arrow
    finally:
        fh.close()


def parquet_rows(url: str) -> int:
    """The file's number of rows, from its footer."""
    fh, pf = parquet_file(url)
    try:
        return pf.metadata.num_rows
    finally:
        fh.close()


def read_parquet(url: str, name: str | None, id_column: str | None, columns: Sequence[str] | None,
                 batch_rows: int,
                 max_row_bytes: int = DEFAULT_MAX_ROW_BYTES) -> Iterator[tuple[object, dict | None, str | None]]:
    """(id value or None, data, error or None) per row; errors name the row number in the file. A row of
    more than max_row_bytes (its cells' bytes, from Arrow's offsets) is an error row, never made Python."""
    f, pf = parquet_file(url)
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
            sizes = sum((_row_bytes(c) for c in batch.columns), np.zeros(batch.num_rows, np.int64))
            fits = sizes <= max_row_bytes
            records = iter(batch.filter(pa.array(fits)).to_pylist() if not fits.all() else batch.to_pylist())
            for i in range(batch.num_rows):
                rownum += 1
                if fits[i]:
                    yield row_id(next(records), id_column, has_id, name, rownum, what="row")
                else:
                    place = f"{name + ' ' if name else ''}row {rownum}"
                    yield (_id_of(batch, i, id_column, max_row_bytes) if has_id else None, None,
                           f"{place}: {too_long(int(sizes[i]), max_row_bytes)}")
    finally:
        f.close()


def _id_of(batch: pa.RecordBatch, i: int, id_column: str, max_row_bytes: int) -> object:
    """Row i's id, where it is a scalar within the bound; else LOST_ID."""
    cell = batch.column(id_column).slice(i, 1)
    if _row_bytes(cell)[0] > max_row_bytes:
        return LOST_ID
    value = cell.to_pylist()[0]
    return LOST_ID if value is None or id_problem(value, None) is not None else value


def _row_bytes(array: pa.Array) -> np.ndarray:
    """Each row's bytes in a column, [len(array)] int64, from the offsets and the widths: no value is
    converted. A list's rows add up their items', a struct's its fields'; a null counts nothing."""
    t = array.type
    if pa.types.is_dictionary(t):
        array, t = array.indices, array.indices.type
    if (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
            or pa.types.is_large_binary(t)):
        return pc.binary_length(array).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_map(t):
        items = np.concatenate([[0], np.cumsum(_row_bytes(array.values))])
        offsets = array.offsets.to_numpy()
        return items[offsets[1:]] - items[offsets[:-1]]
    if pa.types.is_fixed_size_list(t):
        return _row_bytes(array.flatten()).reshape(len(array), t.list_size).sum(axis=1)
    if pa.types.is_struct(t):
        return sum((_row_bytes(field) for field in array.flatten()), np.zeros(len(array), np.int64))
    try:
        width = max(t.bit_width // 8, 1)
    except ValueError:      # null, union, view types: a value's text is what is left to bound, and small
        width = 8
    return np.full(len(array), width, np.int64)
