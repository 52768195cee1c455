"""Streaming dataset reading through fsspec: parquet, JSONL, CSV, OpenAI batch JSONL.

Invariants:
- Memory is bounded by one batch of rows (plus one parquet record batch or one
  line): nothing reads a whole file.
- Row.index is the 0-based row number over the whole dataset (files in
  list_files order, blank lines not counted), so it is stable across runs.
- A row that cannot be parsed (malformed JSON, invalid UTF-8, wrong CSV field
  count) or has no usable id (null, a list, another type than the ids': read_rows) becomes a Row
  with error set, naming its line (JSONL/CSV) or row number (parquet), its data kept when the
  record was parsed; reading goes on.  Problems with the dataset as a whole raise DatasetError
  with a message that says what to fix.
- Duplicate ids are passed through; the job reports them.

Modules: rows (Row, DatasetError, ids), files (listing, extensions, compression, lines),
formats (detect_format), one reader per format (jsonl, csv_reader, parquet; the OpenAI batch
records are parsed by jobrunner.openai.batch), reading (read_rows, dataset_columns,
input_types: the column types an output keeps), counting
(count_rows, rows_to_read).
"""

from jobrunner.dataset.counting import COUNT_MAX_BYTES, count_rows, rows_to_read
from jobrunner.dataset.files import list_files
from jobrunner.dataset.formats import FORMATS, detect_format
from jobrunner.dataset.reading import dataset_columns, input_types, read_rows
from jobrunner.dataset.rows import DatasetError, Row
from jobrunner.common.storage import missing_backend_message

__all__ = ["DatasetError", "Row", "FORMATS", "detect_format", "list_files",
           "dataset_columns", "input_types", "read_rows", "count_rows", "rows_to_read", "COUNT_MAX_BYTES", "missing_backend_message"]
