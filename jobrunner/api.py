"""The Python API: `submit` a job over a dataset, or `generate` over rows in memory.

    import jobrunner
    result = jobrunner.submit("s3://bucket/reviews.parquet", "s3://bucket/out/", max_tokens=64)
    df = jobrunner.generate([{"prompt": "Name a color."}], model="smollm2-135m-instruct")

Options are JobConfig's fields, named as the CLI's options with `_` for `-` (`max_tokens=64`,
`labels="yes,no"` or `["yes", "no"]`, `kv_cache_memory="8GiB"`), converted and type-checked the
way a TOML job file's values are (config.field_value); `config="job.toml"` reads such a file and
the keyword arguments win over it; an option left None is not given. The CLI's `submit` and
`validate` build their JobConfig here (cli.build_config), and `submit` runs its job through `run`.
"""
from __future__ import annotations

import json
import tomllib
import uuid
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import replace

from jobrunner.api_messages import api_message, check_known
from jobrunner.config import JobConfig, JobConfigError, config_fields, field_value
from jobrunner.job import EXIT_CONFIG, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, JobResult
from jobrunner.storage import CredentialsError

__all__ = ["JobConfigError", "JobFailedError", "JobResult", "OutputStorageError", "build_config",
           "clear_engine_cache", "generate", "read_toml", "run", "submit"]


class OutputStorageError(OSError):
    """The output could not be created or written (the CLI's exit 4); the message says what to do."""


class JobFailedError(RuntimeError):
    """generate: the job ran but did not succeed (over `max_error_rate`, or every row failed without
    `allow_all_failed`); `.result` holds its figures."""

    def __init__(self, message: str, result: JobResult):
        super().__init__(message)
        self.result = result


# --- configuration -------------------------------------------------------------------------------

def read_toml(path: str) -> dict:
    """The job file's values, by field name, checked and converted (config.field_value)."""
    try:
        with open(path, "rb") as fh:
            values = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise JobConfigError(f"cannot read --config {path}: {e}") from None
    values = {k.replace("-", "_"): v for k, v in values.items()}
    unknown = sorted(set(values) - set(config_fields()))
    if unknown:
        raise JobConfigError(f"--config: unknown keys {', '.join(unknown)}")
    try:
        return {k: field_value(k, v) for k, v in values.items()}
    except JobConfigError as e:
        raise JobConfigError(f"--config {path}: {e}") from None


def build_config(dataset: str | None, options: Mapping | None = None, config: str | None = None) -> JobConfig:
    """options (JobConfig field names; None values are not given) over the TOML file `config` over
    JobConfig's defaults. Raises JobConfigError naming an unknown option, a value of the wrong type, or
    one its section refuses (ranges, combinations: config_sections)."""
    values = read_toml(config) if config else {}
    options = {k: v for k, v in (options or {}).items() if v is not None}
    check_known(options, ("dataset",))
    values.update((name, field_value(name, value)) for name, value in options.items())
    values["dataset"] = dataset or values.get("dataset", "")
    values["given"] = frozenset(values) - {"dataset"}      # checks.check_dataset: a named column must exist
    return JobConfig.from_options(values)


# --- running -----------------------------------------------------------------------------------

def submit(dataset: str, output: str | None = None, *, config: str | None = None, **options) -> JobResult:
    """Run a job over `dataset` (any fsspec URL) to completion, as `jobrunner submit` does, and return
    its JobResult: exit_code (the CLI's: 0 done, 3 over max_error_rate, 130 interrupted, 1 lost
    data-parallel workers or a lost tensor-parallel rank; `error` says which), stats (the summary, as
    in _stats.json) and output (its URL).

    output: the output directory (default: the dataset's path + .results). config: a TOML job file.
    Raises JobConfigError for a configuration or input that can't run (the CLI's exit 2; nothing
    run) and OutputStorageError when the output can't be created or written (exit 4)."""
    try:
        return run(build_config(dataset, {**options, "output": output}, config))
    except JobConfigError as e:         # options by their keyword names, not the CLI's flags
        raise JobConfigError(api_message(str(e))) from None


def run(cfg: JobConfig) -> JobResult:
    """Run cfg's job: in this process, over data-parallel workers when it asks for several (or runs
    under torchrun), or over Ray actors (--ray). Errors as `submit`'s."""
    from jobrunner.job_parts import finish_done, open_job
    from jobrunner.parallel import run_parallel, wants_parallel
    from jobrunner.resolve import resolve
    if cfg.parallel.ray is not None:    # workers as Ray actors: jobrunner/parallel/ray_driver.py
        from jobrunner.parallel.ray_driver import run_ray
        with _errors(running=True):
            return run_ray(cfg)
    if wants_parallel(cfg):     # one worker per engine, or a rank under torchrun: jobrunner.parallel
        with _errors(running=True):
            return run_parallel(cfg)
    with _errors():
        resolved = resolve(cfg)
        job = None if resolved.rows_done is not None else open_job(cfg, resolved)
    if job is None:                 # a rerun with nothing left to do: no model
        with _errors(running=True):
            return finish_done(cfg, resolved)
    try:
        with _errors(running=True):
            return job.run()
    finally:
        # with --tensor-parallel the engine's other ranks are processes, ended here rather than at the
        # process's exit (an API caller may go on for hours)
        job.engine.close()


@contextmanager
def _errors(running: bool = False):
    """Exceptions a user can cause, as the API raises them: a DatasetError is a JobConfigError; an
    OSError (and while running the writer's OutputError, a failed write) an OutputStorageError."""
    from jobrunner.dataset import DatasetError
    from jobrunner.output import OutputError
    try:
        yield
    except (JobConfigError, OutputStorageError):
        raise
    except DatasetError as e:
        raise JobConfigError(str(e)) from e
    except (OSError, OutputError) as e:
        if running:
            raise OutputStorageError(f"output storage failed: {e}. Nothing written is lost; "
                                     "fix the storage and run the same command again to resume.") from e
        if isinstance(e, OutputError):
            raise
        if isinstance(e, CredentialsError):    # already says which credentials the output's store lacks
            raise OutputStorageError(str(e)) from e
        # the output directory can't be created (checks.check_output)
        raise OutputStorageError(f"{e}; check the path and its permissions, or choose another --output") from e


# --- generate: a small job in memory -----------------------------------------------------------

# The engine the last `generate` loaded, by EngineConfig: the next call with the same engine options
# reuses it (the model and its prefix cache). One at most: an engine sizes its KV cache from the free
# device memory, so a second model loaded beside the first would get little or fail.
_engine_cache: dict = {}


def clear_engine_cache() -> None:
    """Drop the engine `generate` keeps (its model and KV cache, and its tensor-parallel ranks'
    processes), freeing their memory."""
    for engine in _engine_cache.values():
        engine.close()
    _engine_cache.clear()
    import gc
    gc.collect()


def generate(rows, *, config: str | None = None, reuse_engine: bool = True, **options):
    """Run a job over rows held in memory and return its result rows as a polars DataFrame, one row
    per input row (per sample with n > 1), in the input's order. Nothing touches the disk: the rows
    and the output live in a fresh `memory://` location, deleted on return.

    rows: a list of dicts (as JSONL records), or a polars DataFrame, pyarrow Table or pandas
    DataFrame. options: as `submit`'s (kind defaults to generate), except `output` and `format`;
    it runs in this process (data_parallel 1). reuse_engine: keep the loaded engine for the next
    call with the same model and engine options (clear_engine_cache() drops it).

    Raises JobConfigError for a configuration or rows that can't run, JobFailedError when more rows
    failed than max_error_rate allows or every row failed (unless allow_all_failed),
    KeyboardInterrupt when interrupted (no rows returned)."""
    import fsspec
    import polars as pl

    from jobrunner.output import read_results
    given = sorted(k for k in ("output", "format", "dataset") if options.get(k) is not None)
    if given:
        raise JobConfigError(f"generate takes its rows in memory and returns them: no {', '.join(given)} "
                             "option (jobrunner.submit runs a job over files)")
    check_known(options, ("dataset", "output", "format"))
    fs = fsspec.filesystem("memory")
    root = f"/jobrunner-generate-{uuid.uuid4().hex}"
    dataset = None
    try:
        dataset, fmt, count = _write_rows(fs, root, rows)
        cfg = build_config(dataset, {**options, "output": f"memory://{root}/output", "format": fmt}, config)
        if (cfg.parallel.data_parallel or 1) != 1:
            raise JobConfigError("generate runs in this process: data_parallel must be 1 "
                                 "(jobrunner.submit runs data-parallel jobs)")
        if count == 0 and cfg.output.fail_on_empty:
            raise JobConfigError("rows is empty; failing, as fail_on_empty asks")
        positions: dict = {}        # row id -> its input row's index, as the job reads them
        result = _run_here(cfg, reuse_engine, positions)
        if result.exit_code == EXIT_INTERRUPTED:
            raise KeyboardInterrupt
        if result.exit_code == EXIT_FAILED:     # a tensor-parallel rank was lost
            raise JobFailedError(result.error or "the engine failed", result)
        if result.exit_code == EXIT_CONFIG:     # no rows, with fail_on_empty
            raise JobConfigError("no rows to run; failing, as fail_on_empty asks")
        if result.exit_code != EXIT_OK:         # over max_error_rate, or every row failed (exit_codes.py)
            from jobrunner.exit_codes import rows_verdict
            raise JobFailedError(rows_verdict(cfg, result.stats, "", result.stats["rows"], options="api")[1], result)
        return _in_input_order(pl.from_arrow(read_results(cfg.output_url)), positions)
    except JobConfigError as e:         # its own arguments and the caller's rows, not a memory:// file
        raise JobConfigError(api_message(str(e), dataset)) from None
    finally:
        if fs.exists(root):
            fs.rm(root, recursive=True)


def _write_rows(fs, root: str, rows) -> tuple[str, str, int]:
    """rows as a dataset under root: (its URL, its format, its number of rows). A list of dicts becomes JSONL, so its
    values read as a JSONL file's would; a table becomes Parquet, keeping its column types."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    if isinstance(rows, (list, tuple)):
        lines = []
        for i, row in enumerate(rows):
            if not isinstance(row, Mapping):
                raise JobConfigError(f"rows[{i}] is a {type(row).__name__}, not a dict of column values")
            try:
                lines.append(json.dumps(dict(row), ensure_ascii=False))
            except (TypeError, ValueError) as e:
                raise JobConfigError(f"rows[{i}]: {e}; pass a polars DataFrame to keep such values") from None
        fs.pipe(f"{root}/input.jsonl", "".join(line + "\n" for line in lines).encode())
        return f"memory://{root}/input.jsonl", "jsonl", len(lines)
    table = _arrow_table(rows)
    if table is None:
        raise JobConfigError(f"rows must be a list of dicts or a polars, pyarrow or pandas table, "
                             f"not {type(rows).__name__}")
    assert isinstance(table, pa.Table)
    with fs.open(f"{root}/input.parquet", "wb") as fh:
        pq.write_table(table, fh)
    return f"memory://{root}/input.parquet", "parquet", table.num_rows


def _arrow_table(rows):
    """A polars DataFrame, pyarrow Table or pandas DataFrame as a pyarrow Table; else None."""
    import pyarrow as pa
    if isinstance(rows, pa.Table):
        return rows
    module = type(rows).__module__.split(".")[0]
    if module == "polars" and hasattr(rows, "to_arrow"):
        return rows.to_arrow()
    if module == "pandas" and hasattr(rows, "to_dict"):
        return pa.Table.from_pandas(rows, preserve_index=False)
    return None


def _run_here(cfg: JobConfig, reuse_engine: bool, positions: dict) -> JobResult:
    """cfg's job in this process, on the cached engine when it has the same EngineConfig; `positions`
    gets each row id's place in the input as the job reads it."""
    from jobrunner.dataset import read_rows
    from jobrunner.job_parts import open_job
    from jobrunner.resolve import resolve
    with _errors():
        resolved = resolve(cfg, output_state=False)
    key = replace(cfg.engine_config(resolved), num_threads=None)   # threads follow the machine's load; results do not
    engine = _engine_cache.get(key) if reuse_engine else None
    if engine is not None and cfg.prompt.chat and not engine.tokenizer.has_chat_template:
        raise JobConfigError(f"--chat was asked for but model {cfg.engine.model} has no chat template; use --no-chat")
    if engine is None and _engine_cache:
        clear_engine_cache()        # before loading another: one engine at a time

    def reader():
        for batch in read_rows(cfg.input.dataset, resolved.fmt, id_column=cfg.input.id_column, batch_rows=1024):
            for row in batch:
                positions.setdefault(row.id, row.index)
            yield batch
    with _errors():
        job = open_job(cfg, resolved, engine=engine, reader=reader)     # closes an engine it loaded if it fails
    ok = False
    try:
        with _errors(running=True):
            result = job.run()
        ok = result.exit_code not in (EXIT_INTERRUPTED, EXIT_FAILED)
    finally:
        # an interrupted (or failed) run leaves requests in the engine: never reuse that one
        if reuse_engine and ok and not job.engine.has_unfinished():
            _engine_cache[key] = job.engine
        else:
            _engine_cache.pop(key, None)
            job.engine.close()
    return result


def _in_input_order(df, positions: dict):
    """Result rows sorted by their input row's position (by id, as the job read them), samples in order."""
    import polars as pl

    from jobrunner.output.values import id_key
    if df.is_empty():
        return df
    order = pl.Series("__position", [positions.get(id_key(i), len(positions)) for i in df["id"].to_list()])
    keys = ["__position"] + (["sample_index"] if "sample_index" in df.columns else [])
    return df.with_columns(order).sort(keys, maintain_order=True).drop("__position")
