"""Peak memory and time of `jobrunner report` and `jobrunner compare` against the output's row count
(issue 46: bounded memory on a 1,000,000-row output).

    python -m benchmarks.report_memory --rows 100000 --rows 1000000

Each size writes a synthetic classify output laid out as the writer lays it (parts of 10,000 rows
under the kind's declared schema, zstd; a prompt of ~200 characters, three label probabilities and
log-probabilities per row, 1% failed rows, _stats.json and the manifest), then a second one with 5% of
the labels changed, and runs `jobrunner report` and `jobrunner compare` on them, each in a fresh
process under /usr/bin/time -v when it exists (else the child's ru_maxrss). Prints one JSON line per
size: the output's size on disk, wall seconds and peak RSS of each command.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from jobrunner.output import mark_complete, prepare_output
from jobrunner.output.schema import declared_schema
from jobrunner.output.summary import over_runs
from jobrunner.jobs import KINDS

LABELS = ["positive", "negative", "neutral"]
PART_ROWS = 10_000
CONFIG = {"kind": "classify", "dataset": "reviews.parquet", "model": "smollm2-135m-instruct", "template": None,
          "quantization": "none", "reference_column": "label", "labels": LABELS, "match": "normalized"}


def write_output(url: str, rows: int, flip: float, seed: int) -> None:
    """A classify output of `rows` rows; flip: the share of labels changed (the same seed's other rows agree)."""
    prepare_output(url, {"config": CONFIG, "model_source": "synthetic"}, overwrite=True)
    schema = declared_schema(pa.string(), {"prompt": pa.string(), "input_label": pa.string()},
                             KINDS["classify"].result_columns)
    words = np.array("the battery screen support arrived works broke great awful fine price fast slow".split())
    for part, start in enumerate(range(0, rows, PART_ROWS)):
        rng = np.random.default_rng(start)         # the same rows in both outputs, but for the flips
        n = min(PART_ROWS, rows - start)
        ref = rng.integers(0, 3, n)
        pred = np.where(rng.random(n) < 0.8, ref, rng.integers(0, 3, n))
        flips = np.random.default_rng(seed * 1_000_003 + start).random(n) < flip
        pred = np.where(flips, (pred + 1) % 3, pred)
        failed = rng.random(n) < 0.01
        probs = rng.dirichlet([1, 1, 1], n)
        conf = probs.max(axis=1)
        label = np.array(LABELS)[pred]
        prompts = [" ".join(words[rng.integers(0, len(words), 36)]) for _ in range(n)]
        ok = ~failed

        def masked(values):
            return pa.array([v if k else None for v, k in zip(values, ok)])

        probs_list = [[{"label": lab, "prob": float(p)} for lab, p in zip(LABELS, row)] for row in probs]
        columns = {
            "id": pa.array([f"r{start + i:07d}" for i in range(n)]), "output": masked(label.tolist()),
            "finish_reason": masked(["stop"] * n), "prompt_tokens": pa.array(rng.integers(30, 90, n)),
            "cached_tokens": pa.array(rng.integers(0, 30, n)), "completion_tokens": pa.array(np.zeros(n, np.int64)),
            "queue_s": pa.array(rng.exponential(2.0, n)), "prefill_s": pa.array(rng.exponential(0.05, n)),
            "decode_s": pa.array(rng.exponential(0.001, n)),
            "error": pa.array([f"prompt of {300 + i % 7} tokens exceeds the model's context" if f else None
                               for i, f in enumerate(failed)]),
            "prompt": pa.array(prompts), "input_label": pa.array(np.array(LABELS)[ref].tolist()),
            "reused": pa.array(rng.random(n) < 0.02), "label": masked(label.tolist()),
            "label_probs": pa.array([p if k else None for p, k in zip(probs_list, ok)],
                                    schema.field("label_probs").type),
            "label_logprobs": pa.array([[{"label": d["label"], "logprob": float(np.log(d["prob"]))} for d in p]
                                        if k else None for p, k in zip(probs_list, ok)],
                                       schema.field("label_logprobs").type),
            "confidence": masked(conf.tolist()), "correct": masked((pred == ref).tolist()),
            "extra_json": pa.nulls(n, pa.string())}
        table = pa.Table.from_arrays([columns[f.name] for f in schema], schema=schema)
        pq.write_table(table, f"{url}/part-{part:05d}.parquet", compression="zstd", row_group_size=n)
    run = {"started_at": "2026-01-01T02:00:00Z", "rows": rows, "rows_ok": rows, "rows_failed": 0, "prompt_tokens": 0,
           "cached_tokens": 0, "completion_tokens": 0, "wall_s": rows / 400.0, "device_hours": rows / 400.0 / 3600,
           "cost_usd": rows / 400.0 / 3600 * 2.0, "model_load_s": 2.0, "device": "cpu", "devices": 1,
           "interrupted": False, "rows_per_s": 400.0, "decode_tokens_per_s": 0.0, "prefill_tokens_per_s": 24000.0}
    # the row figures come from the parts in the report; the stats here carry the run's clock and cost
    mark_complete(url, {**run, **over_runs([run]), "runs_recorded": 1, "runs": [run]})


def measure(args: list[str]) -> dict:
    """Wall seconds and peak RSS (MiB) of `jobrunner <args>` in a fresh process."""
    cmd = [sys.executable, "-m", "jobrunner.cli.main", *args]
    timer = shutil.which("time") or ("/usr/bin/time" if os.path.exists("/usr/bin/time") else None)
    t = time.perf_counter()
    if timer:
        p = subprocess.run([timer, "-v", *cmd], capture_output=True, text=True)
        wall = time.perf_counter() - t
        rss = next(int(line.split(":")[1]) for line in p.stderr.splitlines() if "Maximum resident set size" in line)
    else:
        p = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if p.returncode not in (0, 3):
        raise SystemExit(f"jobrunner {' '.join(args)} failed ({p.returncode}): {p.stderr[-2000:]}")
    return {"wall_s": round(wall, 2), "peak_rss_mib": round(rss / 1024, 1), "exit_code": p.returncode}


def du(path: str) -> float:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) / 2 ** 20


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, action="append", help="output size (repeatable); default 1,000,000")
    ap.add_argument("--dir", default=None, help="where to write the outputs (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the outputs")
    args = ap.parse_args(argv)
    root = args.dir or tempfile.mkdtemp(prefix="report-bench-")
    try:
        for rows in args.rows or [1_000_000]:
            base, cand = f"{root}/base-{rows}", f"{root}/cand-{rows}"
            t = time.perf_counter()
            write_output(base, rows, 0.0, 1)
            write_output(cand, rows, 0.05, 2)
            written = time.perf_counter() - t
            report = measure(["report", base])
            compare = measure(["compare", base, cand, "--max-changed-rate", "0.1", "-o", f"{root}/compare.html"])
            print(json.dumps({"rows": rows, "output_mib": round(du(base), 1), "write_both_s": round(written, 1),
                              "report": report, "compare": compare}), flush=True)
    finally:
        if not args.keep and args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
