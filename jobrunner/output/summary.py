"""The job summary (_stats.json): figures about every row in the output, however many runs wrote it.

Row figures (rows, tokens, cache hit rate, latency percentiles, job metrics) are recomputed from
the part files, so they are exact after a resume, and after a kill -9 that wrote no stats. Time,
engine counters and cost come from the runs: each run's record (JobStats.summary, or
parallel.stats.merge_stats for a data-parallel run) is kept in `runs`, carried forward from the previous
_stats.json, and the top level sums them; a run killed before it wrote one (kill -9) is found in the
time record its last part holds (output/parts.py, RUN_METADATA: its wall and device time up to that
part; `killed` true) and joins `runs`. `runs_recorded` says how many runs that is. Throughput and the
cost per million tokens are the output's computed rows and tokens over every run's time. The prefix
optimum is the output's only when one run planned every row (the first, on an empty output); after a
resume each run's own is in `runs`, never summed. The parts are read a few columns and one part at a
time (bounded memory). Rows kept in memory (output.RowSink: jobrunner.generate) are summed the same
way, over their tables (`summary_of`).
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping

import pyarrow as pa
import pyarrow.compute as pc

from jobrunner.output.columns import reserved_columns
from jobrunner.common.run_stats import IMAGE_SUMS, PREFIX_KEYS, PREFIX_SUMS, REUSE_SUMS, ROW_SUMS, JobStats, cost_saved, rates, summed
from jobrunner.output import EXTRA_JSON, iter_result_parts, read_stats, stored_values
from jobrunner.output.done import DUPLICATE_ERROR_RE
from jobrunner.output.parts import RUN_METADATA
from jobrunner.jobs import KINDS
from jobrunner.jobs.metrics import job_metrics

# Run figures that add up over runs (the rows of different runs are disjoint). Not the prefix plan's: a
# resumed run plans again the rows a killed one had planned.
RUN_SUMS = ROW_SUMS + ("duplicate_ids", "wall_s", "model_load_s", "device_hours") + REUSE_SUMS
# A killed run's figures from its parts' time records: summed over its workers (their own parts), but its wall.
_KILLED_SUMS = ROW_SUMS + ("device_hours", "cost_usd", "devices")
# The last run's: its hardware, whether it was interrupted, and for a data-parallel run its workers.
LATEST = ("device", "devices", "model_weight_bytes", "quantization", "interrupted", "workers", "data_parallel",
          "batch_invariant", "numerics_version")
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
    """The summary of the rows `tables` holds (row figures, as part_figures') and of the recorded runs,
    with the runs killed before they recorded one (their parts' time records) put in order among them."""
    marks: dict[tuple, dict] = {}
    s = table_figures(tables, config, marks)
    metrics = s.pop("metrics", None)
    runs = _in_order(runs, killed_runs(marks.values(), runs))
    s.update({k: v for k, v in over_runs(runs, s).items() if k != "duplicate_ids"})    # the parts' count
    if metrics is not None:
        s["metrics"] = metrics
    s["runs_recorded"] = len(runs)
    s["runs"] = runs
    return s


def over_runs(runs: list[dict], rows: Mapping | None = None) -> dict:
    """Time, throughput, prefix optimum (the output's: `output_plan`), engine counters, images (when a run
    read any) and cost over the runs, and the last run's LATEST figures. rows: the output's row figures
    (ROW_SUMS), what throughput and the cost per million tokens count; else the runs' own. Empty when no
    run is recorded."""
    if not runs:
        return {}
    sums = summed(runs, RUN_SUMS)
    out = {k: sums[k] for k in ("wall_s", "model_load_s", "device_hours", "duplicate_ids") + REUSE_SUMS}
    if any(k in r for r in runs for k in IMAGE_SUMS):      # a run that read images (jobrunner/images)
        out.update(summed(runs, IMAGE_SUMS))
    figures = {**sums, **({k: rows[k] for k in ROW_SUMS if k in rows} if rows else {})}
    plan = output_plan(runs)
    if plan is not None:
        out.update({k: plan[k] for k in PREFIX_KEYS})
        figures.update({k: plan[k] for k in PREFIX_SUMS})
    derived = rates(figures, None)
    del derived["cache_hit_rate"]           # the parts give the whole output's
    out.update(derived)
    priced = [r for r in runs if r.get("cost_usd") is not None]
    if priced:
        cost = sum(r["cost_usd"] for r in priced)
        tokens = figures["computed_prompt_tokens"] + figures["computed_completion_tokens"] if rows else sum(
            r.get("computed_prompt_tokens", r["prompt_tokens"]) + r.get("computed_completion_tokens",
                                                                        r["completion_tokens"]) for r in priced)
        out["cost_usd"] = cost
        out["cost_per_million_tokens"] = cost / tokens * 1e6 if tokens else None
        out["cost_saved_usd"] = cost_saved(cost, tokens, sum(r.get("tokens_saved") or 0 for r in priced))
    engines = [r["engine"] for r in runs if isinstance(r.get("engine"), dict)]
    if engines:
        keys = dict.fromkeys(k for e in engines for k in e)
        out["engine"] = {k: sum(e.get(k) or 0 for e in engines) for k in keys}
    out.update({k: runs[-1][k] for k in LATEST if k in runs[-1]})
    return out


def output_plan(runs: list[dict]) -> dict | None:
    """The run whose prefix plan is the output's: the only run that planned rows, when it was the first
    and found the output empty. None otherwise (each run's own plan stays in its record)."""
    planned = [r for r in runs if r.get("planned_prompt_tokens")]
    if len(planned) == 1 and planned[0] is runs[0] and not planned[0].get("rows_skipped_done"):
        return planned[0]
    return None


def killed_runs(marks: Iterable[dict], runs: list[dict]) -> list[dict]:
    """The runs whose parts hold time records (`marks`: each writer's last) and that recorded no run
    record of their own (killed): one record each, its workers' figures summed, its wall their longest."""
    recorded = {i for r in runs for i in (r.get("run_id"), *(r.get("run_ids") or ())) if i}
    by_run: dict[str, list[dict]] = {}
    for m in marks:
        if m.get("run_id") and m["run_id"] not in recorded:
            by_run.setdefault(m["run_id"], []).append(m)
    out = []
    for run_id, ms in by_run.items():
        r = {"run_id": run_id, "started_at": min(m["started_at"] for m in ms), "killed": True, "interrupted": True,
             "wall_s": max(m["wall_s"] for m in ms), "model_load_s": max(m.get("model_load_s") or 0 for m in ms),
             "device": ms[0].get("device"), "quantization": ms[0].get("quantization")}
        r.update({k: sum(m[k] for m in ms) for k in _KILLED_SUMS if all(k in m for m in ms)})
        out.append(r)
    return out


def _in_order(runs: list[dict], killed: list[dict]) -> list[dict]:
    """`runs` with each killed run before the first that started at or after it."""
    out = list(runs)
    for k in sorted(killed, key=lambda r: r["started_at"]):
        later = (i for i, r in enumerate(out) if not r.get("killed") and (r.get("started_at") or "") >= k["started_at"])
        out.insert(next(later, len(out)), k)
    return out


def part_figures(output_url: str, config: Mapping) -> dict:
    """Row figures over every readable part (JobStats.row_figures keys), plus `metrics` when the
    job has them (classify and generate with a reference column, score)."""
    return table_figures(lambda columns: iter_result_parts(output_url, columns), config)


def table_figures(tables: Tables, config: Mapping, marks: dict | None = None) -> dict:
    """part_figures over the tables `tables` gives (each with the columns asked for that it has). marks:
    filled with each writer's last time record (RUN_METADATA), by (run, part prefix)."""
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
    duplicates = 0                  # rows written as a repeated id's error (output/done.py): every run's
    incomplete = []                 # per constrained sample: cut by max_tokens before its grammar ended
    checked = []                    # per sample under a JSON schema: did its output validate
    for table in tables(lambda names: wanted + [reference(names)]):
        _add_rows(stats, table, samples)
        if "error" in table.column_names:
            duplicates += pc.sum(pc.match_substring_regex(table["error"], DUPLICATE_ERROR_RE)).as_py() or 0
        if marks is not None:
            _add_mark(marks, table)
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
    s["duplicate_ids"] = duplicates
    if incomplete:
        s[CONSTRAINED_INCOMPLETE] = sum(map(bool, incomplete))
    if checked:
        s["schema_valid"] = sum(map(bool, checked))
        s["schema_invalid"] = len(checked) - s["schema_valid"]
    if metrics is not None:
        s["metrics"] = metrics.summary()
    return s


def _add_mark(marks: dict, t: pa.Table) -> None:
    """A part's time record, kept where it is its writer's latest (the longest wall)."""
    raw = (t.schema.metadata or {}).get(RUN_METADATA)
    try:
        mark = json.loads(raw) if raw else None
    except ValueError:
        return
    if not isinstance(mark, dict) or not isinstance(mark.get("wall_s"), (int, float)):
        return
    key = (mark.get("run_id"), mark.get("part_prefix"))
    if key not in marks or mark["wall_s"] > marks[key]["wall_s"]:
        marks[key] = mark


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
    worked = pc.and_(pc.greater(pc.fill_null(col("prompt_tokens", 0), 0), 0), pc.is_valid(col("prefill_s", 0.0)))
    reached = pc.or_(pc.is_null(col("error", None)), worked)         # as stats.reached_engine
    computed = pc.and_(pc.and_(first, computed_sample), reached)
    n_first, n_ok = total(first), total(ok)
    stats.rows += n_first
    stats.rows_ok += n_ok
    stats.rows_failed += n_first - n_ok
    stats.rows_computed += total(computed)
    stats.prompt_tokens += total(col("prompt_tokens", 0), pc.and_(first, reached))
    stats.computed_prompt_tokens += total(col("prompt_tokens", 0), computed)
    stats.cached_tokens += total(col("cached_tokens", 0), computed)
    stats.completion_tokens += total(col("completion_tokens", 0))
    stats.computed_completion_tokens += total(col("completion_tokens", 0), computed_sample)
    timed = pc.and_(ok, computed_sample)
    latencies = [pc.filter(col(f"{k}_s", 0.0), timed).to_pylist() for k in ("queue", "prefill", "decode")]
    for q, p, d in zip(*latencies):
        stats.add_latencies(q or 0.0, p or 0.0, d or 0.0)
