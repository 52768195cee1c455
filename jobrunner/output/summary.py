"""The job summary (_stats.json): figures about every row in the output, however many runs wrote it.

Row figures (rows, tokens, cache hit rate, latency percentiles, job metrics) are recomputed from
the part files, so they are exact after a resume, and after a kill -9 that wrote no stats. Time,
throughput, engine counters and cost exist only for runs that recorded them: each run's record
(JobStats.summary, or parallel.stats.merge_stats for a data-parallel run) is kept in `runs`, carried
forward from the previous _stats.json, and the top level sums them; `runs_recorded` says how many
runs that is. The parts are read a few columns and one part at a time (bounded memory). Rows kept in
memory (output.RowSink: jobrunner.generate) are summed the same way, over their tables (`summary_of`).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import pyarrow as pa
import pyarrow.compute as pc

from jobrunner.output.columns import reserved_columns
from jobrunner.stats import IMAGE_SUMS, PREFIX_SUMS, REUSE_SUMS, ROW_SUMS, JobStats, cost_saved, rates, summed
from jobrunner.output import EXTRA_JSON, iter_result_parts, read_stats, stored_values
from jobs import KINDS
from jobs.metrics import job_metrics

# Run figures that add up over runs (the rows of different runs are disjoint).
RUN_SUMS = ROW_SUMS + ("duplicate_ids", "wall_s", "model_load_s", "device_hours") + PREFIX_SUMS + REUSE_SUMS
# The last run's: its hardware, whether it was interrupted, and for a data-parallel run its workers.
LATEST = ("device", "devices", "model_weight_bytes", "quantization", "interrupted", "workers", "data_parallel")
CONSTRAINED_INCOMPLETE = "constrained_incomplete"     # generate's column and the summary's count
SCHEMA_VALID = "schema_valid"       # generate's column; the summary counts schema_valid and schema_invalid
_ROW_COLUMNS = ("error", "sample_index", "prompt_tokens", "cached_tokens", "completion_tokens",
                "queue_s", "prefill_s", "decode_s", "reused")


def stored_name(column: str, result_columns, present) -> str | None:
    """The name input `column` has in the output (see jobrunner.output.columns): itself, unless a result
    column takes that name; then input_<column>, or input_input_<column> when that is taken by an
    input too, and so on: the longest such name present. None when it is not in `present`."""
    if column not in reserved_columns(result_columns):
        return column if column in present else None
    name, found = f"input_{column}", None
    while name in present:
        name, found = f"input_{name}", name
    return found


# columns to read (a function of a table's column names, as iter_result_parts takes it) -> the tables
Tables = Callable[[Callable[[list[str]], list[str]]], Iterable[pa.Table]]


def job_summary(output_url: str, config: Mapping, run: dict | None = None) -> dict:
    """The summary of every row in the output. config: the job's (JobConfig.fingerprint_fields() or
    the manifest's); run: this run's record, appended to the runs the previous _stats.json holds."""
    previous = read_stats(output_url) or {}
    runs = list(previous.get("runs") or []) + ([run] if run is not None else [])
    return summary_of(lambda columns: iter_result_parts(output_url, columns), config, runs)


def summary_of(tables: Tables, config: Mapping, runs: list[dict]) -> dict:
    """The summary of the rows `tables` holds (row figures, as part_figures') and of the recorded runs."""
    s = table_figures(tables, config)
    metrics = s.pop("metrics", None)
    s.update(over_runs(runs))
    if metrics is not None:
        s["metrics"] = metrics
    s["runs_recorded"] = len(runs)
    s["runs"] = runs
    return s


def over_runs(runs: list[dict]) -> dict:
    """Time, throughput, prefix optimum, engine counters, images (when a run read any) and cost over the
    recorded runs, and the
    last run's LATEST figures. Empty when no run is recorded."""
    if not runs:
        return {}
    sums = summed(runs, RUN_SUMS)
    out = {k: sums[k] for k in ("wall_s", "model_load_s", "device_hours", "duplicate_ids") + REUSE_SUMS}
    if any(k in r for r in runs for k in IMAGE_SUMS):      # a run that read images (jobrunner/images)
        out.update(summed(runs, IMAGE_SUMS))
    planned = [r for r in runs if r.get("planned_prompt_tokens")]
    if planned:
        out.update({k: sums[k] for k in PREFIX_SUMS})
        out["optimum_exact"] = all(r.get("optimum_exact") for r in planned)
    derived = rates(sums, None)
    del derived["cache_hit_rate"]           # the parts give the whole output's
    out.update(derived)
    priced = [r for r in runs if r.get("cost_usd") is not None]
    if priced:
        cost = sum(r["cost_usd"] for r in priced)
        tokens = sum(r["prompt_tokens"] + r["completion_tokens"] for r in priced)
        out["cost_usd"] = cost
        out["cost_per_million_tokens"] = cost / tokens * 1e6 if tokens else None
        out["cost_saved_usd"] = cost_saved(cost, tokens, sum(r.get("tokens_saved") or 0 for r in priced))
    engines = [r["engine"] for r in runs if isinstance(r.get("engine"), dict)]
    if engines:
        keys = dict.fromkeys(k for e in engines for k in e)
        out["engine"] = {k: sum(e.get(k) or 0 for e in engines) for k in keys}
    out.update({k: runs[-1][k] for k in LATEST if k in runs[-1]})
    return out


def part_figures(output_url: str, config: Mapping) -> dict:
    """Row figures over every readable part (JobStats.row_figures keys), plus `metrics` when the
    job has them (classify and generate with a reference column, score)."""
    return table_figures(lambda columns: iter_result_parts(output_url, columns), config)


def table_figures(tables: Tables, config: Mapping) -> dict:
    """part_figures over the tables `tables` gives (each with the columns asked for that it has)."""
    kind, ref = config.get("kind", "generate"), config.get("reference_column")
    result_columns = KINDS[kind].result_columns
    metrics = job_metrics(kind, config.get("match", "normalized"), ref is not None, config.get("labels") or ())
    # a row's samples: --n, or an OpenAI line's own n (sample_index 0, 1, ...; the first counts the row)
    samples = "sample_index" in result_columns
    wanted = list(_ROW_COLUMNS)
    if metrics is not None:
        wanted += [c for c in metrics.columns if c != "reference"]
    constrained = kind == "generate"
    if constrained:
        wanted += [CONSTRAINED_INCOMPLETE, SCHEMA_VALID]
    if metrics is not None or samples or constrained:      # values that did not fit the pinned schema
        wanted.append(EXTRA_JSON)

    def reference(names):           # the reference column's name in a part (None: not there)
        return stored_name(ref, result_columns, names) if ref else None

    stats = JobStats()
    incomplete = []                 # per constrained sample: cut by max_tokens before its grammar ended
    checked = []                    # per sample under a JSON schema: did its output validate
    for table in tables(lambda names: wanted + [reference(names)]):
        _add_rows(stats, table, samples)
        if constrained:
            incomplete += [v for v in stored_values(table, CONSTRAINED_INCOMPLETE) if v is not None]
            checked += [v for v in stored_values(table, SCHEMA_VALID) if v is not None]
        if metrics is not None:
            cols = {c: stored_values(table, c) for c in metrics.columns if c != "reference"}
            if "reference" in metrics.columns:
                name = reference(table.column_names)
                cols["reference"] = stored_values(table, name) if name else [None] * table.num_rows
            metrics.add_columns(cols)
    s = stats.row_figures()
    if incomplete:
        s[CONSTRAINED_INCOMPLETE] = sum(map(bool, incomplete))
    if checked:
        s["schema_valid"] = sum(map(bool, checked))
        s["schema_invalid"] = len(checked) - s["schema_valid"]
    if metrics is not None:
        s["metrics"] = metrics.summary()
    return s


def _add_rows(stats: JobStats, t: pa.Table, samples: bool) -> None:
    """One part's rows into stats, as JobStats.add_row counts them: a row of n > 1 samples counts once
    (its first sample: sample_index null or 0) but for its completion tokens; reused rows count apart
    (rows_computed and computed_*) and give no cached tokens; ok computed rows give latencies."""
    def total(values, mask=None):
        return pc.sum(values if mask is None else pc.filter(values, mask)).as_py() or 0

    def col(name, default):         # a part not written by jobrunner may lack a column
        return t.column(name) if name in t.column_names else pa.array([default] * t.num_rows)

    first = pa.array([i in (None, 0) for i in stored_values(t, "sample_index")] if samples
                     else [True] * t.num_rows, pa.bool_())
    computed_sample = pc.invert(pc.fill_null(col("reused", False).cast(pa.bool_()), False))
    ok = pc.and_(first, pc.is_null(col("error", None)))
    reached = pc.or_(pc.is_null(col("error", None)), pc.greater(pc.fill_null(col("prompt_tokens", 0), 0), 0))
    computed = pc.and_(pc.and_(first, computed_sample), reached)     # as stats.reached_engine
    n_first, n_ok = total(first), total(ok)
    stats.rows += n_first
    stats.rows_ok += n_ok
    stats.rows_failed += n_first - n_ok
    stats.rows_computed += total(computed)
    stats.prompt_tokens += total(col("prompt_tokens", 0), first)
    stats.computed_prompt_tokens += total(col("prompt_tokens", 0), computed)
    stats.cached_tokens += total(col("cached_tokens", 0), computed)
    stats.completion_tokens += total(col("completion_tokens", 0))
    stats.computed_completion_tokens += total(col("completion_tokens", 0), computed_sample)
    timed = pc.and_(ok, computed_sample)
    latencies = [pc.filter(col(f"{k}_s", 0.0), timed).to_pylist() for k in ("queue", "prefill", "decode")]
    for q, p, d in zip(*latencies):
        stats.add_latencies(q or 0.0, p or 0.0, d or 0.0)
