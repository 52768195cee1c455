"""The structured-output options (--json-schema, --json, --regex, --choice, --grammar,
--schema-column, --json-schema-mode, --grammar-timeout): their rules, the files they name, and the compile check
that makes a bad constraint exit 2 before any work."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from jobrunner import engine       # engine.check_constraint, read at the check: its grammar compiler loads torch
from jobrunner.engine import Constraint
from jobrunner.config.option_values import JobConfigError
from jobrunner.jobs.schema_check import with_mode

# JobConfig field -> its option
CONSTRAINT_OPTIONS = {"json_schema": "--json-schema", "json": "--json", "regex": "--regex", "choice": "--choice",
                      "grammar": "--grammar"}


def _bad(message: str):
    raise JobConfigError(message)


def validate_constraint_options(kind) -> None:
    """The options' combinations and values (no file read), of a GenerateKind; JobConfigError."""
    given = [opt for name, opt in CONSTRAINT_OPTIONS.items() if getattr(kind, name)]
    if kind.schema_column:
        given.append("--schema-column")
    if len(given) > 1:
        _bad(f"{' and '.join(given)} contradict each other: give one constraint")
    if len(set(kind.choice)) != len(kind.choice):
        _bad("--choice has duplicates")


def job_constraint(kind) -> Constraint | None:
    """A GenerateKind's constraint, with the files it names read (a schema as written: each row's is compiled
    under its schema mode, jobs/constraint.py); JobConfigError when one can't be."""
    if kind.json_schema:
        text = kind.json_schema
        return Constraint("json_schema", text if text.lstrip().startswith("{") else _read(text, "--json-schema"))
    if kind.json:
        return Constraint("json")
    if kind.regex:
        return Constraint("regex", kind.regex)
    if kind.choice:
        return Constraint("choice", json.dumps(list(kind.choice)))
    if kind.grammar:
        return Constraint("grammar", _read(kind.grammar, "--grammar"))
    return None


def check_job_constraint(kind, grammar_timeout: float) -> None:
    """Compiles the constraint of the job's kind section (grammar level: no tokenizer needed) within
    --grammar-timeout; JobConfigError naming the option and the problem."""
    if kind.name != "generate" or (c := job_constraint(kind)) is None:
        return
    if c.kind == "json_schema":
        c = Constraint("json_schema", with_mode(c.spec, kind.json_schema_mode))
    option = next(opt for name, opt in CONSTRAINT_OPTIONS.items() if getattr(kind, name))
    pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-check")
    try:
        error = pool.submit(engine.check_constraint, c).result(timeout=grammar_timeout)
    except FutureTimeout:
        _bad(f"{option}: did not compile within {grammar_timeout:g} s; simplify it or raise --grammar-timeout")
    finally:
        pool.shutdown(wait=False)
    if error:
        _bad(f"{option}: {error}")


def _read(url: str, option: str) -> str:
    from jobrunner.common import storage       # fsspec: for a --grammar or --json-schema file, not at the CLI's start
    try:
        fs, path = storage.url_fs(url)
        with fs.open(path, "rb") as f:
            return f.read().decode("utf-8")
    except (OSError, ValueError, ImportError) as e:
        _bad(f"{option} {url!r}: not JSON text and cannot read it as a file: {e}" if option == "--json-schema"
             else f"{option} {url!r}: cannot read the file: {e}")
