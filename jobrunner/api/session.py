"""Jobs over rows in memory: `generate` (one call, one engine loaded and closed), and an engine its user
holds open for many calls (`open_engine`), as vLLM's LLM object serves its generate calls.

    df = jobrunner.generate([{"prompt": "Name a color."}], model="smollm2-135m-instruct", max_tokens=16)

    with jobrunner.open_engine(model="smollm2-135m-instruct", kv_cache_memory="1GiB") as llm:
        answers = llm.generate(rows, max_tokens=16)
        labels = llm.generate(rows, kind="classify", labels="positive,negative")

A call's rows go to the job as a `memory://` file (so they are read, typed and checked as a JSONL or
Parquet dataset is), deleted on return; its result rows stay in memory (output.RowSink) and come back
as a polars DataFrame in the input's order. No output directory is made.

`EngineSession.run_rows` is the path without a file either way, for a caller whose rows are already
jobrunner.dataset.Rows (the lm-eval backend's token ids): they go to the job as they are, and the
result rows come back as the kind made them (dicts of values), not typed into a table.
"""
from __future__ import annotations

import gc
import json
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import replace

import fsspec
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from jobrunner.api.messages import api_message, check_known
from jobrunner.api.submit import JobFailedError, api_errors, build_config
from jobrunner.config.job import JobConfig, JobConfigError
from jobrunner.dataset import read_rows
from jobrunner.pipeline import checks
from jobrunner.pipeline.build import load_engine, open_job
from jobrunner.pipeline.ending import JobResult
from jobrunner.pipeline.exit_codes import EXIT_CONFIG, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, rows_verdict
from jobrunner.pipeline.progress import Progress
from jobrunner.pipeline.resolve import cache_url, check_sampling, resolve, resolve_engine
from jobrunner.output.values import id_key

__all__ = ["EngineSession", "generate", "open_engine"]

_NOT_HERE = ("output", "format", "dataset")      # generate's rows are in memory, and so are its results
ROWS_FORMAT = "rows"            # run_rows' dataset format: Rows in memory, never read as a file's
ROWS_BATCH = 1024               # run_rows' reader batches, as read_rows gives a file's


def generate(rows, *, config: str | None = None, **options):
    """Run a job over rows held in memory and return its result rows as a polars DataFrame, one row
    per input row (per sample with n > 1), in the input's order. Nothing touches the disk.

    rows: a list of dicts (as JSONL records), or a polars DataFrame, pyarrow Table or pandas
    DataFrame. options: as `submit`'s (kind defaults to generate), except `output` and `format`;
    it runs in this process (data_parallel 1), on an engine loaded for this call and closed at its
    end (`open_engine` keeps one for many calls).

    Raises JobConfigError for a configuration or rows that can't run, JobFailedError when more rows
    failed than max_error_rate allows or every row failed (unless allow_all_failed),
    KeyboardInterrupt when interrupted (no rows returned)."""
    return _generate(rows, config, options, None)


def open_engine(*, config: str | None = None, **options) -> EngineSession:
    """Load the engine of these options (model, device, dtype, quantization, kv_cache_memory, ...; a
    TOML `config` too) and hold it for `generate` calls until the session is closed. Every option is
    also the calls' default (a call's own options win), but a call may not ask for another engine.
    JobConfigError for options that can't run."""
    return EngineSession(config, options)


class EngineSession:
    """An engine held open by its user: each `generate` call is a job on it (its model, its KV and
    prefix cache stay between calls). Close it (`close()`, or leave a `with` block) to free its model,
    KV cache and tensor-parallel ranks; one that is dropped unclosed is closed when it is collected.
    A call that is interrupted or fails leaves requests in the engine: that engine is closed, and the
    next call loads a fresh one."""

    def __init__(self, config: str | None, options: Mapping):
        check_known(options, _NOT_HERE)
        refused = sorted(k for k in _NOT_HERE if options.get(k) is not None)
        if refused:
            raise JobConfigError(f"an engine session takes no {', '.join(refused)} option")
        self.config, self.options = config, dict(options)
        try:
            cfg = build_config(None, self.options, config)
        except JobConfigError as e:
            raise JobConfigError(api_message(str(e))) from None
        self._key, self._engine, self._closer = None, None, None
        self.closed = False
        self._load(cfg)

    def generate(self, rows, **options):
        """`jobrunner.generate` on this session's engine; options over the session's. JobConfigError
        also when they ask for another engine (another model, device, precision, KV cache size, ...)."""
        if self.closed:
            raise JobConfigError("this engine session is closed; open another with jobrunner.open_engine")
        return _generate(rows, self.config, {**self.options, **options}, self)

    def run_rows(self, rows: list, **options) -> list[dict]:
        """A job over `rows`, jobrunner.dataset.Rows already (their ids, values and options as a reader
        gives them), on this session's engine; options over the session's. Nothing is written or read
        back: the rows go to the job as they are, and the result rows come back as the kind made them
        (dicts: a list of floats stays a list), in the rows' order (samples in order). Raises as
        `generate` does."""
        if self.closed:
            raise JobConfigError("this engine session is closed; open another with jobrunner.open_engine")
        return _run_rows(list(rows), self.config, {**self.options, **options}, self)

    def close(self) -> None:
        """Free the engine (its model, KV cache and tensor-parallel ranks' processes)."""
        self._drop_engine()
        self.closed = True

    def __enter__(self) -> EngineSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- for _run_here ----------------------------------------------------------------------

    def engine_for(self, cfg: JobConfig, resolved):
        """The engine for cfg's job: this session's (loaded again if a failed call closed it)."""
        if _engine_key(cfg, resolved) != self._key:
            raise JobConfigError("these options ask for another engine than this session's (its model, device, "
                                 "precision or engine options differ); open another with jobrunner.open_engine")
        if self._engine is None:
            self._load(cfg, resolved)
        engine = self._engine
        if cfg.prompt.chat and not engine.tokenizer.has_chat_template:
            raise JobConfigError(f"--chat was asked for but model {cfg.engine.model} has no chat template; "
                                 "use --no-chat")
        return engine

    def call_ended(self, clean: bool) -> None:
        """A call's job ended; an engine left with requests in it is never used again."""
        if not clean or (self._engine is not None and self._engine.has_unfinished()):
            self._drop_engine()

    def _load(self, cfg: JobConfig, resolved=None) -> None:
        with api_errors():
            resolved = resolved or resolve_engine(cfg)
            engine = load_engine(cfg, resolved)
        self._key, self._engine = _engine_key(cfg, resolved), engine
        self._closer = weakref.finalize(self, engine.close)     # a session dropped unclosed

    def _drop_engine(self) -> None:
        if self._closer is not None:
            self._closer()              # engine.close, once
        self._engine, self._closer = None, None
        gc.collect()


def _engine_key(cfg: JobConfig, resolved):
    """What makes two jobs' engines the same: the EngineConfig, but for its threads (they follow the machine's
    load; results do not) and its seed, which only seeds rows that have none (a job's --seed seeds every row
    itself), unless it draws the random weights of a dummy model."""
    config = cfg.engine_config(resolved)
    return replace(config, num_threads=None, seed=config.seed if config.model.startswith("dummy:") else 0)


def _generate(rows, config: str | None, options: dict, session: EngineSession | None):
    _refuse_file_options(options, "generate")
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
        positions: dict = {}        # row id -> its input rows' indices, as the job reads them
        result, table = _run_here(cfg, session, positions)
        _raise_unless_ok(cfg, result, options)
        return _in_input_order(pl.from_arrow(table), positions)
    except JobConfigError as e:         # its own arguments and the caller's rows, not a memory:// file
        raise JobConfigError(api_message(str(e), dataset)) from None
    finally:
        if fs.exists(root):
            fs.rm(root, recursive=True)


def _raise_unless_ok(cfg: JobConfig, result: JobResult, options: dict) -> None:
    if result.exit_code == EXIT_INTERRUPTED:
        raise KeyboardInterrupt
    if result.exit_code == EXIT_FAILED:     # a tensor-parallel rank was lost
        raise JobFailedError(result.error or "the engine failed", result)
    if result.exit_code == EXIT_CONFIG:     # no rows, with fail_on_empty
        raise JobConfigError("no rows to run; failing, as fail_on_empty asks")
    if result.exit_code != EXIT_OK:         # over max_error_rate, or every row failed (exit_codes.py)
        raise JobFailedError(rows_verdict(cfg.output, result.stats, "", result.stats["rows"], options="api")[1], result)


def _write_rows(fs, root: str, rows) -> tuple[str, str, int]:
    """rows as a dataset under root: (its URL, its format, its number of rows). A list of dicts becomes JSONL, so its
    values read as a JSONL file's would; a table becomes Parquet, keeping its column types."""
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
    if isinstance(rows, pa.Table):
        return rows
    module = type(rows).__module__.split(".")[0]
    if module == "polars" and hasattr(rows, "to_arrow"):
        return rows.to_arrow()
    if module == "pandas" and hasattr(rows, "to_dict"):
        return pa.Table.from_pandas(rows, preserve_index=False)
    return None


def _run_here(cfg: JobConfig, session: EngineSession | None, positions: dict):
    """(JobResult, the result rows' table) of cfg's job in this process: on the session's engine, else on
    one loaded for it and closed at its end. `positions` gets each row id's places in the input as the
    job reads it (more than one where ids repeat)."""
    with api_errors():
        resolved = resolve(cfg, dry=True)       # dry: no output directory is checked or made

    def reader():
        for batch in read_rows(cfg.input.dataset, resolved.fmt, id_column=cfg.input.id_column, batch_rows=1024,
                               csv_delimiter=cfg.input.csv_delimiter, max_row_bytes=cfg.input.max_row_bytes):
            for row in batch:
                positions.setdefault(row.id, []).append(row.index)
            yield batch
    job = _open_job(cfg, resolved, session, reader)
    return _run_job(job, session), job.writer.table()


def _run_rows(rows: list, config: str | None, options: dict, session: EngineSession) -> list[dict]:
    """EngineSession.run_rows: the rows as the job reader's batches, their results as the RowSink kept
    them (keep_rows), in the rows' order. The config names a dataset and an output that nothing opens."""
    _refuse_file_options(options, "run_rows")
    root = f"memory://jobrunner-rows-{uuid.uuid4().hex}"
    dataset = f"{root}/rows.jsonl"
    try:
        cfg = build_config(dataset, {**options, "output": f"{root}/output"}, config)
        if (cfg.parallel.data_parallel or 1) != 1:
            raise JobConfigError("run_rows runs in this process: data_parallel must be 1")
        if not rows:
            if cfg.output.fail_on_empty:
                raise JobConfigError("rows is empty; failing, as fail_on_empty asks")
            return []
        return _rows_in_order(_run_kept(cfg, rows, session, options), rows)
    except JobConfigError as e:         # the rows are named as such, not as a memory:// dataset
        raise JobConfigError(api_message(str(e), dataset)) from None


def _run_kept(cfg: JobConfig, rows: list, session: EngineSession, options: dict) -> list[dict]:
    """cfg's job over `rows` (reader batches of ROWS_BATCH, as read_rows gives a file's) on the session's
    engine: the result rows as written, the kind's values in them."""
    batches = lambda: (rows[i:i + ROWS_BATCH] for i in range(0, len(rows), ROWS_BATCH))  # noqa: E731
    job = _open_job(cfg, _resolve_rows(cfg), session, batches, rows_in_memory=len(rows))
    kept = job.writer.keep_rows()       # before the run: every row the job writes
    _raise_unless_ok(cfg, _run_job(job, session), options)
    return kept


def _rows_in_order(results: list[dict], rows: list) -> list[dict]:
    """Result rows sorted by their input row's place in `rows` (as _in_input_order), samples in order."""
    positions: dict = {}
    for i, row in enumerate(rows):
        positions.setdefault(row.id, []).append(i)
    places = _input_places([r["id"] for r in results], [r.get("error") for r in results], positions)
    keys = [(place, r.get("sample_index") or 0) for place, r in zip(places, results)]
    return [r for _, r in sorted(zip(keys, results), key=lambda t: t[0])]


def _refuse_file_options(options: dict, call: str) -> None:
    """A call over rows in memory takes no dataset, format or output (and no unknown option)."""
    given = sorted(k for k in _NOT_HERE if options.get(k) is not None)
    if given:
        raise JobConfigError(f"{call} takes its rows in memory and returns them: no {', '.join(given)} "
                             "option (jobrunner.submit runs a job over files)")
    check_known(options, _NOT_HERE)


def _resolve_rows(cfg: JobConfig):
    """What resolve finds for a job over Rows in memory: the checks that need no file (the template's
    and constraint's syntax, n > 1 at a greedy default), the model, its precision, the result cache's URL."""
    with api_errors():
        checks.check_template(cfg.prompt.template, cfg.input.dataset, [])
        checks.check_constraint(cfg.kind, cfg.engine.grammar_timeout)
        resolved = replace(resolve_engine(cfg), fmt=ROWS_FORMAT, cache_url=cache_url(cfg))
        check_sampling(cfg, resolved.model)
    return resolved


def _open_job(cfg: JobConfig, resolved, session: EngineSession | None, reader, rows_in_memory: int | None = None):
    """cfg's Job over reader's batches, its rows kept in memory: on the session's engine, else on one
    loaded for it (open_job closes it again if a later part fails). rows_in_memory: how many rows the
    reader holds when no file is behind them (run_rows): the progress total, and the RowSink types its
    tables from the rows themselves; else open_job counts the dataset and declares its schema."""
    engine = session.engine_for(cfg, resolved) if session is not None else None
    no_file = rows_in_memory is not None
    progress = Progress(total=rows_in_memory, counters=engine.counters) if no_file and engine is not None else None
    with api_errors():
        return open_job(cfg, resolved, engine=engine, reader=reader, progress=progress, in_memory=True,
                        schema_from_rows=no_file)


def _run_job(job, session: EngineSession | None) -> JobResult:
    """job.run(); then its engine closed (one loaded for it) or the session told how the call ended."""
    clean = False
    try:
        with api_errors(running=True):
            result = job.run()
        clean = result.exit_code not in (EXIT_INTERRUPTED, EXIT_FAILED)
    finally:
        if session is None:
            job.engine.close()
        else:
            session.call_ended(clean)
    return result


def _in_input_order(df, positions: dict):
    """Result rows sorted by their input row's position (by id, as the job read them), samples in order.
    Where an id repeats, its first row holds the first place and the later rows' error rows (job.py:
    "duplicate id ...") the later places, in the order they were written (the order they were read)."""
    if df.is_empty():
        return df
    errors = df["error"].to_list() if "error" in df.columns else [None] * df.height
    order = pl.Series("__position", _input_places(df["id"].to_list(), errors, positions))
    keys = ["__position"] + (["sample_index"] if "sample_index" in df.columns else [])
    return df.with_columns(order).sort(keys, maintain_order=True).drop("__position")


def _input_places(ids: list, errors: list, positions: dict) -> list[int]:
    """Each result row's input position (ids as written, errors beside them; positions: id key -> its
    input rows' places). A repeated id's first row holds its first place, its duplicate error rows the
    later places, in the order they were written."""
    later: dict = {}                # id -> how many of its duplicate error rows have their place
    order = []
    for i, error in zip(ids, errors):
        key = id_key(i)
        places = positions.get(key, [len(positions)])
        if isinstance(error, str) and error.startswith("duplicate id ") and len(places) > 1:
            k = later[key] = later.get(key, 0) + 1
            order.append(places[min(k, len(places) - 1)])
        else:
            order.append(places[0])
    return order
