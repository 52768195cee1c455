"""JSON Lines: one object a line; OpenAI batch input is JSONL whose records openai_batch parses."""

from __future__ import annotations

import json
from collections.abc import Iterator

from jobrunner import openai_batch
from jobrunner.dataset.files import decode, ext, lines
from jobrunner.dataset.rows import LOST_ID, DatasetError, id_str, row_id, where

_SNIFF_LINES = 1000          # JSONL records looked at to list columns


def jsonl_columns(url: str) -> list[str]:
    """Union of the keys of the first object records, in first-seen order."""
    cols: dict[str, None] = {}
    for n, line in enumerate(lines(url)):
        if n >= _SNIFF_LINES:
            break
        text, _ = decode(line)
        if not text or not text.strip():
            continue
        try:
            rec = json.loads(text)
        except (ValueError, RecursionError):
            continue
        if isinstance(rec, dict):
            cols.update(dict.fromkeys(rec))
    return list(cols)


def check_not_json_array(url: str) -> None:
    """DatasetError when a .json file holds one JSON array rather than JSON Lines."""
    if ext(url)[0] != ".json":
        return
    for line in lines(url):
        if line.strip():
            if line.lstrip().startswith(b"["):
                raise DatasetError(f"{url} holds a JSON array, not JSON Lines: "
                                   "write one JSON object per line (.jsonl)")
            return


def read_jsonl(url: str, name: str | None, id_column: str | None, has_id: bool,
               openai: bool) -> Iterator[tuple[str | None, dict | None, str | None]]:
    """(id or None, data or None, error or None) per record; openai: records in the OpenAI batch format."""
    if not openai:
        check_not_json_array(url)
    lost = LOST_ID if (has_id or openai) else None
    for lineno, line in enumerate(lines(url), start=1):
        text, err = decode(line)
        if err:
            rid = _salvage_id(line, "custom_id" if openai else id_column, has_id or openai)
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
                data["line"] = lineno           # the error file's error.line (jobrunner.openai_batch)
            rid = lost if cid is None else id_str(cid)
            yield rid, data, (f"{where(name, lineno)}: {err}" if err else None)
        elif not isinstance(rec, dict):
            yield lost, None, f"{where(name, lineno)}: expected a JSON object, got {type(rec).__name__}"
        else:
            yield row_id(rec, id_column, has_id, name, lineno)


def _salvage_id(line: bytes, key: str | None, has_id: bool) -> str | None:
    """The id of a record with invalid UTF-8, when the id itself is intact."""
    if not has_id or key is None:
        return None
    try:
        rec = json.loads(line.decode("utf-8", errors="replace"))
    except (ValueError, RecursionError):
        return LOST_ID
    value = rec.get(key) if isinstance(rec, dict) else None
    rid = None if value is None else id_str(value)
    return rid if rid is not None and "\ufffd" not in rid else LOST_ID
