"""A job's output schema, declared before any row is written, so that every part has it whatever
rows it holds (failed rows finish first): the id and the input columns with their input types
(as jobrunner.dataset.input_types reads them), the fixed columns, `reused`, and every column the job kind declares
(its `result_columns`: name -> kind, jobrunner.output.values), null where a row has no value."""
from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa

from jobrunner.output.columns import SPECULATION_COLUMNS, input_names, reserved_columns
from jobrunner.output.values import ARROW, FIXED_COLUMNS, arrow_schema, vector_kind

if TYPE_CHECKING:
    from jobrunner.jobs.kind import JobKind

COMMON_COLUMNS = {"reused": "bool"}     # every job row has it, after the fixed and input columns
VECTOR = "vector"                       # a kind's float32 vector column: its size from the job (vector_size)
_KINDS = {pa.string(): "string", pa.int64(): "int", pa.float64(): "float", pa.bool_(): "bool"}


def column_kind(t: pa.DataType | None) -> str:
    """A column's kind from its input type: the plain kinds for their own types (a JSONL column's
    values fit them as values.py says), "json" for JSON values (None), else the type itself."""
    if t is None:
        return "json"
    return _KINDS.get(t, ARROW)


def declared_schema(id_type: pa.DataType, inputs: dict[str, pa.DataType | None],
                    kind_columns: dict[str, str]) -> pa.Schema:
    """The schema of a job's parts; inputs: output name -> input type; kind_columns: name -> kind."""
    kinds = {"id": column_kind(id_type), **{n: k for n, k in FIXED_COLUMNS.items() if n != "id"}}
    types = {"id": id_type}
    for name, t in inputs.items():
        kinds[name] = column_kind(t)
        types[name] = t
    kinds.update(COMMON_COLUMNS)
    kinds.update(kind_columns)
    return arrow_schema(kinds, types)


def result_schema(input_columns: tuple, id_column: str, job: JobKind, hidden_size: int | None,
                  speculative: bool = False) -> pa.Schema:
    """The declared schema of a job of kind `job` (jobs.KINDS) over a dataset of `input_columns` ((the
    id's type, column -> type), as jobrunner.dataset.input_types reads them); hidden_size: the model's,
    the size of an embedding unless the job says otherwise (--dimensions); speculative: the rows say their
    drafted and accepted tokens (SPECULATION_COLUMNS)."""
    id_type, types = input_columns
    columns = [c for c in types if c != id_column]
    names = input_names(columns, reserved_columns(job.result_columns))
    kinds = {n: vector_kind(job.vector_size(hidden_size)) if k == VECTOR else k
             for n, k in job.result_columns.items()}
    if speculative:
        kinds.update(dict.fromkeys(SPECULATION_COLUMNS, "int"))
    return declared_schema(id_type, {names[c]: types[c] for c in columns}, kinds)
