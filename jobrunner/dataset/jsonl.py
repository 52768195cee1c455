"""JSON Lines: one object a line; OpenAI batch input is JSONL whose records openai_batch parses."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pyarrow as pa

from jobrunner.openai import batch as openai_batch
from jobrunner.dataset.files import DEFAULT_MAX_ROW_BYTES, LongLine, decode, ext, lines
from jobrunner.dataset.rows import JSONL_ID_TYPES, LOST_ID, DatasetError, id_problem, row_id, too_long, where

_SNIFF_LINES = 1000          # JSONL records looked at to list columns and infer their types


def jsonl_columns(url: str) -> list[str]:
    """Union of the keys of the first object records, in first-seen order."""
    return list(_sniff(url))


def jsonl_types(url: str, id_column: str | None) -> tuple[type | None, dict[str, pa.DataType | None]]:
    """(the ids' Python type: the first scalar id's; None without one, each column's Arrow type) from
    the first records: string, int64, float64 (ints and floats) or bool when all its non-null values
    have that type, else None (nested, mixed or all null: JSON values)."""
    sniffed = _sniff(url)
    ids = [v for v in sniffed.get(id_column, []) if type(v) in JSONL_ID_TYPES]
    return (type(ids[0]) if ids else None), {c: _arrow_type(vals) for c, vals in sniffed.items()}


def _arrow_type(values: list) -> pa.DataType | None:
    kinds = {type(v) for v in values if v is not None}
    if kinds == {int, float}:
        return pa.float64()
    if len(kinds) != 1:
        return None
    t = kinds.pop()
    if t is int and not all(-(2**63) <= v < 2**63 for v in values if v is not None):
        return None     # past int64: JSON values
    return {str: pa.string(), bool: pa.bool_(), int: pa.int64(), float: pa.float64()}.get(t)


def _sniff(url: str) -> dict[str, list]:
    """Column -> its values in the first object records (in first-seen order of the columns)."""
    cols: dict[str, list] = {}
    for n, line in enumerate(lines(url)):
        if n >= _SNIFF_LINES:
            break
        if isinstance(line, LongLine):
            continue
        text, _ = decode(line)
        if not text or not text.strip():
            continue
        try:
            rec = json.loads(text)
        except (ValueError, RecursionError):
            continue
        if isinstance(rec, dict):
            for k, v in rec.items():
                cols.setdefault(k, []).append(_sample(v))
    return cols


def _sample(value):
    """What the types need of a value (its type; an int's range), not the value: a thousand long
    records sniffed hold no more than a thousand short ones."""
    if isinstance(value, str):
        return ""
    if isinstance(value, (list, dict)):
        return type(value)()
    return value


def check_not_json_array(url: str) -> None:
    """DatasetError when a .json file holds one JSON array rather than JSON Lines."""
    if ext(url)[0] != ".json":
        return
    for line in lines(url):
        if isinstance(line, LongLine):
            return          # a line too long to look at: read_jsonl makes it an error row
        if line.strip():
            if line.lstrip().startswith(b"["):
                raise DatasetError(f"{url} holds a JSON array, not JSON Lines: "
                                   "write one JSON object per line (.jsonl)")
            return


def read_jsonl(url: str, name: str | None, id_column: str | None, has_id: bool, openai: bool,
               id_type: type | None = None,
               max_row_bytes: int = DEFAULT_MAX_ROW_BYTES) -> Iterator[tuple[object, dict | None, str | None]]:
    """(id value or None, data or None, error or None) per record; openai: records in the OpenAI batch
    format. id_type: the dataset's ids' type (jsonl_types); an id of another is an error row. A line over
    max_row_bytes is an error row, read through and never held."""
    if not openai:
        check_not_json_array(url)
    lost = LOST_ID if (has_id or openai) else None
    for lineno, line in enumerate(lines(url, max_row_bytes), start=1):
        if isinstance(line, LongLine):
            yield lost, None, f"{where(name, lineno)}: {too_long(line.size, max_row_bytes)}"
            continue
        text, err = decode(line)
        if err:
            rid = _salvage_id(line, "custom_id" if openai else id_column, has_id or openai, id_type)
            yield rid, None, f"{where(name, lineno)}: {err}"
            continue
        if not text.strip():
            continue  # blank lines are not rows
        try:
            rec = json.loads(text)
        except ValueError as e:
            yield lost, None, f"{where(name, lineno)}: invalid JSON: {e}"
            continue
        except RecursionError:
            yield lost, None, f"{where(name, lineno)}: invalid JSON: nested too deeply"
            continue
        if openai:
            cid, data, err = openai_batch.parse_record(rec)
            if data is not None:
                data["line"] = lineno           # the error file's error.line (jobrunner.openai.batch)
            rid = lost if cid is None else cid
            yield rid, data, (f"{where(name, lineno)}: {err}" if err else None)
        elif not isinstance(rec, dict):
            yield lost, None, f"{where(name, lineno)}: expected a JSON object, got {type(rec).__name__}"
        else:
            yield row_id(rec, id_column, has_id, name, lineno, id_type=id_type)


def _salvage_id(line: bytes, key: str | None, has_id: bool, id_type: type | None) -> object:
    """The id of a record with invalid UTF-8, when the id itself is intact."""
    if not has_id or key is None:
        return None
    try:
        rec = json.loads(line.decode("utf-8", errors="replace"))
    except (ValueError, RecursionError):
        return LOST_ID
    value = rec.get(key) if isinstance(rec, dict) else None
    if value is None or id_problem(value, id_type) is not None or "\ufffd" in str(value):
        return LOST_ID
    return value
