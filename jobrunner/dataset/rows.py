"""A dataset row, the dataset's error, and how a row gets its id."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

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
    data: dict | None         # column -> value; None when the row could not be parsed
    error: str | None = None  # e.g. "line 17: invalid JSON: ..."


def id_str(value: Any) -> str:
    """A row's id from its id column's value (containers as canonical JSON)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)
    return str(value)


def where(name: str | None, lineno: int) -> str:
    """How an error names a line: "line 7", or "part-1.jsonl line 7" in a dataset of several files."""
    return f"{name} line {lineno}" if name else f"line {lineno}"


def row_id(rec: dict, id_column: str | None, has_id: bool, name: str | None,
           lineno: int, what: str = "line") -> tuple[str | None, dict | None, str | None]:
    """A reader's (id or None, data, error) for a parsed record; a missing id is an error row.

    lineno is a line number (what="line", JSONL and CSV) or a row number (what="row", parquet).
    """
    if id_column is None or not has_id:
        return None, rec, None
    value = rec.get(id_column)
    if value is None:
        place = where(name, lineno) if what == "line" else f"{name + ' ' if name else ''}row {lineno}"
        return LOST_ID, rec, f"{place}: missing or null id column {id_column!r}"
    return id_str(value), rec, None
