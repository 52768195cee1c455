"""Every figure of the report, as one JSON-able dict (no plotting here): the summary, the kind's
figures, latency and token distributions, each run's throughput and progress, the failed rows and
the job's configuration.

Row figures (rows, tokens, cache hits, latencies) are computed from the parts as the summary
(output/summary.py) counts them: a row is its first sample; reused rows are no work done; latencies
are over the ok rows that were computed. Time, throughput and cost exist only in the runs' records
(_stats.json). Latency percentiles here are exact over every row (the summary's come from a sample
past jobrunner.stats.LATENCY_SAMPLE rows)."""
from __future__ import annotations

from datetime import datetime, timezone

import polars as pl

from jobrunner.report.distributions import distribution
from jobrunner.report.kind_figures import kind_figures, ok_rows
from jobrunner.report.source import Output, collect, first_samples

FAILED_SHOWN = 50               # failed rows listed, in the parts' order
ERROR_GROUPS = 20               # distinct error messages listed, most rows first
IDS_PER_GROUP = 5
# the run records' figures the summary shows (the parts have no clock)
FROM_RUNS = ("optimum_cache_hit_rate", "planned_prompt_tokens", "block_optimum_cached_tokens", "optimum_exact", "wall_s", "model_load_s", "decode_tokens_per_s", "prefill_tokens_per_s",
             "rows_per_s", "cost_usd", "cost_per_million_tokens", "cost_saved_usd", "device", "devices",
             "quantization", "runs_recorded", "rows_reused", "rows_from_cache", "tokens_saved", "interrupted")
RUN_FIGURES = ("started_at", "rows", "rows_skipped_done", "wall_s", "rows_per_s", "decode_tokens_per_s",
               "prefill_tokens_per_s", "device", "interrupted")
MANIFEST_FIGURES = ("model_source", "dataset_format", "created_at", "updated_at", "complete", "fingerprint")

__all__ = ["report_figures", "row_counts"]


def report_figures(out: Output) -> dict:
    return {"output": out.url, "kind": out.kind, "partial": out.partial,
            "complete": bool(out.manifest.get("complete")), "summary": summary(out), "by_kind": kind_figures(out),
            "latency": latency(out), "tokens": tokens(out), "runs": runs(out), "progress": progress(out),
            "failures": failures(out), "config": {"job": out.config, **{k: out.manifest[k] for k in
                                                                        MANIFEST_FIGURES if k in out.manifest}}}


def _col(out: Output, name: str, default) -> pl.Expr:
    """A column, or a constant where the output lacks it (a part not written by jobrunner)."""
    return pl.col(name) if out.has(name) else pl.when(pl.col("row").is_not_null()).then(pl.lit(default))


def row_counts(out: Output) -> dict:
    """rows, rows_ok, rows_failed, rows_computed, the token sums and the cache hit rate, as
    summary._add_rows counts them."""
    first = (pl.col("sample_index").fill_null(0) == 0) if out.has("sample_index") else pl.col("row").is_not_null()
    computed_sample = ~_col(out, "reused", False).cast(pl.Boolean).fill_null(False)
    ok = first & pl.col("error").is_null()
    prompt = _col(out, "prompt_tokens", 0).fill_null(0)
    reached = pl.col("error").is_null() | (prompt > 0)
    computed = first & computed_sample & reached

    def total(x: pl.Expr, mask: pl.Expr | None = None) -> pl.Expr:
        return (x if mask is None else pl.when(mask).then(x).otherwise(0)).cast(pl.Int64).sum()

    completion = _col(out, "completion_tokens", 0).fill_null(0)
    s = collect(out.scan().select(
        total(first).alias("rows"), total(ok).alias("rows_ok"), total(computed).alias("rows_computed"),
        total(prompt, first).alias("prompt_tokens"), total(prompt, computed).alias("computed_prompt_tokens"),
        total(_col(out, "cached_tokens", 0).fill_null(0), computed).alias("cached_tokens"),
        total(completion).alias("completion_tokens"),
        total(completion, computed_sample).alias("computed_completion_tokens"))).row(0, named=True)
    s["rows_failed"] = s["rows"] - s["rows_ok"]
    s["cache_hit_rate"] = s["cached_tokens"] / s["computed_prompt_tokens"] if s["computed_prompt_tokens"] else 0.0
    if out.has("draft_tokens"):     # a run with --speculative: its rows' drafted and kept tokens
        s.update(collect(out.scan().select(total(pl.col("draft_tokens").fill_null(0)).alias("draft_tokens"),
                                           total(pl.col("accepted_tokens").fill_null(0)).alias("accepted_tokens")))
                 .row(0, named=True))
        s["acceptance_rate"] = s["accepted_tokens"] / s["draft_tokens"] if s["draft_tokens"] else 0.0
    return s


def summary(out: Output) -> dict:
    s = row_counts(out)
    s.update({k: out.stats[k] for k in FROM_RUNS if out.stats.get(k) is not None})
    metrics = out.stats.get("metrics")
    by_kind = {k: v for k, v in (metrics or {}).items() if not isinstance(v, (dict, list))}
    if by_kind:
        s["metrics"] = by_kind
    return s


def timed_rows(out: Output) -> pl.LazyFrame:
    """The ok rows that were computed (not reused): those whose latencies mean something."""
    return ok_rows(out).filter(~_col(out, "reused", False).cast(pl.Boolean).fill_null(False))


def latency(out: Output) -> dict:
    return {k: distribution(timed_rows(out), _col(out, f"{k}_s", 0.0).fill_null(0.0))
            for k in ("queue", "prefill", "decode")}


def tokens(out: Output) -> dict:
    """Prompt and cached tokens per row, completion tokens per sample, over the rows without an error."""
    return {"prompt": distribution(ok_rows(out), _col(out, "prompt_tokens", 0)),
            "cached": distribution(timed_rows(out), _col(out, "cached_tokens", 0)),
            "completion": distribution(out.scan().filter(pl.col("error").is_null()),
                                       _col(out, "completion_tokens", 0))}


def _epoch(iso: str | None) -> float | None:
    try:
        return datetime.strptime(iso, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()
    except (TypeError, ValueError):
        return None


def runs(out: Output) -> list[dict]:
    """Each recorded run's figures (RUN_FIGURES), in the order they ran."""
    return [{k: r.get(k) for k in RUN_FIGURES} for r in out.stats.get("runs") or []]


def progress(out: Output) -> list[dict]:
    """Rows written over each run's time: a point per part, {run (its index in runs; None for a part
    of no recorded run), seconds (the part's write time since its run started; started_at is to the
    second), rows (the run's rows so far)}, each run starting at (0, 0)."""
    timed = sorted((t, p) for p, t in enumerate(out.part_times) if t is not None)
    if not timed:
        return []
    lf = pl.scan_parquet(out.paths, include_file_paths="path", missing_columns="insert", extra_columns="ignore")
    if out.has("sample_index"):
        lf = lf.filter(pl.col("sample_index").fill_null(0) == 0)
    per_path = dict(collect(lf.group_by("path").agg(pl.len())).iter_rows())
    rows = [per_path.get(p, 0) for p in out.paths]
    records = out.stats.get("runs") or []
    owners = _owners_by_rows(timed, rows, records) or _owners_by_time(timed, records)
    points, done = [], {}
    for (t, part), run in zip(timed, owners):
        if run not in done:
            points.append({"run": run, "seconds": 0.0, "rows": 0})
            done[run] = 0
        start = _epoch(records[run].get("started_at")) if run is not None else None
        done[run] += rows[part]
        points.append({"run": run, "seconds": max(0.0, t - (start if start is not None else timed[0][0])),
                       "rows": done[run]})
    return points


def _owners_by_rows(timed: list[tuple[float, int]], rows: list[int], records: list[dict]) -> list | None:
    """Each part's run, filling the runs in order with the rows each recorded; None unless every
    row of the parts is a recorded run's (a run killed before its record breaks the count)."""
    counts = [r.get("rows") for r in records]
    if not counts or None in counts or sum(counts) != sum(rows[p] for _, p in timed):
        return None
    owners, run, filled = [], 0, 0
    for _, part in timed:
        while run < len(counts) - 1 and filled >= counts[run]:
            run, filled = run + 1, 0
        owners.append(run)
        filled += rows[part]
    return owners


def _owners_by_time(timed: list[tuple[float, int]], records: list[dict]) -> list:
    """Each part's run: the last that started before the part was written (None: before any)."""
    starts = sorted((t, i) for i, t in ((i, _epoch(r.get("started_at"))) for i, r in enumerate(records))
                    if t is not None)
    return [next((i for start, i in reversed(starts) if start <= t), None) for t, _ in timed]


def failures(out: Output) -> dict:
    """The failed rows: how many, grouped by their error message, and the first FAILED_SHOWN."""
    failed = first_samples(out).filter(pl.col("error").is_not_null())
    ident = pl.col("id").cast(pl.String)
    groups = collect(failed.group_by("error").agg(
        pl.len().alias("rows"), pl.col("row").min().alias("first"),
        ident.sort_by("row").head(IDS_PER_GROUP).alias("ids")))
    groups = groups.sort(["rows", "first"], descending=[True, False])
    first = collect(failed.sort("row").head(FAILED_SHOWN).select(ident.alias("id"), "error"))
    return {"rows": int(groups["rows"].sum()) if len(groups) else 0, "messages": len(groups),
            "groups": groups.head(ERROR_GROUPS).select("error", "rows", "ids").to_dicts(),
            "first": first.to_dicts()}
