"""The Python API: `submit` a job over a dataset (here), or `generate` over rows in memory, once or on
an engine held open (`open_engine`: jobrunner/api/session.py).

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

import logging
import tomllib
from collections.abc import Mapping
from contextlib import contextmanager

from jobrunner.api.messages import api_message, check_known
from jobrunner.config.job import JobConfig, JobConfigError, config_fields, field_value
from jobrunner.dataset import DatasetError
from jobrunner.pipeline.build import finish_done, open_job
from jobrunner.pipeline.ending import JobResult
from jobrunner.pipeline.resolve import resolve
from jobrunner.output import OutputError
from jobrunner.output.lease import OutputBusyError, OutputLease
from jobrunner.parallel import distributed_env, run_parallel, wants_parallel
from jobrunner.parallel.ray_driver import run_ray
from jobrunner.common.storage import CredentialsError, credentials_error, store_failure

log = logging.getLogger("jobrunner")

__all__ = ["JobConfigError", "JobFailedError", "JobResult", "OutputStorageError", "build_config", "read_toml",
           "run", "submit"]


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
    under torchrun), or over Ray actors (--ray), holding the output's lease throughout (one writer at a
    time: jobrunner/output/lease.py). Errors as `submit`'s; an output another job holds: JobConfigError."""
    with output_lease(cfg):
        return _run(cfg)


@contextmanager
def output_lease(cfg: JobConfig):
    """The output's lease for this job, once for all its workers: under torchrun rank 0 takes it."""
    env = distributed_env()
    if env is not None and env["rank"] != 0:
        yield None
        return
    lease = None
    try:            # one try from before the lease is taken: a signal at any moment still releases it
        try:
            lease = OutputLease(cfg.output_url)
            lease.acquire()
        except OutputBusyError as e:
            raise JobConfigError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - a store that refuses it, or is down: exit 4 (a storage failure)
            lease = None
            lease_refused(cfg, e)
        yield lease
    finally:
        if lease is not None:
            lease.release()         # never raises: the job's own error, if any, stays the one reported


def lease_refused(cfg: JobConfig, e: Exception) -> None:
    """A lease the store would not give for a reason other than another job holding it: OutputStorageError
    (exit 4) naming the reason, or with --lease-optional a warning, and the job runs without one. No
    credentials or no permission to write: resolve's checks stop the job, in their order (a bad input first,
    exit 2; then check_output, which writes in the output directory, exit 4)."""
    if any(credentials_error(cfg.output_url, x) is not None or isinstance(x, PermissionError)
           for x in (e, e.__cause__) if x is not None):
        return
    why = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
    if not cfg.output.lease_optional:
        raise OutputStorageError(
            f"output {cfg.output_url}: cannot take its lease ({why}); nothing was run. Fix the storage (or its "
            "permissions), or pass --lease-optional to run without a lease (a second job on this output "
            "would then not be stopped)") from None
    log.warning("output %s: cannot take its lease (%s); the job runs without one (--lease-optional), and a "
                "second job on this output would not be stopped", cfg.output_url, why)


def _run(cfg: JobConfig) -> JobResult:
    if cfg.parallel.ray is not None:    # workers as Ray actors: jobrunner/parallel/ray_driver.py
        with api_errors(running=True):
            return run_ray(cfg)
    if wants_parallel(cfg):     # one worker per engine, or a rank under torchrun: jobrunner.parallel
        with api_errors(running=True):
            return run_parallel(cfg)
    with api_errors():
        resolved = resolve(cfg)
        job = None if resolved.rows_done is not None else open_job(cfg, resolved)
    if job is None:                 # a rerun with nothing left to do: no model
        with api_errors(running=True):
            return finish_done(cfg, resolved)
    try:
        with api_errors(running=True):
            return job.run()
    finally:
        # with --tensor-parallel the engine's other ranks are processes, ended here rather than at the
        # process's exit (an API caller may go on for hours)
        job.engine.close()


@contextmanager
def api_errors(running: bool = False):
    """Exceptions a user can cause, as the API raises them: a DatasetError is a JobConfigError; an
    OSError (and while running the writer's OutputError, a failed write) an OutputStorageError."""
    try:
        yield
    except (JobConfigError, OutputStorageError):
        raise
    except DatasetError as e:
        raise JobConfigError(str(e)) from e
    except Exception as e:
        if not (isinstance(e, OutputError) or store_failure(e)):
            raise
        if running:         # one line, the error that stopped the job (a store gone down mid-job)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise OutputStorageError(f"output storage failed: {first}. Nothing written is lost; "
                                     "fix the storage and run the same command again to resume.") from e
        if isinstance(e, OutputError):
            raise
        if isinstance(e, CredentialsError):    # already says which credentials the output's store lacks
            raise OutputStorageError(str(e)) from e
        # the output directory can't be created (checks.check_output)
        raise OutputStorageError(f"{e}; check the path and its permissions, or choose another --output") from e
