"""Small outputs for the report and compare tests, written as a job writes them: the real
ResultWriter under the kind's declared schema, parts of a few rows, then _stats.json from the
parts and the given run records (output/summary.job_summary), the manifest marked complete."""
from __future__ import annotations

import glob
import math
import os
import random

import polars as pl
import pyarrow as pa

from jobrunner.output import ResultWriter, write_stats
from jobrunner.output.completion import mark_complete
from jobrunner.output.schema import VECTOR, declared_schema
from jobrunner.output.summary import job_summary
from jobrunner.output.values import vector_kind
from jobrunner.jobs import KINDS
from jobrunner.jobs.metrics import matches

LABELS = ["positive", "negative", "neutral"]
INPUTS = {"prompt": pa.string(), "input_label": pa.string()}
ERRORS = ["prompt of 300 tokens exceeds the model's context of 256 tokens", "template: column 'text' is missing"]


def write_output(path, kind: str, rows: list[dict], config: dict | None = None, runs: list[dict] | None = None,
                 inputs: dict | None = None, part_rows: int = 4, vector_size: int = 4,
                 part_times: list[float] | None = None) -> str:
    """An output directory at path; returns its URL (str(path))."""
    url = str(path)
    config = {"kind": kind, "dataset": "data.jsonl", "model": "tiny", "template": None, "quantization": "none",
              **(config or {})}
    kinds = {n: vector_kind(vector_size) if k == VECTOR else k for n, k in KINDS[kind].result_columns.items()}
    schema = declared_schema(pa.string(), INPUTS if inputs is None else inputs, kinds)
    w = ResultWriter(url, {"config": config, "model_source": "tiny (/models/tiny)", "dataset_format": "jsonl"},
                     part_rows=part_rows, schema=schema)
    for i in range(0, len(rows), part_rows):
        w.write(rows[i:i + part_rows])
    w.flush()
    if part_times is not None:
        for name, t in zip(sorted(glob.glob(f"{url}/part*.parquet")), part_times):
            os.utime(name, (t, t))
    summary = None
    for run in runs or [run_record(rows)]:
        summary = job_summary(url, config, run)
        write_stats(url, summary)
    mark_complete(url, summary)
    return url


def run_record(rows: list[dict], wall_s: float = 10.0, cost_usd: float | None = 0.02,
               started_at: str = "2026-01-02T03:00:00Z", **extra) -> dict:
    """A run's record as JobStats.summary gives it (the figures the report takes from runs)."""
    ok = [r for r in rows if r.get("error") is None]
    r = {"started_at": started_at, "rows": len(rows), "rows_ok": len(ok), "rows_failed": len(rows) - len(ok),
         "prompt_tokens": sum(r.get("prompt_tokens") or 0 for r in rows), "cached_tokens": 0,
         "completion_tokens": sum(r.get("completion_tokens") or 0 for r in rows), "rows_skipped_done": 0,
         "wall_s": wall_s, "model_load_s": 1.5, "device": "cpu", "devices": 1, "device_hours": wall_s / 3600,
         "quantization": "none", "interrupted": False, "decode_tokens_per_s": 5.0, "prefill_tokens_per_s": 50.0,
         "rows_per_s": len(rows) / wall_s}
    if cost_usd is not None:
        r["cost_usd"] = cost_usd
    r.update(extra)
    return r


def base_row(i: int, rng: random.Random, error: str | None = None) -> dict:
    ok = error is None
    return {"id": f"r{i:03d}", "output": None, "finish_reason": "stop" if ok else None,
            "prompt_tokens": rng.randint(20, 60) if ok or i % 2 else 0,
            "cached_tokens": rng.randint(0, 16) if ok else 0,
            "completion_tokens": 0, "queue_s": rng.uniform(0, 0.5), "prefill_s": rng.uniform(0.01, 0.2),
            "decode_s": rng.uniform(0.0, 0.05), "error": error, "prompt": f"review {i}", "reused": i % 9 == 4}


def classify_rows(n: int = 40, seed: int = 0, flips: dict[str, str] | None = None,
                  errors: set[int] = frozenset({5, 16, 27})) -> list[dict]:
    """n classify rows: reference LABELS[i % 3], a prediction right about 70% of the time, some spelled
    with a capital (one class under normalized match), confidences in [0.34, 1]; flips: id -> label."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        ref = LABELS[i % 3]
        pred = ref if rng.random() < 0.7 else rng.choice(LABELS)
        conf = rng.uniform(0.34, 1.0)
        r = base_row(i, rng, ERRORS[i % 2] if i in errors else None)
        r["input_label"] = ref
        if r["error"] is None:
            pred = (flips or {}).get(r["id"], pred)
            label = pred.capitalize() if i % 4 == 0 else pred
            r.update(output=label, label=label, confidence=conf, correct=matches(label, ref, "normalized"))
        rows.append(r)
    return rows


def generate_rows(n: int = 30, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        r = base_row(i, rng, ERRORS[0] if i in (3, 14) else None)
        r["input_label"] = "yes" if i % 2 else "no"
        if r["error"] is None:
            out = rng.choice(["yes", "no", "Yes.", '{"a": 1}', "maybe so"])
            r.update(output=out, finish_reason=rng.choice(["stop", "stop", "length"]),
                     completion_tokens=rng.randint(1, 40), correct=matches(out, r["input_label"], "normalized"),
                     schema_valid=rng.choice([True, False, None]), sample_index=0)
        rows.append(r)
    return rows


def score_rows(n: int = 20, seed: int = 2) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        r = base_row(i, rng, ERRORS[1] if i == 7 else None)
        if r["error"] is None:
            tokens = rng.randint(1, 30)
            lp = -rng.uniform(0.1, 4.0) * tokens
            r.update(scored_tokens=tokens, logprob=lp, mean_logprob=lp / tokens, perplexity=math.exp(-lp / tokens))
        rows.append(r)
    return rows


def embed_rows(n: int = 20, seed: int = 3, size: int = 4) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        r = base_row(i, rng, ERRORS[0] if i == 2 else None)
        if r["error"] is None:
            r.update(embedding=[rng.gauss(0, 1) for _ in range(size)], input_index=0)
        rows.append(r)
    return rows


def parts(url: str) -> pl.DataFrame:
    """Every row of the output's parts, read directly (the tests' own reading)."""
    return pl.read_parquet(sorted(glob.glob(f"{url}/part*.parquet")))
