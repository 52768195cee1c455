"""Parquet: record batches read one at a time, only the columns asked for."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import IO

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from jobrunner.dataset.files import open_binary, open_fs, split_ext
from jobrunner.dataset.rows import DatasetError, row_id


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
                 batch_rows: int) -> Iterator[tuple[object, dict | None, str | None]]:
    """(id value or None, data, error or None) per row; errors name the row number in the file."""
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
            for rec in batch.to_pylist():
                rownum += 1
                yield row_id(rec, id_column, has_id, name, rownum, what="row")
    finally:
        f.close()
