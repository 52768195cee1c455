"""A row's structured-output constraint: an OpenAI batch body's `response_format`, else the JSON
schema in the row's --schema-column, else the job's (--json-schema, --json, --regex, --choice,
--grammar). Plain data; the engine compiles it (engine/constraints.py), and a schema that does
not compile makes the row an error. A JSON schema is compiled under the row's schema mode (an
OpenAI body's "x-jobrunner-schema-mode", else --json-schema-mode; jobs/schema_check.py)."""
from __future__ import annotations

import json

from engine import Constraint
from jobs.base import RowError
from jobs.schema_check import check_mode, with_mode

RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def row_constraint(job: Constraint | None, schema_column: str | None, data: dict,
                   mode: str = "strict") -> Constraint | None:
    """The constraint the engine compiles for the row: a JSON schema as its schema mode has it compiled."""
    c = requested_constraint(job, schema_column, data)
    if c is None or c.kind != "json_schema":
        return c
    return Constraint("json_schema", with_mode(c.spec, row_schema_mode(mode, data)))


def row_schema_mode(mode: str, data: dict) -> str:
    """The job's schema mode, or an OpenAI row's own ("schema_mode" in its params)."""
    params = data.get("params")
    if isinstance(params, dict) and params.get("schema_mode") is not None:
        return check_mode(params["schema_mode"], "x-jobrunner-schema-mode")
    return mode


def requested_constraint(job: Constraint | None, schema_column: str | None, data: dict) -> Constraint | None:
    """The row's constraint as it was asked for (a JSON schema as written: what outputs are checked against)."""
    params = data.get("params")
    if isinstance(params, dict) and params.get("response_format") is not None:
        return response_format_constraint(params["response_format"])
    if schema_column:
        schema = data.get(schema_column)
        if schema is None or schema == "":
            raise RowError(f"schema column {schema_column!r} is missing or null")
        return Constraint("json_schema", schema if isinstance(schema, str) else json.dumps(schema))
    return job


def response_format_constraint(rf) -> Constraint | None:
    """OpenAI's `response_format` -> a Constraint (None for "text"); RowError for what we can't honour."""
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind not in RESPONSE_FORMATS:
        raise RowError(f"response_format must be an object whose type is one of {', '.join(RESPONSE_FORMATS)}; "
                       f"got {rf!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json")
    spec = rf.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise RowError("response_format json_schema needs json_schema.schema, a JSON schema object")
    return Constraint("json_schema", json.dumps(schema))     # strict or not, the schema is enforced
