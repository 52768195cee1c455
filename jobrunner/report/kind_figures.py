"""Each job kind's figures from an output's rows: classify (labels, and with a reference column the
metrics, confusion matrix and calibration), generate (completion lengths, finish reasons, schema
checks), score (perplexity), embed (dimensions, norms).

Classification is grouped first: one streaming query counts the rows of each (label, reference,
confidence bin), and jobs.metrics.ClassificationMetrics (the summary's own accumulator) is fed those
counts in the order of each group's first row, so the metrics, labels and their spellings are the
ones _stats.json gives for the same rows."""
from __future__ import annotations

import math

import polars as pl

from jobrunner.jobs.metrics import ClassificationMetrics, matches
from jobrunner.report.distributions import counts, distribution
from jobrunner.report.source import Output, collect, first_samples

RELIABILITY_BINS = 10           # equal confidence bins over [0, 1]

__all__ = ["RELIABILITY_BINS", "kind_figures", "label_groups", "classification", "vector_norm"]


def kind_figures(out: Output) -> dict:
    """The figures of out's kind ({} for a kind without figures of its own)."""
    make = {"classify": classify_figures, "generate": generate_figures, "tokens": generate_figures,
            "score": score_figures, "embed": embed_figures}.get(out.kind)
    return make(out) if make else {}


def ok_rows(out: Output) -> pl.LazyFrame:
    """The first samples of the rows without an error."""
    return first_samples(out).filter(pl.col("error").is_null())


def label_groups(lf: pl.LazyFrame, label: str, reference: str | None, confidence: str | None) -> pl.DataFrame:
    """(label, reference, bin, n, confidence_sum, first) of lf's labelled rows, in the order of each
    group's first row; reference and bin null where the output has none."""
    ref = pl.col(reference).cast(pl.String) if reference else pl.lit(None, pl.String)
    conf = pl.col(confidence).cast(pl.Float64) if confidence else pl.lit(None, pl.Float64)
    bin_ = (conf * RELIABILITY_BINS).floor().clip(0, RELIABILITY_BINS - 1).cast(pl.Int64)
    keyed = lf.filter(pl.col(label).is_not_null()).select(
        pl.col(label).alias("label"), ref.alias("reference"), bin_.alias("bin"), conf.alias("confidence"), "row")
    groups = keyed.group_by(["label", "reference", "bin"]).agg(
        pl.len().alias("n"), pl.col("confidence").sum().alias("confidence_sum"), pl.col("row").min().alias("first"))
    return collect(groups).sort("first")


def classification(groups: pl.DataFrame, mode: str, labels=()) -> ClassificationMetrics:
    """The accumulator over label_groups' counts (rows with a reference)."""
    m = ClassificationMetrics(mode, labels)
    for label, reference, n in groups.select("label", "reference", "n").iter_rows():
        if reference is not None:
            m.add(label, reference, n)
    return m


def classify_figures(out: Output) -> dict:
    cfg = out.config
    mode, labels, ref = cfg.get("match", "normalized"), cfg.get("labels") or (), out.reference_column()
    groups = label_groups(ok_rows(out), "label", ref, "confidence" if out.has("confidence") else None)
    fig: dict = {"labels": _predicted(groups, mode, labels),
                 "confidence": distribution(ok_rows(out), pl.col("confidence"), bins=20)
                 if out.has("confidence") else None}
    evaluated = groups.filter(pl.col("reference").is_not_null())
    if ref is None or evaluated.is_empty():
        return fig
    m = classification(groups, mode, labels).summary()
    cm = m["confusion_matrix"]
    fig["metrics"] = m
    fig["reference_labels"] = dict(zip(cm["labels"], map(sum, cm["counts"])))
    fig["predicted_labels"] = dict(zip(cm["labels"], map(sum, zip(*cm["counts"]))))
    fig["reliability"] = reliability(evaluated, mode)
    return fig


def _predicted(groups: pl.DataFrame, mode: str, labels) -> dict[str, int]:
    """Predicted label -> rows (all labelled rows, with a reference or not), keyed as the metrics key
    labels and spelled as configured, else as first predicted; most rows first."""
    keyer = ClassificationMetrics(mode, labels)
    names = {keyer.key(label): label for label in reversed(labels)}
    totals: dict[str, int] = {}
    for label, n in groups.select("label", "n").iter_rows():
        k = keyer.key(label)
        names.setdefault(k, label)
        totals[k] = totals.get(k, 0) + n
    return dict(sorted(((names[k], n) for k, n in totals.items()), key=lambda kv: (-kv[1], kv[0])))


def reliability(evaluated: pl.DataFrame, mode: str) -> dict | None:
    """Per confidence bin: rows, mean confidence, accuracy; and the expected calibration error
    (sum over bins of rows / all rows x |accuracy - mean confidence|). None without confidences."""
    rows = [(b, n, s, matches(label, ref, mode)) for label, ref, b, n, s in
            evaluated.filter(pl.col("bin").is_not_null())
            .select("label", "reference", "bin", "n", "confidence_sum").iter_rows()]
    if not rows:
        return None
    bins = []
    for b in range(RELIABILITY_BINS):
        n = sum(r[1] for r in rows if r[0] == b)
        conf = sum(r[2] for r in rows if r[0] == b)
        correct = sum(r[1] for r in rows if r[0] == b and r[3])
        bins.append({"bin": b, "low": b / RELIABILITY_BINS, "high": (b + 1) / RELIABILITY_BINS, "rows": n,
                     "confidence": conf / n if n else None, "accuracy": correct / n if n else None})
    total = sum(b["rows"] for b in bins)
    ece = sum(b["rows"] / total * abs(b["accuracy"] - b["confidence"]) for b in bins if b["rows"])
    return {"bins": bins, "ece": ece, "rows": total}


def generate_figures(out: Output) -> dict:
    samples = out.scan().filter(pl.col("error").is_null())      # every sample of the rows without an error
    fig: dict = {"completion_tokens": distribution(samples, pl.col("completion_tokens")),
                 "finish_reasons": counts(out.scan(), pl.col("finish_reason"))}
    if out.has("correct"):
        c = collect(out.scan().select(pl.col("correct").count().alias("evaluated"),
                                      pl.col("correct").sum().alias("correct"))).row(0, named=True)
        if c["evaluated"]:
            fig["accuracy"] = {"evaluated_rows": c["evaluated"], "accuracy": c["correct"] / c["evaluated"]}
    for name in ("schema_valid", "constrained_incomplete"):
        if out.has(name):
            v = collect(out.scan().select(pl.col(name).sum().alias("true"), pl.col(name).count().alias("checked")))
            true, checked = v.row(0)
            if checked:
                fig[name] = {"true": true, "false": checked - true}
    if out.has("truncated_tokens"):
        fig["truncated_rows"] = collect(ok_rows(out).select((pl.col("truncated_tokens") > 0).sum())).item()
    return fig


def score_figures(out: Output) -> dict:
    rows = ok_rows(out)
    fig: dict = {"perplexity": distribution(rows, pl.col("perplexity"), log=True)}
    scored = rows.filter(pl.col("logprob").is_not_null() & (pl.col("scored_tokens") > 0))
    total = collect(scored.select(pl.col("logprob").sum().alias("logprob"),
                                  pl.col("scored_tokens").sum().alias("tokens"))).row(0, named=True)
    if total["tokens"]:
        fig["scored_tokens"] = total["tokens"]
        fig["mean_logprob"] = total["logprob"] / total["tokens"]
        fig["overall_perplexity"] = math.exp(-fig["mean_logprob"])
    return fig


def vector_norm(name: str, dtype: pl.DataType) -> pl.Expr:
    """The L2 norm of a vector column (Array or List of floats)."""
    x = pl.col(name)
    squares = (x * x).arr.sum() if isinstance(dtype, pl.Array) else x.list.eval(pl.element() ** 2).list.sum()
    return squares.cast(pl.Float64).sqrt()


def embed_figures(out: Output) -> dict:
    if not out.has("embedding"):
        return {}
    dtype = out.schema["embedding"]
    rows = ok_rows(out).filter(pl.col("embedding").is_not_null())
    size = pl.col("embedding").arr.len() if isinstance(dtype, pl.Array) else pl.col("embedding").list.len()
    return {"dimensions": {int(k): n for k, n in counts(rows, size).items()},
            "norm": distribution(rows, vector_norm("embedding", dtype))}
