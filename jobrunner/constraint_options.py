"""The structured-output options (--json-schema, --json, --regex, --choice, --grammar,
--schema-column, --json-schema-mode, --grammar-timeout): their rules, the files they name, and the compile check
that makes a bad constraint exit 2 before any work."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from engine import Constraint
from jobs.schema_check import SCHEMA_MODES, with_mode

# JobConfig field -> its option
CONSTRAINT_OPTIONS = {"json_schema": "--json-schema", "json": "--json", "regex": "--regex", "choice": "--choice",
                      "grammar": "--grammar"}


def _bad(message: str):
    from jobrunner.config import JobConfigError
    raise JobConfigError(message)


def validate_constraint_options(cfg) -> None:
    """The options' combinations and values (no file read); JobConfigError."""
    given = [opt for name, opt in CONSTRAINT_OPTIONS.items() if getattr(cfg, name)]
    if cfg.schema_column:
        given.append("--schema-column")
    if len(given) > 1:
        _bad(f"{' and '.join(given)} contradict each other: give one constraint")
    if given and cfg.kind != "generate":
        _bad(f"{given[0]} constrains generated text: it needs --kind generate")
    if len(set(cfg.choice)) != len(cfg.choice):
        _bad("--choice has duplicates")
    if cfg.json_schema_mode not in SCHEMA_MODES:
        _bad(f"--json-schema-mode must be strict or validate, not {cfg.json_schema_mode!r}")
    if cfg.json_schema_mode != "strict" and cfg.kind != "generate":
        _bad("--json-schema-mode applies to --kind generate only")
    if not cfg.grammar_timeout > 0:
        _bad("--grammar-timeout must be > 0 seconds")


def job_constraint(cfg) -> Constraint | None:
    """The job's constraint, with the files it names read (a schema as written: each row's is compiled
    under its schema mode, jobs/constraint.py); JobConfigError when one can't be."""
    if cfg.json_schema:
        text = cfg.json_schema
        return Constraint("json_schema", text if text.lstrip().startswith("{") else _read(text, "--json-schema"))
    if cfg.json:
        return Constraint("json")
    if cfg.regex:
        return Constraint("regex", cfg.regex)
    if cfg.choice:
        return Constraint("choice", json.dumps(list(cfg.choice)))
    if cfg.grammar:
        return Constraint("grammar", _read(cfg.grammar, "--grammar"))
    return None


def check_job_constraint(cfg) -> None:
    """Compiles the job's constraint (grammar level: no tokenizer needed) within --grammar-timeout;
    JobConfigError naming the option and the problem."""
    from engine import check_constraint
    c = job_constraint(cfg)
    if c is None:
        return
    if c.kind == "json_schema":
        c = Constraint("json_schema", with_mode(c.spec, cfg.json_schema_mode))
    option = next(opt for name, opt in CONSTRAINT_OPTIONS.items() if getattr(cfg, name))
    pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-check")
    try:
        error = pool.submit(check_constraint, c).result(timeout=cfg.grammar_timeout)
    except FutureTimeout:
        _bad(f"{option}: did not compile within {cfg.grammar_timeout:g} s; simplify it or raise --grammar-timeout")
    finally:
        pool.shutdown(wait=False)
    if error:
        _bad(f"{option}: {error}")


def _read(url: str, option: str) -> str:
    from jobrunner import storage
    try:
        fs, path = storage.url_fs(url)
        with fs.open(path, "rb") as f:
            return f.read().decode("utf-8")
    except (OSError, ValueError, ImportError) as e:
        _bad(f"{option} {url!r}: not JSON text and cannot read it as a file: {e}" if option == "--json-schema"
             else f"{option} {url!r}: cannot read the file: {e}")
