"""A column's distribution over an output's rows: count, mean, percentiles and a histogram, each one
streaming polars query (what is kept is the figures, never the column)."""
from __future__ import annotations

import math

import polars as pl

from jobrunner.report.source import collect

PERCENTILES = (50, 95, 99)
BINS = 30

__all__ = ["PERCENTILES", "BINS", "distribution", "counts"]


def distribution(lf: pl.LazyFrame, expr: pl.Expr, bins: int = BINS, log: bool = False) -> dict | None:
    """{rows, mean, min, max, p50, p95, p99, hist: {edges, counts, log}} of expr's non-null values
    (percentiles interpolated linearly, as jobrunner.stats.percentile does); None when there are none.

    log: bins equal in log10 over the positive values (a perplexity's or a latency's long tail);
    values <= 0 then count in no bin."""
    integer = lf.select(expr.alias("x")).collect_schema()["x"].is_integer()
    x = lf.select(expr.cast(pl.Float64).alias("x")).filter(pl.col("x").is_not_null() & pl.col("x").is_not_nan())
    aggs = [pl.len().alias("rows"), pl.col("x").mean().alias("mean"), pl.col("x").min().alias("min"),
            pl.col("x").max().alias("max")]
    aggs += [pl.col("x").quantile(q / 100, "linear").alias(f"p{q}") for q in PERCENTILES]
    s = collect(x.select(aggs)).row(0, named=True)
    if not s["rows"]:
        return None
    s["hist"] = _histogram(x, s["min"], s["max"], bins, log, integer and not log)
    return s


def _histogram(x: pl.LazyFrame, lo: float, hi: float, bins: int, log: bool, integer: bool) -> dict:
    """Counts over at most `bins` equal bins from lo to hi (the last bin includes hi).
    integer: each bin a whole number of values wide, centred on them; one bin when lo == hi."""
    value = pl.col("x")
    if log:
        x = x.filter(value > 0)
        positive = collect(x.select(value.min())).item()
        if positive is None:
            return {"edges": [], "counts": [], "log": True}
        lo, hi, value = math.log10(positive), math.log10(hi), value.log10()
    if integer:
        width = float(max(1, math.ceil((hi - lo + 1) / bins)))
        bins, lo = int((hi - lo) // width) + 1, lo - 0.5
    elif hi <= lo:
        bins, width, lo = 1, 1.0, lo - 0.5
    else:
        width = (hi - lo) / bins
    index = ((value - lo) / width).floor().clip(0, bins - 1).cast(pl.Int64).alias("bin")
    found = collect(x.select(index).group_by("bin").agg(pl.len().alias("n")))
    counts = [0] * bins
    for b, n in found.iter_rows():
        counts[b] = n
    edges = [lo + i * width for i in range(bins + 1)]
    return {"edges": [10 ** e for e in edges] if log else edges, "counts": counts, "log": log}


def counts(lf: pl.LazyFrame, expr: pl.Expr, limit: int = 30) -> dict[str, int]:
    """value -> rows, most rows first (then by value), at most `limit` values; a null is "(none)"."""
    v = expr.cast(pl.String).fill_null("(none)").alias("value")
    found = collect(lf.select(v).group_by("value").agg(pl.len().alias("n")))
    return dict(found.sort(["n", "value"], descending=[True, False]).head(limit).iter_rows())
