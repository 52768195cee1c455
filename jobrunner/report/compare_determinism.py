"""Two outputs made batch-invariant (--deterministic) with the same model, settings and numeric path: every
common row whose inputs are unchanged must hold the same bits on both sides, however each night batched,
chunked, cached or resumed it. A row that differs in any result column is a determinism failure (a bug to
report), not a change of the model or the data; `compare` lists those rows and fails the `determinism` gate
(exit 3)."""
from __future__ import annotations

import polars as pl

from jobrunner.output.columns import RUN_COLUMNS
from jobrunner.report.source import Output, collect

IDS_SHOWN = 10
_SAME = ("numerics_version", "config", "model_source", "dataset_format")     # manifest keys that must agree
_SAME_RUN = ("device", "devices", "quantization", "model_weight_bytes")      # _stats.json keys
# the join's keys and what says how a row was run, not what it got
SCHEDULE_COLUMNS = frozenset({"id", "row", "reused", *RUN_COLUMNS})


def invariant_pair(base: Output, cand: Output) -> bool:
    """Both outputs batch-invariant, by the same numeric path, job configuration, model and device kind."""
    a, b = base.manifest, cand.manifest
    return (bool(a.get("batch_invariant")) and bool(b.get("batch_invariant"))
            and all(a.get(k) == b.get(k) for k in _SAME)
            and all(base.stats.get(k) == cand.stats.get(k) for k in _SAME_RUN))


def determinism_failures(base: Output, cand: Output, sides) -> dict:
    """Common rows with equal inputs whose result columns differ in any bit (compared by a hash of them all):
    their count and the first ids in the base's order. `sides`: compare.Sides (its input columns, `own`)."""
    results = sorted((set(base.schema) & set(cand.schema)) - SCHEDULE_COLUMNS - set(sides.inputs))

    def side(out: Output, s: str) -> pl.LazyFrame:
        inputs = pl.struct(sides.inputs).hash() if sides.inputs else pl.lit(0, pl.UInt64)
        return sides.own(out).select(pl.col("id").cast(pl.String), pl.col("row").alias(f"row{s}"),
                                     inputs.alias(f"inputs{s}"), pl.struct(results).hash().alias(f"bits{s}")
                                     ).unique("id", keep="first", maintain_order=True)
    j = side(base, "_b").join(side(cand, "_c"), on="id", how="inner")
    failed = j.filter((pl.col("inputs_b") == pl.col("inputs_c")) & (pl.col("bits_b") != pl.col("bits_c")))
    n = collect(failed.select(pl.len())).item()
    ids = collect(failed.sort("row_b").head(IDS_SHOWN).select("id"))["id"].to_list()
    return {"rows": n, "ids": ids}


def determinism_gate(failures: dict) -> dict:
    return {"gate": "determinism", "limit": 0, "value": failures["rows"], "crossed": failures["rows"] > 0}
