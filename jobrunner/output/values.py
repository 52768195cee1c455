"""Result values and their Arrow types: what a part's columns hold and how rows are made to fit.

Invariants:
- Every part has the same schema (so `polars.read_parquet("out/part*.parquet")`
  and `pyarrow.dataset.dataset("out")` read them together):
    fixed columns   id, output, finish_reason, error: string;
                    prompt_tokens, cached_tokens, completion_tokens: int64;
                    queue_s, prefill_s, decode_s: float64
    known columns   label: string; sample_index: int64;
                    label_probs: list<struct<label: string, prob: float64>> (from a dict label->prob)
                    label_logprobs: list<struct<label: string, logprob: float64>> (likewise)
                    embedding: fixed_size_list<float32>[N] (kind "float32[N]"), N pinned by the first
                    vector seen; polars reads it as an Array column. A first part without any vector
                    pins it as json; a vector of another size goes to extra_json.
                    logprobs: list<struct<token, logprob, bytes: list<int64>, top_logprobs: list<struct<
                              token, logprob, bytes>>>> (jobs.logprobs; OpenAI's shape)
                    reasoning: string; reasoning_tokens, truncated_tokens: int64
    declared        a job declares its schema before any row is written (jobrunner.output.schema):
                    the id and input columns with their input types, `reused`, and every column its
                    kind declares; a column of kind "arrow" keeps the field's own Arrow type (a
                    Parquet input's List, Date, struct...), a value fits it when it round-trips exactly.
                    The id column may have any kind: a row whose id doesn't fit (a lost id's key
                    "row-N" in an Int64 id column) has a null id and its key in extra_json's "id".
    extra columns   without a declared schema: pinned by the first part ever written (read back from it afterwards):
                    all values str -> string; all bool -> bool; all int -> int64;
                    int/float -> float64; anything else (nested, mixed, all-null,
                    bytes, dates) -> "json": a string column of JSON texts.
    extra_json      a JSON object (string) of the row's values that don't fit the pinned
                    schema: keys first seen after the first part, or values of another
                    type than the column's.  Null when everything fit.  Nothing is dropped;
                    readers.stored_values(table, name) reads a column with these put back.
  Each column's kind is recorded in the parquet schema metadata "jobrunner.kinds".
- to_json never raises: any value has a JSON text (falling back to repr).
"""

from __future__ import annotations

import datetime as _dt
import decimal
import json
import numbers
import re
from array import array
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

__all__ = ["EXTRA_JSON", "FIXED_COLUMNS", "KNOWN_COLUMNS", "LABEL_PROBS", "LABEL_LOGPROBS", "ARROW",
           "id_key", "to_json", "to_json_pretty", "json_default", "is_int", "is_float", "scrub", "arrow_array",
           "arrow_schema", "kinds_of", "infer_kinds", "norm_row", "to_table"]

EXTRA_JSON = "extra_json"
LABEL_PROBS = pa.list_(pa.struct([("label", pa.string()), ("prob", pa.float64())]))
LABEL_LOGPROBS = pa.list_(pa.struct([("label", pa.string()), ("logprob", pa.float64())]))
_LABEL_LISTS = {"label_probs": "prob", "label_logprobs": "logprob"}   # kind -> its struct's number field
_TOKEN = [("token", pa.string()), ("logprob", pa.float64()), ("bytes", pa.list_(pa.int64()))]
TOKEN_LOGPROBS = pa.list_(pa.struct([*_TOKEN, ("top_logprobs", pa.list_(pa.struct(_TOKEN)))]))   # jobs.logprobs
_ARROW = {"string": pa.string(), "json": pa.string(), "int": pa.int64(), "float": pa.float64(),
          "bool": pa.bool_(), "label_probs": LABEL_PROBS, "label_logprobs": LABEL_LOGPROBS,
          "token_logprobs": TOKEN_LOGPROBS}
FIXED_COLUMNS: dict[str, str] = {
    "id": "string", "output": "string", "finish_reason": "string",
    "prompt_tokens": "int", "cached_tokens": "int", "completion_tokens": "int",
    "queue_s": "float", "prefill_s": "float", "decode_s": "float", "error": "string"}
KNOWN_COLUMNS: dict[str, str] = {"label": "string", "label_probs": "label_probs",
                                 "label_logprobs": "label_logprobs", "sample_index": "int",
                                 "logprobs": "token_logprobs", "reasoning": "string", "reasoning_tokens": "int",
                                 "truncated_tokens": "int", "draft_tokens": "int", "accepted_tokens": "int"}
ARROW = "arrow"                 # a column of the field's own Arrow type (an input column's)
_INT64 = (-(2**63), 2**63 - 1)
VECTOR_COLUMNS = ("embedding",)         # columns of float vectors: kind float32[N] by their first value
_VECTOR = re.compile(r"^float32\[([1-9][0-9]*)\]$")


def vector_kind(size: int) -> str:
    return f"float32[{size}]"


def _vector_size(kind: str) -> int | None:
    m = _VECTOR.match(kind) if isinstance(kind, str) else None
    return int(m.group(1)) if m else None


def _arrow_type(kind: str) -> pa.DataType | None:
    size = _vector_size(kind)
    return pa.list_(pa.float32(), size) if size else _ARROW.get(kind) if isinstance(kind, str) else None


# ---------------------------------------------------------------- values


def id_key(value: Any) -> str:
    """A row's key (the str the job, dedup and resume know it by) from its id value (containers as
    canonical JSON); jobrunner.dataset gives rows the same key."""
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)
    return str(value)


def json_default(v: Any) -> Any:
    """json.dumps default: bytes, dates, sets and decimals as JSON-able values; else str."""
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v).decode("utf-8", errors="replace")
    if isinstance(v, (_dt.datetime, _dt.date, _dt.time)):
        return v.isoformat()
    if isinstance(v, (set, frozenset)):
        return sorted(v, key=repr)
    if isinstance(v, decimal.Decimal):
        return str(v)
    if isinstance(v, (array, np.ndarray)):
        return v.tolist()
    return str(v)


def _plain(v: Any) -> Any:
    """Containers with non-string keys made JSON-able (keys become str)."""
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def to_json(v: Any) -> str:
    """JSON text of any value; never raises (falls back to repr)."""
    try:
        return json.dumps(v, ensure_ascii=False, default=json_default)
    except (TypeError, ValueError, RecursionError):
        try:
            return json.dumps(_plain(v), ensure_ascii=False, default=json_default)
        except (TypeError, ValueError, RecursionError):
            return json.dumps(repr(v))


def to_json_pretty(v: Any) -> str:
    """Indented JSON text (the manifest and _stats.json)."""
    try:
        return json.dumps(v, ensure_ascii=False, indent=2, default=json_default)
    except (TypeError, ValueError):
        return json.dumps(_plain(v), ensure_ascii=False, indent=2, default=json_default)


def is_int(v: Any) -> bool:
    """An integer (not a bool) that an int64 holds."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool) and _INT64[0] <= v <= _INT64[1]


def is_float(v: Any) -> bool:
    """A real number that a float64 holds exactly (ints up to 2**53)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return False
    if isinstance(v, numbers.Integral):
        return -(2**53) <= v <= 2**53
    try:
        float(v)
    except (OverflowError, ValueError, TypeError):
        return False
    return True


def _label_list(v: Any, field: str) -> list[dict] | None:
    """dict label->number, or [{label, <field>}], as a list of structs; None if neither."""
    items = v.items() if isinstance(v, Mapping) else None
    if items is None and isinstance(v, (list, tuple)) and all(
            isinstance(x, Mapping) and set(x) == {"label", field} for x in v):
        items = [(x["label"], x[field]) for x in v]
    if items is None:
        return None
    out = []
    for label, number in items:
        if not isinstance(label, str) or not (number is None or is_float(number)):
            return None
        out.append({"label": label, field: None if number is None else float(number)})
    return out


_MISS = object()  # a value that doesn't fit its column's kind


def _fit(kind: str, v: Any) -> Any:
    """v converted for a column of `kind`, or _MISS. None always fits."""
    if v is None:
        return None
    if kind == "json":
        return to_json(v)
    if kind == "string":
        return v if isinstance(v, str) else _MISS
    if kind == "int":
        return int(v) if is_int(v) else _MISS
    if kind == "float":
        return float(v) if is_float(v) else _MISS
    if kind == "bool":
        return v if isinstance(v, bool) else _MISS
    if kind in _LABEL_LISTS:
        lp = _label_list(v, _LABEL_LISTS[kind])
        return _MISS if lp is None else lp
    size = _vector_size(kind)
    if size is not None:
        ok = isinstance(v, (array, list, tuple, np.ndarray)) and len(v) == size and all(map(is_float, v))
        return v if ok else _MISS
    if kind == "token_logprobs":
        return v if _is_token_logprobs(v) else _MISS
    raise AssertionError(kind)


def _is_token_logprobs(v: Any) -> bool:
    """jobs.logprobs' entries: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]."""
    keys = {"token", "logprob", "bytes"}
    return isinstance(v, list) and all(
        isinstance(e, Mapping) and set(e) == keys | {"top_logprobs"} and isinstance(e["top_logprobs"], list)
        and all(isinstance(t, Mapping) and set(t) == keys for t in e["top_logprobs"]) for e in v)


def _infer_kind(name: str, values: list[Any]) -> str:
    """Kind of a new extra column from its values in the first part (see module doc)."""
    if name in KNOWN_COLUMNS:
        return KNOWN_COLUMNS[name]
    vals = [v for v in values if v is not None]
    if not vals:
        return "json"
    if name in VECTOR_COLUMNS and isinstance(vals[0], (array, list, tuple, np.ndarray)) and len(vals[0]):
        return vector_kind(len(vals[0]))
    if all(isinstance(v, str) for v in vals):
        return "string"
    if all(isinstance(v, bool) for v in vals):
        return "bool"
    if all(is_int(v) for v in vals):
        return "int"
    if all(is_float(v) for v in vals):
        return "float"
    return "json"


def infer_kinds(rows: list[dict[str, Any]]) -> dict[str, str]:
    """The kinds a first part pins: the fixed columns, then each other key in order of appearance."""
    kinds = dict(FIXED_COLUMNS)
    order: dict[str, None] = {}
    for r in rows:
        order.update(dict.fromkeys(k for k in r if k not in kinds and k != EXTRA_JSON))
    for name in order:
        kinds[name] = _infer_kind(name, [r.get(name) for r in rows])
    return kinds


def scrub(v: Any) -> Any:
    """Strings made encodable as UTF-8 (lone surrogates -> '?'), recursively."""
    if isinstance(v, str):
        return v.encode("utf-8", errors="replace").decode("utf-8")
    if isinstance(v, list):
        return [scrub(x) for x in v]
    if isinstance(v, dict):
        return {scrub(k): scrub(x) for k, x in v.items()}
    return v


def arrow_array(values: list[Any], kind: str) -> pa.Array:
    """An Arrow array of a kind's type (strings scrubbed when they can't be encoded)."""
    size = _vector_size(kind)
    if size is not None:
        return _vector_array(values, size)
    try:
        return pa.array(values, type=_ARROW[kind])
    except (pa.ArrowException, UnicodeEncodeError):
        return pa.array(scrub(values), type=_ARROW[kind])


def _vector_array(values: list[Any], size: int) -> pa.Array:
    """Vectors (array('f'), lists; None: null) as one fixed_size_list<float32>[size] array, through
    one flat float32 buffer rather than a Python float per value."""
    flat = np.zeros((len(values), size), dtype=np.float32)
    null = np.zeros(len(values), dtype=bool)
    for i, v in enumerate(values):
        if v is None:
            null[i] = True
        elif isinstance(v, array) and v.typecode == "f":
            flat[i] = np.frombuffer(v, dtype=np.float32)
        else:
            flat[i] = v
    return pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), size, mask=pa.array(null))


# ---------------------------------------------------------------- schema


def arrow_schema(kinds: dict[str, str], types: Mapping[str, pa.DataType] | None = None) -> pa.Schema:
    """A part's schema: the kinds' columns, then extra_json; the kinds in its metadata.
    types: the Arrow type of each column of kind "arrow"."""
    fields = [pa.field(n, types[n] if k == ARROW else _arrow_type(k)) for n, k in kinds.items()]
    fields.append(pa.field(EXTRA_JSON, pa.string()))
    meta = {"jobrunner.kinds": json.dumps(kinds, ensure_ascii=False), "jobrunner.version": "1"}
    return pa.schema(fields, metadata=meta)


def kinds_of(schema: pa.Schema) -> dict[str, str] | None:
    """The pinned kinds recorded in a part's schema, or None for a foreign file."""
    raw = (schema.metadata or {}).get(b"jobrunner.kinds")
    try:
        kinds = json.loads(raw) if raw else None
    except ValueError:
        return None
    if not isinstance(kinds, dict) or any(
            not (_arrow_type(k) is not None or (k == ARROW and n in schema.names)) for n, k in kinds.items()):
        return None
    if any(kinds.get(n) != k for n, k in FIXED_COLUMNS.items() if n != "id") or "id" not in kinds:
        return None
    return kinds


def types_of(schema: pa.Schema) -> dict[str, pa.DataType]:
    """The Arrow type of each column of a schema."""
    return {f.name: f.type for f in schema}


def norm_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A result row with str keys; TypeError/ValueError for a non-dict or no id. The id keeps its value."""
    if not isinstance(row, Mapping):
        raise TypeError(f"result rows must be dicts, got {type(row).__name__}")
    if row.get("id") is None:
        raise ValueError("result row without an id")
    out: dict[str, Any] = {}
    for k, v in row.items():
        name = k if isinstance(k, str) else str(k)
        out[name if name not in out else repr(k)] = v  # 1 and "1" both kept
    return out


def _same(a: Any, b: Any) -> bool:
    return (type(a) is type(b) and a == b) or to_json(a) == to_json(b)     # NaN too; never True for 1


def _exact_array(values: list[Any], t: pa.DataType) -> tuple[pa.Array, dict[int, Any]]:
    """(values as an array of type t, {row: value that doesn't fit}): a value fits when it comes back
    as it went in (pyarrow alone would cut 1.5 to 1 in an int64 column, or drop a struct's extra keys)."""
    try:
        arr = pa.array(values, type=t)
        if arr.to_pylist() == values:
            return arr, {}
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        pass
    fitted, misfits = [], {}
    for i, v in enumerate(values):
        try:
            ok = v is None or _same(pa.array([v], type=t).to_pylist()[0], v)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            ok = False
        fitted.append(v if ok else None)
        if not ok:
            misfits[i] = v
    return pa.array(fitted, type=t), misfits


def to_table(rows: list[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    """Rows conformed to the pinned schema (see kinds_of); misfits go to extra_json."""
    kinds, types = kinds_of(schema), types_of(schema)
    cols: dict[str, list[Any]] = {n: [] for n in kinds}
    over: list[dict[str, Any]] = [{} for _ in rows]
    for row, extra in zip(rows, over):
        for n, k in kinds.items():
            v = row.get(n)
            if n == "id" and k == "string" and v is not None and not isinstance(v, str):
                v = id_key(v)       # a writer not told the id's type: ids as their keys
            elif k != ARROW:
                v = _fit(k, v)
                if v is _MISS:
                    extra[n], v = row[n], None
            cols[n].append(v)
        for n, v in row.items():
            if n not in kinds:
                extra[n] = v
    arrays = []
    for n, k in kinds.items():
        if k != ARROW:
            arrays.append(arrow_array(cols[n], k))
            continue
        arr, misfits = _exact_array(cols[n], types[n])
        for i, v in misfits.items():
            over[i][n] = v
        arrays.append(arr)
    arrays.append(arrow_array([to_json(x) if x else None for x in over], "string"))
    return pa.Table.from_arrays(arrays, schema=arrow_schema(kinds, types))
