"""What a job can know before its model loads (loading takes minutes): whether the checkpoint's
sampling defaults make --n > 1 greedy, and whether a rerun has any row left to do.

Both only read: a job that exits 2 here has written nothing, and a rerun with nothing left ends
without loading the model (Job.run: finish_done).
"""
from __future__ import annotations

import json
import logging
import posixpath

import pyarrow.parquet as pq

from jobrunner import engine       # engine.DUMMY_CONFIGS, read only for a dummy: model, loads the engine's loader (torch)
from jobrunner.engine import GenerationDefaults, ModelError
from jobrunner.models import hub
from jobrunner.common import storage
from jobrunner.config.sections import InputOptions, OutputOptions, SamplingOptions
from jobrunner.dataset import count_rows, read_rows
from jobrunner.pipeline import checks
from jobrunner.models.known import model_record, resolve_model
from jobrunner.output import read_manifest
from jobrunner.output import layout
from jobrunner.output.done import DoneRows, Occurrences
from jobrunner.output.layout import PART_RE
from jobrunner.output.values import id_key

log = logging.getLogger("jobrunner")


def sampling_defaults(kind: str, sampling: SamplingOptions, model: str) -> dict | None:
    """The checkpoint's sampling defaults (`model`: its resolved path) that --n > 1 is checked against
    before the model loads (resolve.check_sampling: at temperature 0, given or the checkpoint's, it is
    JobConfigError now, not once the model is up); None: nothing to check (not generate, n 1, or a
    checkpoint whose generation_config.json can't be read cheaply: left to the check at load)."""
    if kind != "generate" or sampling.n < 2:
        return None
    return {} if sampling.temperature is not None else _generation_defaults(model)


def check_empty(input: InputOptions, output: OutputOptions, fmt: str) -> None:
    """--fail-on-empty on a dataset without rows: JobConfigError (exit 2) before anything is written."""
    if output.fail_on_empty:
        checks.check_not_empty(input, output, fmt)


def _generation_defaults(path: str) -> dict | None:
    """The checkpoint's sampling defaults (engine.generation_config), {} when it has none (GGUF,
    a built-in dummy), None when finding out would cost more than a small read."""
    if path.startswith("dummy:"):
        path = path[len("dummy:"):]
        if path in engine.DUMMY_CONFIGS:
            return {}
        path = posixpath.dirname(path) if path.endswith(".json") else path
    try:
        fs, root = storage.url_fs(path)
        if not fs.isdir(root):
            return {}                   # a .gguf file: no generation_config.json
        gen = posixpath.join(root, "generation_config.json")
        if not fs.exists(gen):
            return {}
        return GenerationDefaults.from_config(json.loads(fs.cat_file(gen))).sampling
    except Exception:                   # unreachable or unreadable: loading reports it
        return None


def rows_all_done(input: InputOptions, output: OutputOptions, url: str, model: str, fmt: str) -> int | None:
    """The number of rows to read, when every one is already in the output at `url` (`model`: --model; a
    rerun with nothing left to do: each row's id's occurrence, as the intake skips it, output/done.py);
    else None. Cheap first:
    only an output with parts holding at least as many rows as the dataset (count_rows) has is compared
    row by row; a damaged part, a dataset too large to count, or any doubt answers None (the job then
    runs as usual)."""
    if output.overwrite:
        return None
    try:
        if not read_manifest(url):
            return None
        n = count_rows(input.dataset, fmt)
        if n is None:
            return None
        n = min(n, input.limit) if input.limit is not None else n
        done = _done_ids(url, n)
        if done is None:
            return None
        read, occurrences = 0, Occurrences()
        for batch in read_rows(input.dataset, fmt, id_column=input.id_column, columns=[input.id_column],
                               csv_delimiter=input.csv_delimiter, max_row_bytes=input.max_row_bytes):
            ids = [row.id for row in batch[:n - read]]
            read += len(ids)
            if not all(done.contains(ids, occurrences.number(ids))):
                return None
            if read >= n:
                break
    except Exception as e:      # anything odd: the usual path finds and reports it
        log.debug("could not tell whether rows are left to do: %s", e)
        return None
    _check_same_model(output, url, model)
    return n


def _check_same_model(output: OutputOptions, url: str, model: str) -> None:
    """A Hub model's branch that moved since the output was written is refused, as when the model
    is loaded (checks.check_same_commit): the output is another commit's."""
    if not hub.is_hub_name(model):
        return
    try:
        record = model_record(model, resolve_model(model))
    except ModelError:
        return
    if record is not None:
        checks.check_same_commit(output, url, model, {"hub": record})


def _done_ids(output_url: str, at_least: int) -> DoneRows | None:
    """What the output's parts hold, by occurrence; None when they hold fewer than at_least rows."""
    fs, root = storage.url_fs(output_url)
    parts = [storage.join(root, name) for name in layout.names(fs, root) if PART_RE.match(name)]
    rows = 0
    for path in parts:          # footers first: a partial output (the usual resume) reads no id column here
        with fs.open(path, "rb") as f:
            rows += pq.ParquetFile(f).metadata.num_rows
    if rows < at_least:
        return None
    done = DoneRows()
    for path in parts:
        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            t = pf.read(columns=[c for c in ("id", "error") if c in pf.schema_arrow.names], use_threads=False)
            if t.column("id").null_count:
                return None
            keys = [id_key(x) for x in t.column("id").to_pylist()]     # the keys the parts give (output.values)
            done.add(keys, t.column("error") if "error" in t.column_names else None)
    return done
