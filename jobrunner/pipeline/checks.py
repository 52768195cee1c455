"""Pre-flight checks: every way a job's configuration can fail, found before any row runs.
Each raises JobConfigError with a message that says what to fix. Each takes the sections of the job's
configuration it reads (jobrunner/config/sections.py); jobrunner/pipeline/resolve.py calls them in order."""
from __future__ import annotations

import logging
import os

from jobrunner.config.job import JobConfigError
from jobrunner.config.constraints import check_job_constraint as check_constraint  # noqa: F401 (a check: resolve uses it)
from jobrunner.config.sections import EngineOptions, InputOptions, KindOptions, OutputOptions, ParallelOptions
from jobrunner.dataset import DatasetError, count_rows, dataset_columns, detect_format
from jobrunner.dataset.csv_reader import SNIFFED, check_quotes
from jobrunner.pipeline.exit_codes import on_empty_dataset
from jobrunner.pipeline.precision import cuda_count
from jobrunner.pipeline.openai_check import check_openai_batch
from jobrunner.openai.batch import FORMAT as OPENAI_FORMAT
from jobrunner.openai.scores import TEMPLATE_FIELDS as PAIR_FIELDS
from jobrunner.output import OutputError, check_output as check_output_dir, read_manifest
from jobrunner.common.storage import credentials_error
from jobrunner.jobs import KINDS
from jobrunner.jobs.template import PromptTemplate

log = logging.getLogger("jobrunner")


# The options that name an input column, and the kinds or settings that read it.
COLUMN_OPTIONS = ("id_column", "prompt_column", "messages_column", "labels_column", "reference_column",
                  "score_column", "schema_column", "image_column")


def check_dataset(input: InputOptions, named: dict[str, str]) -> tuple[str, list[str]]:
    """(format, columns) of the dataset, read once here: a format it is not, an unclosed CSV quote, an
    OpenAI batch file's bad lines, or a column that `named` (option -> column: named_columns) gives
    and the dataset lacks."""
    try:
        fmt = detect_format(input.dataset, input.format)
        columns = dataset_columns(input.dataset, fmt, input.csv_delimiter)
        if fmt == "csv":        # before any work: an unclosed quote would swallow the rest of the file
            check_quotes(input.dataset, input.csv_max_lines, input.csv_delimiter)
    except DatasetError as e:
        raise JobConfigError(str(e)) from None
    except (OSError, ValueError) as e:
        raise JobConfigError(f"cannot read dataset {input.dataset}: {e}") from None
    except Exception as e:      # an object store without credentials: one line, exit 2
        if (err := credentials_error(input.dataset, e)) is None:
            raise
        raise JobConfigError(str(err)) from None
    if fmt == "openai-batch":
        check_openai_batch(input)           # every line a unique string custom_id, before any work
        return fmt, columns
    for name, column in named.items():
        if columns and column not in columns:
            raise JobConfigError(f"--{name.replace('_', '-')} {column!r} is not a column of {input.dataset}; "
                                 f"its columns are: {', '.join(columns)}{_delimiter_hint(fmt, columns)}")
    return fmt, columns


def named_columns(options: dict, given: frozenset, kind: str, prompt_template: str | None) -> dict[str, str]:
    """The input columns a job names, option -> column (check_dataset checks each is there): every column
    option the user set (`given`: a typo never falls back to a default: --id-column nope would number the
    rows), those a kind or setting reads, and the prompt column when the prompt comes from it. options:
    JobConfig.options(); kind: its name."""
    wanted = [name for name in COLUMN_OPTIONS if options.get(name) and name in given]
    wanted += [name for name in ("messages_column", "labels_column", "reference_column", "score_column",
                                 "schema_column", "image_column") if options.get(name) and name not in wanted]
    from_ids = getattr(KINDS[kind], "prompt_ids_column", None)     # the tokens kind: no prompt text
    if not (prompt_template or options.get("messages_column") or from_ids) and "prompt_column" not in wanted:
        wanted.append("prompt_column")
    return {name: options[name] for name in wanted}


def _delimiter_hint(fmt: str, columns: list[str]) -> str:
    """For a CSV whose header read as one column holding another delimiter: how to say which one."""
    if fmt != "csv" or len(columns) != 1:
        return ""
    inside = [d for d in SNIFFED if d in columns[0]]
    if not inside:
        return ""
    shown = "\\t" if inside[0] == "\t" else inside[0]
    return f" (one column: is the file {shown!r}-separated? pass --csv-delimiter '{shown}')"


def check_template(text: str | None, dataset: str, columns: list[str], fmt: str | None = None) -> PromptTemplate | None:
    """The --template (`text`) parsed, its fields checked against the dataset's columns; None without one."""
    if not text:
        return None
    try:
        template = PromptTemplate(text)
    except ValueError as e:
        raise JobConfigError(f"--template: {e}") from None
    if fmt == OPENAI_FORMAT:        # a score or rerank line's pair (jobs.pairs) fills {query} and {document}
        columns = [*columns, *PAIR_FIELDS]
    missing = template.missing_columns(columns) if columns else []
    if missing:
        raise JobConfigError(f"--template uses {', '.join(missing)}, not columns of {dataset}; "
                             f"its columns are: {', '.join(columns)}")
    return template


def check_output(url: str, fingerprint: dict, overwrite: bool) -> None:
    """The problems of the output at `url` for a job of `fingerprint` (JobConfig.fingerprint_fields), before
    a model loads; creates the directory (OSError if it can't, storage.CredentialsError when the object
    store finds no credentials)."""
    try:
        check_output_dir(url, fingerprint, overwrite)
    except OutputError as e:
        raise JobConfigError(str(e)) from None
    except OSError as e:        # an object store's errors may not name the URL ("Forbidden")
        if url in str(e):
            raise
        raise type(e)(f"{url}: {e}") from e
    except Exception as e:      # an object store without credentials: a CredentialsError, exit 4
        if (err := credentials_error(url, e)) is None:
            raise
        raise err from None


def check_not_empty(input: InputOptions, output: OutputOptions, fmt: str) -> None:
    """on_empty_dataset when a count finds no rows (for a data-parallel launch, whose workers each
    see only a share); a dataset too large to count is not empty."""
    try:
        n = 0 if input.limit == 0 else count_rows(input.dataset, fmt)
    except DatasetError as e:
        raise JobConfigError(str(e)) from None
    if n == 0:
        on_empty_dataset(input, output)


def check_dimensions(kind: KindOptions, model_config) -> None:
    """embed: --dimensions keeps the first N values of the model's hidden size; no more than it has
    (`kind`: the job's kind section)."""
    dimensions = getattr(kind, "dimensions", None)      # EmbedKind's
    if dimensions is not None and dimensions > model_config.hidden_size:
        raise JobConfigError(f"--dimensions {dimensions} exceeds the model's embedding size "
                             f"{model_config.hidden_size}; give at most that")


def check_same_commit(output: OutputOptions, url: str, model: str, manifest: dict) -> None:
    """A job resumed on a Hub name (`model`: --model) whose branch moved since its first run would mix
    two models' outputs in the output at `url`: refuse it, naming the commit to pin (the fingerprint has
    the name, not the commit)."""
    if output.overwrite or "hub" not in manifest:
        return
    try:
        before = ((read_manifest(url) or {}).get("hub") or {}).get("commit")
    except OutputError:
        return      # open_writer says what is wrong with the output
    now, repo = manifest["hub"]["commit"], manifest["hub"]["repo"]
    if before and before != now:
        raise JobConfigError(f"{url} was written by {repo} at commit {before}, but {model} is now "
                             f"commit {now}; resuming would mix two models' outputs. Start over with --overwrite, "
                             f"or keep the old model with -m {repo}@{before} and another --output")


def open_writer(output: OutputOptions, url: str, manifest: dict, writer_cls, part_prefix: str = "part", schema=None,
                done_ids=None):
    """The job's writer into the output at `url`, with the output schema declared up front where given
    (jobrunner.output.schema), so that every part has the kind's columns whatever rows it holds."""
    try:
        return writer_cls(url, manifest, part_rows=output.part_rows, overwrite=output.overwrite,
                          part_prefix=part_prefix, flush_seconds=output.flush_seconds, schema=schema,
                          done_ids=done_ids)
    except OutputError as e:
        raise JobConfigError(str(e)) from None


def check_gpus(engine: EngineOptions, parallel: ParallelOptions, workers: int = 1) -> None:
    """JobConfigError unless `workers` engines of --tensor-parallel GPUs each fit the visible GPUs (from
    cuda:N's N with --device cuda:N). Nothing to check on CPU."""
    gpus = cuda_count(engine.device)
    if gpus == 0 or engine.device == "cpu":
        return
    base = int(engine.device.split(":")[1]) if engine.device.startswith("cuda:") else 0
    need, tp = workers * parallel.tensor_parallel, parallel.tensor_parallel
    if base + need <= gpus:
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = f"{gpus} GPU{'s' if gpus > 1 else ''} visible" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible else "")
    if workers > 1 and tp == 1:
        raise JobConfigError(f"--data-parallel {workers} but there are {seen} (one worker per GPU)")
    if workers > 1:
        raise JobConfigError(f"--data-parallel {workers} x --tensor-parallel {tp} needs {need} GPUs, but there "
                             f"are {seen}; lower --data-parallel (the default is {max(1, gpus // tp)})")
    where = f" from {engine.device}" if base else ""
    raise JobConfigError(f"--tensor-parallel {tp}{where} needs {base + tp} GPUs, but there are {seen}")


def check_spread_device(device: str, spread: str) -> None:
    """A job spread over several engines takes GPUs by count, not one named GPU; `spread` says how to."""
    if device.startswith("cuda:"):
        raise JobConfigError(f"--device {device} names one GPU; {spread}")
