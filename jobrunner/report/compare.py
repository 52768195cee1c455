"""Two outputs of the same dataset, joined on `id`: the rows only in one, the rows whose result
changed, the metric deltas with a paired test, the token, cost and throughput deltas, the
configuration differences, and the gates a scheduler reads (compare -> its exit code).

Invariants:
- A row is its first sample (sample_index null or 0) on both sides; ids are joined as strings, one
  row per id: the id's own row (its first occurrence in the dataset). A repeated id's duplicate error
  rows are counted apart (`rows.duplicates_in_base` / `_in_candidate`), never joined or changed.
- Missing rows: the base's rows absent from the candidate, a share of the base's rows (an error row
  is present: it was read and answered).
- A common row changed when it failed on one side only, or both are ok and its result differs:
  classify its label (as the metrics key labels: normalized text unless --match exact), generate its
  output text, score its perplexity by more than score_rtol (relative), embed its cosine under
  min_cosine.
- Metrics are paired: over the common rows ok on both sides with a reference (classify: base's
  reference column, else the candidate's; generate: each side's `correct`).
- Both --deterministic, same settings: an unchanged row differing in a bit fails (compare_determinism.py).
- Not comparable (NotComparableError; the CLI's exit 2): different kinds, different input columns,
  no common id, inputs that differ on every common row, or a gate asked of a figure neither has.
"""
from __future__ import annotations

import numpy as np
import polars as pl

from jobrunner.jobs import KINDS
from jobrunner.jobs.metrics import ClassificationMetrics, matches
from jobrunner.output.done import DUPLICATE_ERROR_RE
from jobrunner.output.values import EXTRA_JSON, FIXED_COLUMNS
from jobrunner.report.compare_determinism import determinism_failures, determinism_gate, invariant_pair
from jobrunner.report.distributions import distribution
from jobrunner.report.kind_figures import classification, vector_norm
from jobrunner.report.source import Output, collect, first_samples, open_output
from jobrunner.report.stats_tests import BOOTSTRAP_RESAMPLES, bootstrap_interval, macro_f1, mcnemar_exact

MIN_COSINE = 0.99
SCORE_RTOL = 0.01
TOP_CHANGED = 20
IDS_SHOWN = 10
TEXT_SHOWN = 200                # characters of an output shown in the top changed rows
# configuration keys shown first (what a reader looks for), then the rest in name order
KEYS_FIRST = ("model", "model_source", "template", "system", "quantization", "run.quantization", "dtype",
              "kv_cache_dtype", "dataset", "run.device", "run.devices")
STATS_COMPARED = ("rows", "rows_failed", "prompt_tokens", "completion_tokens", "cache_hit_rate", "wall_s",
                  "cost_usd", "cost_per_million_tokens", "cost_per_row_usd", "device_hours_per_row",
                  "decode_tokens_per_s", "prefill_tokens_per_s", "rows_per_s")

__all__ = ["NotComparableError", "compare", "compare_outputs"]


class NotComparableError(ValueError):
    """The two outputs can't be compared; the message says why."""


def compare(base: str, candidate: str, *, max_changed_rate: float | None = None,
            max_accuracy_drop: float | None = None, max_cost_increase: float | None = None,
            max_missing_rate: float | None = None, min_cosine: float = MIN_COSINE, score_rtol: float = SCORE_RTOL,
            top: int = TOP_CHANGED, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> dict:
    """The comparison of two output directories (any fsspec URLs) as a JSON-able dict, with the
    gates asked for and `exit_code` (0, or 3 when a gate is crossed). Raises NotComparableError."""
    return compare_outputs(open_output(base), open_output(candidate), max_changed_rate=max_changed_rate,
                           max_missing_rate=max_missing_rate,
                           max_accuracy_drop=max_accuracy_drop, max_cost_increase=max_cost_increase,
                           min_cosine=min_cosine, score_rtol=score_rtol, top=top, resamples=resamples, seed=seed)


def compare_outputs(base: Output, cand: Output, *, max_changed_rate=None, max_accuracy_drop=None,
                    max_cost_increase=None, min_cosine=MIN_COSINE, score_rtol=SCORE_RTOL, top=TOP_CHANGED,
                    resamples=BOOTSTRAP_RESAMPLES, seed=0, max_missing_rate=None) -> dict:
    kind = _comparable_kind(base, cand)
    sides = Sides(base, cand, kind)
    rows = sides.overlap()
    if not rows["common"]:
        raise NotComparableError(f"{base.url} and {cand.url} have no id in common: not the same dataset")
    if rows["inputs_changed"] == rows["common"]:
        raise NotComparableError(f"{base.url} and {cand.url} hold different inputs under every common id: "
                                 "not the same dataset")
    changed = sides.changes(min_cosine, score_rtol, top)
    changed["rate"] = changed["rows"] / rows["common"]
    metrics = sides.metrics(resamples, seed)
    costs = cost_deltas(base.stats, cand.stats)
    costs["per_common_row"] = sides.tokens_per_row()
    result = {"base": base.url, "candidate": cand.url, "kind": kind, "rows": rows, "changed": changed,
              "metrics": metrics, "costs": costs, "config_differences": config_differences(base, cand)}
    result["gates"] = gates(result, max_changed_rate, max_accuracy_drop, max_cost_increase)
    if max_missing_rate is not None:
        result["gates"].insert(0, missing_gate(rows, max_missing_rate))
    if invariant_pair(base, cand):      # the same bits expected on every unchanged row: always gated
        result["determinism"] = determinism_failures(base, cand, sides)
        result["gates"].append(determinism_gate(result["determinism"]))
    result["exit_code"] = 3 if any(g["crossed"] for g in result["gates"]) else 0
    return result


def _comparable_kind(base: Output, cand: Output) -> str:
    if base.kind != cand.kind:
        raise NotComparableError(f"{base.url} is a {base.kind} job and {cand.url} a {cand.kind} job")
    if not base.paths or not cand.paths:
        raise NotComparableError(f"{(cand if base.paths else base).url} has no part files yet")
    if input_columns(base) != input_columns(cand):
        raise NotComparableError(f"different datasets: input columns {sorted(input_columns(base))} in {base.url}, "
                                 f"{sorted(input_columns(cand))} in {cand.url}")
    return base.kind


def input_columns(out: Output) -> set[str]:
    """The output's columns that came from the dataset (the id apart)."""
    ours = set(FIXED_COLUMNS) | set(KINDS[out.kind].result_columns) | {"reused", EXTRA_JSON}
    return {c for c in out.columns if c not in ours}


class Sides:
    """The two outputs' first samples, joined on id: `<column>_b` from base, `<column>_c` from the
    candidate, `ok_b` / `ok_c` (no error), `inputs_b` / `inputs_c` (a hash of the input columns)."""

    def __init__(self, base: Output, cand: Output, kind: str):
        self.base, self.cand, self.kind = base, cand, kind
        self.mode = base.config.get("match", "normalized")
        self.inputs = sorted(input_columns(base))
        self.values = {"classify": ["label", "confidence"], "score": ["perplexity", "logprob", "scored_tokens"],
                       "embed": ["embedding"]}.get(kind, ["output", "correct"])
        self.values += ["prompt_tokens", "completion_tokens"]
        self.reference = base.reference_column() or cand.reference_column()
        self.reference_side = base if base.reference_column() else cand
        if kind == "embed":
            b, c = (o.schema.get("embedding") for o in (base, cand))
            if isinstance(b, pl.Array) and isinstance(c, pl.Array) and b.size != c.size:
                raise NotComparableError(f"embeddings of {b.size} dimensions in {base.url}, {c.size} in {cand.url}")

    def side(self, out: Output, suffix: str) -> pl.LazyFrame:
        cols = [pl.col("id").cast(pl.String).alias("id"), pl.col("row").alias(f"row{suffix}"),
                pl.col("error").is_null().alias(f"ok{suffix}"), pl.col("error").alias(f"error{suffix}")]
        cols += [(pl.col(c) if out.has(c) else pl.lit(None)).alias(f"{c}{suffix}") for c in self.values]
        cols.append((pl.struct(self.inputs).hash() if self.inputs else pl.lit(0, pl.UInt64)).alias(f"inputs{suffix}"))
        if self.reference and out is self.reference_side:
            cols.append(pl.col(self.reference).cast(pl.String).alias("reference"))
        return self.own(out).select(cols).unique("id", keep="first", maintain_order=True)

    @staticmethod
    def own(out: Output) -> pl.LazyFrame:
        """One row per id, its own: first samples, not a repeated id's duplicate error rows."""
        return first_samples(out).filter(~_duplicate_row())

    def joined(self) -> pl.LazyFrame:
        return self.side(self.base, "_b").join(self.side(self.cand, "_c"), on="id", how="inner")

    def overlap(self) -> dict:
        b, c = self.side(self.base, "_b"), self.side(self.cand, "_c")
        j = self.joined()
        common, inputs_changed = collect(j.select(pl.len(), (pl.col("inputs_b") != pl.col("inputs_c")).sum())).row(0)

        def only(x, y, row):
            anti = x.join(y.select("id"), on="id", how="anti")
            n = collect(anti.select(pl.len())).item()
            return n, collect(anti.sort(row).head(IDS_SHOWN).select("id"))["id"].to_list()

        only_b, ids_b = only(b, c, "row_b")
        only_c, ids_c = only(c, b, "row_c")
        duplicates = [collect(first_samples(o).filter(_duplicate_row()).select(pl.len())).item()
                      for o in (self.base, self.cand)]
        return {"common": common, "only_in_base": only_b, "only_in_candidate": only_c,
                "only_in_base_ids": ids_b, "only_in_candidate_ids": ids_c, "inputs_changed": inputs_changed,
                "missing_rate": only_b / max(common + only_b, 1),
                "duplicates_in_base": duplicates[0], "duplicates_in_candidate": duplicates[1]}

    # ---------------------------------------------------------------- what changed

    def _label_keys(self, j: pl.LazyFrame) -> dict[str, str]:
        labels = collect(pl.concat([j.select(pl.col("label_b").alias("l")), j.select(pl.col("label_c").alias("l"))])
                         .drop_nulls().unique())["l"].to_list()
        keyer = ClassificationMetrics(self.mode)
        return {label: keyer.key(label) for label in labels}

    def changes(self, min_cosine: float, score_rtol: float, top: int) -> dict:
        j = self.joined()
        both = pl.col("ok_b") & pl.col("ok_c")
        extra: dict = {}
        if self.kind == "classify":
            keys = self._label_keys(j)
            key = {s: pl.col(f"label_{s}").replace_strict(keys, default=None, return_dtype=pl.String) for s in "bc"}
            differs = key["b"].ne_missing(key["c"])
            size = pl.max_horizontal(pl.col("confidence_b"), pl.col("confidence_c")).fill_null(0.0)
            shown = {s: pl.when(pl.col(f"confidence_{s}").is_null()).then(pl.col(f"label_{s}")).otherwise(
                pl.format("{} ({})", pl.col(f"label_{s}"), pl.col(f"confidence_{s}").round(3))) for s in "bc"}
        elif self.kind == "score":
            pb, pc = pl.col("perplexity_b"), pl.col("perplexity_c")
            differs = ((pc - pb).abs() > score_rtol * pb.abs()) | pb.is_null().xor(pc.is_null())
            size = (pc / pb).log().abs().fill_null(float("inf")).fill_nan(float("inf"))
            shown = {s: pl.col(f"perplexity_{s}").round(4).cast(pl.String) for s in "bc"}
        elif self.kind == "embed":
            cosine = _cosine(self.base.schema.get("embedding"))
            j = j.with_columns(cosine.alias("cosine"))
            differs = pl.col("cosine").fill_null(-2.0) < min_cosine
            size = -pl.col("cosine").fill_null(-2.0)
            norm = {s: vector_norm(f"embedding_{s}", self.base.schema.get("embedding")).round(4) for s in "bc"}
            shown = {"b": pl.format("norm {}", norm["b"]),
                     "c": pl.format("norm {}, cosine {}", norm["c"], pl.col("cosine").round(6))}
            extra["cosine"] = distribution(j.filter(both), pl.col("cosine"))
            extra["min_cosine"] = min_cosine
        else:
            differs = pl.col("output_b").ne_missing(pl.col("output_c"))
            size = -pl.col("row_b").cast(pl.Float64)        # the base's order
            shown = {s: pl.col(f"output_{s}").str.slice(0, TEXT_SHOWN) for s in "bc"}
        status = pl.col("ok_b") != pl.col("ok_c")
        j = j.with_columns((status | (both & differs)).alias("changed"), status.alias("status_changed"),
                           size.alias("size"))
        n, n_status = collect(j.select(pl.col("changed").sum(), pl.col("status_changed").sum())).row(0)
        shown_row = [pl.when(pl.col(f"ok_{s}")).then(shown[s]).otherwise(
            pl.lit("error: ") + pl.col(f"error_{s}")).alias("base" if s == "b" else "candidate") for s in "bc"]
        rows = collect(j.filter("changed").sort(["status_changed", "size"], descending=True).head(top)
                       .select("id", *shown_row))
        out = {"rows": n, "status_changed": n_status, "top": rows.to_dicts(), **extra}
        if self.kind == "classify":
            moves = j.filter(pl.col("changed") & both).group_by("label_b", "label_c").agg(pl.len().alias("rows"))
            moves = collect(moves).sort(["rows", "label_b", "label_c"], descending=[True, False, False]).head(top)
            out["transitions"] = [{"base": b, "candidate": c, "rows": r} for b, c, r in moves.iter_rows()]
        return out

    # ---------------------------------------------------------------- paired metrics

    def metrics(self, resamples: int, seed: int) -> dict:
        if self.kind == "classify" and self.reference:
            return self._classify_metrics(resamples, seed)
        if self.kind == "score":
            return self._perplexity()
        if self.values[1] == "correct":
            return self._accuracy(resamples, seed)
        return {}

    def _classify_metrics(self, resamples: int, seed: int) -> dict:
        j = self.joined().filter(pl.col("ok_b") & pl.col("ok_c") & pl.col("reference").is_not_null()
                                 & pl.col("label_b").is_not_null() & pl.col("label_c").is_not_null())
        cells = collect(j.group_by("reference", "label_b", "label_c").agg(
            pl.len().alias("n"), pl.min("row_b").alias("first"))).sort("first")
        if cells.is_empty():
            return {}
        labels = self.base.config.get("labels") or ()
        side = {s: classification(cells.select(pl.col(f"label_{s}").alias("label"), "reference", "n"),
                                  self.mode, labels) for s in "bc"}
        summary = {s: m.summary() for s, m in side.items()}
        ok = {s: np.array([matches(label, ref, self.mode) for ref, label in
                           cells.select("reference", f"label_{s}").iter_rows()], dtype=float) for s in "bc"}
        n = cells["n"].to_numpy()
        out = _accuracy_figures(n, ok["b"], ok["c"], resamples, seed)
        out["macro_f1"] = _delta(summary["b"]["macro_f1"], summary["c"]["macro_f1"])
        out["macro_f1"]["interval"] = bootstrap_interval(n, self._macro_f1_delta(cells, side), resamples, seed)
        names = list(dict.fromkeys([*summary["b"]["per_label"], *summary["c"]["per_label"]]))
        out["per_label"] = {name: {f: _delta(summary["b"]["per_label"].get(name, {}).get(f),
                                             summary["c"]["per_label"].get(name, {}).get(f))
                                   for f in ("precision", "recall", "f1", "support")} for name in names}
        return out

    def _macro_f1_delta(self, cells: pl.DataFrame, side: dict):
        """[resamples, cells] -> each resample's macro-F1 (candidate - base), over the same class keys
        the metrics use: a row's reference class is its prediction where they match (contains)."""
        keyer = side["b"]
        index: dict[str, int] = {}
        flat = {}
        for s in "bc":
            pos = []
            for ref, label in cells.select("reference", f"label_{s}").iter_rows():
                p = keyer.key(label)
                r = p if matches(label, ref, self.mode) else keyer.key(ref)
                pos.append((index.setdefault(r, len(index)), index.setdefault(p, len(index))))
            flat[s] = pos
        k = len(index)
        onehot = {s: np.zeros((len(cells), k * k)) for s in "bc"}
        for s in "bc":
            for i, (r, p) in enumerate(flat[s]):
                onehot[s][i, r * k + p] = 1.0

        def statistic(draws: np.ndarray) -> np.ndarray:
            f1 = {s: macro_f1((draws @ onehot[s]).reshape(-1, k, k)) for s in "bc"}
            return f1["c"] - f1["b"]
        return statistic

    def _accuracy(self, resamples: int, seed: int) -> dict:
        j = self.joined().filter(pl.col("correct_b").is_not_null() & pl.col("correct_c").is_not_null())
        cells = collect(j.group_by("correct_b", "correct_c").agg(pl.len().alias("n")))
        if cells.is_empty():
            return {}
        return _accuracy_figures(cells["n"].to_numpy(), cells["correct_b"].cast(pl.Float64).to_numpy(),
                                 cells["correct_c"].cast(pl.Float64).to_numpy(), resamples, seed)

    def _perplexity(self) -> dict:
        j = self.joined().filter(pl.col("ok_b") & pl.col("ok_c") & (pl.col("scored_tokens_b") > 0)
                                 & (pl.col("scored_tokens_c") > 0))
        s = collect(j.select(pl.len().alias("rows"), *(pl.col(f"{c}_{x}").sum().alias(f"{c}_{x}")
                                                       for c in ("logprob", "scored_tokens") for x in "bc")))
        s = s.row(0, named=True)
        if not s["rows"]:
            return {}
        ppl = {x: float(np.exp(-s[f"logprob_{x}"] / s[f"scored_tokens_{x}"])) for x in "bc"}
        return {"scored_rows": s["rows"], "perplexity": _delta(ppl["b"], ppl["c"])}

    def tokens_per_row(self) -> dict:
        """Mean prompt and completion tokens over the common rows ok on both sides."""
        j = self.joined().filter(pl.col("ok_b") & pl.col("ok_c"))
        s = collect(j.select(*(pl.col(f"{c}_{x}").cast(pl.Float64).mean().alias(f"{c}_{x}")
                               for c in ("prompt_tokens", "completion_tokens") for x in "bc"))).row(0, named=True)
        return {c: _delta(s[f"{c}_b"], s[f"{c}_c"]) for c in ("prompt_tokens", "completion_tokens")}


def _duplicate_row() -> pl.Expr:
    """A repeated id's duplicate error row (output/done.py), not the id's own."""
    return pl.col("error").str.contains(DUPLICATE_ERROR_RE).fill_null(False)


def _cosine(dtype) -> pl.Expr:
    b, c = pl.col("embedding_b"), pl.col("embedding_c")
    dot = (b * c).arr.sum() if isinstance(dtype, pl.Array) else (b * c).list.sum()
    return dot.cast(pl.Float64) / (vector_norm("embedding_b", dtype) * vector_norm("embedding_c", dtype))


def _delta(base, cand) -> dict:
    """{base, candidate, delta, relative} (delta and relative None where a side has no value)."""
    d = cand - base if isinstance(base, (int, float)) and isinstance(cand, (int, float)) else None
    return {"base": base, "candidate": cand, "delta": d,
            "relative": d / abs(base) if d is not None and base else None}


def _accuracy_figures(n: np.ndarray, ok_b: np.ndarray, ok_c: np.ndarray, resamples: int, seed: int) -> dict:
    """Paired accuracy over cells of n rows each, right (1) or wrong (0) on each side."""
    total = n.sum()
    b = int(n[(ok_b == 1) & (ok_c == 0)].sum())     # right only in base
    c = int(n[(ok_b == 0) & (ok_c == 1)].sum())     # right only in the candidate
    acc = _delta(float(n @ ok_b / total), float(n @ ok_c / total))
    acc["interval"] = bootstrap_interval(n, lambda draws: (draws @ (ok_c - ok_b)) / total, resamples, seed)
    return {"evaluated_rows": int(total), "accuracy": acc,
            "mcnemar": {"base_only_right": b, "candidate_only_right": c, "p_value": mcnemar_exact(b, c)}}


def _per_row(stats: dict, key: str) -> float | None:
    return stats[key] / stats["rows"] if stats.get(key) is not None and stats.get("rows") else None


def cost_deltas(base: dict, cand: dict) -> dict:
    """The figures of STATS_COMPARED, each side's _stats.json (per row: over all its rows)."""
    def figures(s):
        return {**s, "cost_per_row_usd": _per_row(s, "cost_usd"), "device_hours_per_row": _per_row(s, "device_hours")}
    b, c = figures(base), figures(cand)
    return {k: _delta(b.get(k), c.get(k)) for k in STATS_COMPARED if b.get(k) is not None or c.get(k) is not None}


def _flatten(d, prefix: str = "") -> dict:
    """{"a.b": value} of a nested dict (a dict's leaves; an empty dict is a leaf)."""
    if not isinstance(d, dict) or (prefix and not d):
        return {prefix: d}
    out: dict = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def config_differences(base: Output, cand: Output) -> list[dict]:
    """The job configurations' (manifests') and runs' (device, quantization) differing keys."""
    def flat(out: Output) -> dict:
        d = _flatten(out.config) if out.config else {}
        d.update({k: out.manifest[k] for k in ("model_source", "dataset_format") if k in out.manifest})
        d.update({f"run.{k}": out.stats[k] for k in ("device", "devices", "quantization", "model_weight_bytes")
                  if k in out.stats})
        return d
    a, b = flat(base), flat(cand)
    keys = [k for k in KEYS_FIRST if k in a or k in b] + sorted((set(a) | set(b)) - set(KEYS_FIRST))
    return [{"key": k, "base": a.get(k), "candidate": b.get(k)} for k in keys if a.get(k) != b.get(k)]


def missing_gate(rows: dict, max_missing_rate: float) -> dict:
    """--max-missing-rate: the share of the base's rows the candidate lacks (error rows are present)."""
    rate = rows["missing_rate"]
    return {"gate": "max_missing_rate", "limit": max_missing_rate, "value": rate, "crossed": rate > max_missing_rate}


def gates(result: dict, max_changed_rate, max_accuracy_drop, max_cost_increase) -> list[dict]:
    """Each gate asked for: {gate, limit, value, crossed}; NotComparableError when its figure is missing."""
    out = []
    if max_changed_rate is not None:
        rate = result["changed"]["rate"]
        out.append({"gate": "max_changed_rate", "limit": max_changed_rate, "value": rate,
                    "crossed": rate > max_changed_rate})
    if max_accuracy_drop is not None:
        acc = (result["metrics"].get("accuracy") or {})
        if acc.get("delta") is None:
            raise NotComparableError("--max-accuracy-drop: no rows with a reference in common (give the job "
                                     "--reference-column)")
        drop = -acc["delta"]
        out.append({"gate": "max_accuracy_drop", "limit": max_accuracy_drop, "value": drop,
                    "crossed": drop > max_accuracy_drop})
    if max_cost_increase is not None:
        costs = result["costs"]
        basis = next((k for k in ("cost_per_row_usd", "device_hours_per_row")
                      if (costs.get(k) or {}).get("relative") is not None), None)
        if basis is None:
            raise NotComparableError("--max-cost-increase: the two outputs' runs recorded no cost or device-hours "
                                     "to compare")
        increase = costs[basis]["relative"]
        out.append({"gate": "max_cost_increase", "limit": max_cost_increase, "value": increase, "basis": basis,
                    "crossed": increase > max_cost_increase})
    return out
