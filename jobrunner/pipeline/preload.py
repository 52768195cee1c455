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
from jobrunner.config.job import JobConfig
from jobrunner.dataset import count_rows, read_rows
from jobrunner.pipeline import checks
from jobrunner.models.known import model_record, resolve_model
from jobrunner.output import read_manifest
from jobrunner.output import layout
from jobrunner.output.done import DoneRows, Occurrences
from jobrunner.output.layout import PART_RE
from jobrunner.output.values import id_key

log = logging.getLogger("jobrunner")


def check_sampling(cfg: JobConfig, model: str) -> None:
    """--n > 1 at temperature 0, given or left to the checkpoint (`model`: its resolved path) whose
    default is greedy: JobConfigError now (JobConfig.sampling_params' own check), not once the model
    is up. A checkpoint whose generation_config.json can't be read cheaply is left to that check."""
    if cfg.kind.name != "generate" or cfg.sampling.n < 2:
        return
    defaults = {} if cfg.sampling.temperature is not None else _generation_defaults(model)
    if defaults is not None:
        cfg.sampling_params(defaults)


def check_empty(cfg: JobConfig, fmt: str) -> None:
    """--fail-on-empty on a dataset without rows: JobConfigError (exit 2) before anything is written."""
    if cfg.output.fail_on_empty:
        checks.check_not_empty(cfg, fmt)


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


def rows_all_done(cfg: JobConfig, fmt: str) -> int | None:
    """The number of rows to read, when every one is already in the output (a rerun with nothing left
    to do: each row's id's occurrence, as the intake skips it, output/done.py); else None. Cheap first:
    only an output with parts holding at least as many rows as the dataset (count_rows) has is compared
    row by row; a damaged part, a dataset too large to count, or any doubt answers None (the job then
    runs as usual)."""
    if cfg.output.overwrite:
        return None
    try:
        if not read_manifest(cfg.output_url):
            return None
        n = count_rows(cfg.input.dataset, fmt)
        if n is None:
            return None
        n = min(n, cfg.input.limit) if cfg.input.limit is not None else n
        done = _done_ids(cfg.output_url, n)
        if done is None:
            return None
        read, occurrences = 0, Occurrences()
        for batch in read_rows(cfg.input.dataset, fmt, id_column=cfg.input.id_column, columns=[cfg.input.id_column],
                             csv_delimiter=cfg.input.csv_delimiter, max_row_bytes=cfg.input.max_row_bytes):
            ids = [row.id for row in batch[:n - read]]
            read += len(ids)
            if not all(done.contains(ids, occurrences.number(ids))):
                return None
            if read >= n:
                break
    except Exception as e:      # anything odd: the usual path finds and reports it
        log.debug("could not tell whether rows are left to do: %s", e)
        return None
    _check_same_model(cfg)
    return n


def _check_same_model(cfg: JobConfig) -> None:
    """A Hub model's branch that moved since the output was written is refused, as when the model
    is loaded (checks.check_same_commit): the output is another commit's."""
    if not hub.is_hub_name(cfg.engine.model):
        return
    try:
        record = model_record(cfg.engine.model, resolve_model(cfg.engine.model))
    except ModelError:
        return
    if record is not None:
        checks.check_same_commit(cfg, {"hub": record})


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
