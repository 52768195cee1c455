"""A dataset row, the dataset's error, and how a row gets its id."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jobrunner.jobs.row import NO_OPTIONS, RowOptions
from jobrunner.output.values import id_key

# A reader's marker for "the dataset has ids, this row's is unknown"; read_rows turns it into
# f"row-{index}".  (A reader yields None instead when the dataset has no ids: id = str(index).)
LOST_ID = "\0lost-id"


class DatasetError(Exception):
    """The dataset as a whole can't be used; the message says what to fix."""


@dataclass(slots=True)         # slots: a planning window holds tens of thousands of rows
class Row:
    index: int                # 0-based row number in the dataset
    # id column's value as str, else str(index); OpenAI batch: custom_id.  An error
    # row of a dataset with ids whose id can't be recovered gets f"row-{index}", so it
    # can't collide with a real id like "1".
    id: str
    data: dict | None         # column -> value; None when the row could not be parsed (an error row
                              # that could be parsed, e.g. with a null id, keeps its data)
    error: str | None = None  # e.g. "line 17: invalid JSON: ..."
    id_value: Any = None      # the id as the output's id column holds it: the id column's value, typed
                              # as the input has it (Parquet Int64: an int); None: `id` itself
    options: RowOptions = NO_OPTIONS    # what the row asks beyond the job's settings (an OpenAI line's
                                        # body: jobrunner.openai.rows); the job kinds read it


id_str = id_key     # a row's id (its key) from its id column's value (containers as canonical JSON)

# JSON types an id may have; a JSONL dataset's ids all have its first id's (JSONL_ID_TYPES' names)
JSONL_ID_TYPES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean"}


def id_problem(value: Any, id_type: type | None) -> str | None:
    """Why `value` is no id (a list or an object; in JSONL another type than the dataset's ids'),
    or None. id_type: the JSONL dataset's id type; None: any scalar."""
    if isinstance(value, (list, tuple, dict)):
        return f"id {id_key(value)} is {'an object' if isinstance(value, dict) else 'a list'}, not a scalar"
    if id_type is not None and type(value) is not id_type:
        what = JSONL_ID_TYPES.get(type(value), f"a {type(value).__name__}")
        return (f"id {id_key(value)!r} is {what}, but this dataset's first id is {JSONL_ID_TYPES[id_type]}: "
                "ids of one dataset share one type, so that 1 and \"1\" never collide")
    return None


def too_long(size: int, max_row_bytes: int) -> str:
    """The error of a line, cell or row over --max-row-bytes."""
    return (f"{size} bytes, over --max-row-bytes {max_row_bytes}: the row is not read "
            "(raise --max-row-bytes to run it)")


def where(name: str | None, lineno: int) -> str:
    """How an error names a line: "line 7", or "part-1.jsonl line 7" in a dataset of several files."""
    return f"{name} line {lineno}" if name else f"line {lineno}"


def row_id(rec: dict, id_column: str | None, has_id: bool, name: str | None,
           lineno: int, what: str = "line", id_type: type | None = None) -> tuple[Any, dict | None, str | None]:
    """A reader's (id value or None, data, error) for a parsed record; a missing, null or non-scalar
    id (or, in JSONL, one of another type than id_type) is an error row that keeps its data.

    lineno is a line number (what="line", JSONL and CSV) or a row number (what="row", parquet).
    """
    if id_column is None or not has_id:
        return None, rec, None
    value = rec.get(id_column)
    place = where(name, lineno) if what == "line" else f"{name + ' ' if name else ''}row {lineno}"
    if value is None:
        return LOST_ID, rec, f"{place}: missing or null id column {id_column!r}"
    problem = id_problem(value, id_type)
    if problem is not None:
        return LOST_ID, rec, f"{place}: {problem}"
    return value, rec, None
