"""A row's structured-output constraint: the row's own (RowOptions.constraint: an OpenAI batch body's
`response_format`, jobrunner.openai.request), else the JSON schema in the row's --schema-column, else the
job's (--json-schema, --json, --regex, --choice, --grammar). Plain data; the engine compiles it
(engine/sample/constraints.py), and a schema that does not compile makes the row an error. A JSON schema is
compiled under the row's schema mode (its own, RowOptions.schema_mode, else --json-schema-mode;
jobs/schema_check.py)."""
from __future__ import annotations

import json

from jobrunner.engine import Constraint
from jobrunner.jobs.base import RowError
from jobrunner.jobs.row import NO_OPTIONS, RowOptions
from jobrunner.jobs.schema_check import with_mode


def row_constraint(job: Constraint | None, schema_column: str | None, data: dict,
                   mode: str = "strict", options: RowOptions = NO_OPTIONS) -> Constraint | None:
    """The constraint the engine compiles for the row: a JSON schema as its schema mode has it compiled."""
    c = requested_constraint(job, schema_column, data, options)
    if c is None or c.kind != "json_schema":
        return c
    return Constraint("json_schema", with_mode(c.spec, options.schema_mode or mode))


def requested_constraint(job: Constraint | None, schema_column: str | None, data: dict,
                         options: RowOptions = NO_OPTIONS) -> Constraint | None:
    """The row's constraint as it was asked for (a JSON schema as written: what outputs are checked against)."""
    if options.constraint is not None:
        return options.constraint
    if schema_column:
        schema = data.get(schema_column)
        if schema is None or schema == "":
            raise RowError(f"schema column {schema_column!r} is missing or null")
        return Constraint("json_schema", schema if isinstance(schema, str) else json.dumps(schema))
    return job
