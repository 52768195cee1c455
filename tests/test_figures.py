"""Issue 58 (4-6): the figures describe what was computed, over every run. A row refused for its length adds
no computed token (its message and its prompt_tokens agree, validate and submit count the same); a night
served from the result cache reports the throughput and cost of the rows it computed; runs killed with
SIGKILL count in wall time, device-hours and cost (their parts record them); compare's cost gate weighs
whole outputs; `stats` on an output with no part yet says how many rows the dataset holds."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from jobrunner.cli.main import main
from jobrunner.output import ResultWriter, read_results, read_stats
from jobrunner.output.completion import mark_complete
from jobrunner.output.manifest import prepare_output
from jobrunner.output.schema import declared_schema
from jobrunner.output.summary import job_summary
from jobrunner.jobs import KINDS
from tests.report_helpers import INPUTS, classify_rows, run_record, write_output

LONG = "word " * 400            # over the tiny models' 256 positions


def _dataset(path, n: int, long: bool = True) -> str:
    rows = [{"id": f"r{i}", "text": f"review number {i} was fine"} for i in range(n)]
    if long:
        rows.insert(n // 2, {"id": "long", "text": LONG})
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def _classify_args(model) -> list[str]:
    return ["-m", str(model), "--device", "cpu", "--kv-cache-memory", "16MB", "--kind", "classify",
            "--labels", "positive,negative", "--template", "Review: {text}\nSentiment:", "--device-hourly-cost", "2"]


def _submit(ds, out, args) -> dict:
    r = CliRunner().invoke(main, ["submit", ds, "-o", str(out), *args])
    assert r.exit_code == 0, r.output
    return read_stats(str(out))


def test_a_too_long_row_adds_no_computed_token(tiny_hf_model_dir, tmp_path):
    args = _classify_args(tiny_hf_model_dir("llama"))
    ds = _dataset(tmp_path / "d.jsonl", 8)
    s = _submit(ds, tmp_path / "out", args)
    rows = {r["id"]: r for r in read_results(str(tmp_path / "out")).to_pylist()}
    long = rows.pop("long")
    # the message and the column count the same prompt (the longest label follows it, named apart)
    said = int(re.match(r"prompt of (\d+) tokens", long["error"]).group(1))
    assert long["prompt_tokens"] == said > 256 and long["prefill_s"] is None
    ok_tokens = sum(r["prompt_tokens"] for r in rows.values())
    assert s["prompt_tokens"] == s["computed_prompt_tokens"] == ok_tokens
    assert s["rows_computed"] == 8 and s["rows_failed"] == 1
    assert s["prefill_tokens_per_s"] == pytest.approx(ok_tokens / s["wall_s"])
    assert s["cost_per_million_tokens"] == pytest.approx(s["cost_usd"] / ok_tokens * 1e6)
    assert s["cache_hit_rate"] == pytest.approx(s["cached_tokens"] / ok_tokens)
    # validate counts what submit computes
    r = CliRunner().invoke(main, ["validate", ds, *args])
    assert r.exit_code == 0, r.output
    assert re.search(rf"^prompt_tokens +{ok_tokens}$", r.stdout, re.M), r.stdout
    assert f"prompt of {said} tokens" in r.stdout


def test_a_night_served_from_the_result_cache_reports_what_it_computed(tiny_hf_model_dir, tmp_path):
    args = _classify_args(tiny_hf_model_dir("llama")) + ["--cache", str(tmp_path / "cache")]
    _submit(_dataset(tmp_path / "d.jsonl", 8), tmp_path / "night1", args)
    rows = [json.loads(line) for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    (tmp_path / "d2.jsonl").write_text("\n".join(json.dumps(r) for r in rows + [{"id": "new", "text": "brand new"}]))
    s = _submit(str(tmp_path / "d2.jsonl"), tmp_path / "night2", args)
    new = next(r for r in read_results(str(tmp_path / "night2")).to_pylist() if r["id"] == "new")
    assert s["rows_from_cache"] == 8 and s["rows_computed"] == 1
    assert s["computed_prompt_tokens"] == new["prompt_tokens"]      # neither the cached rows nor the long one
    assert s["prefill_tokens_per_s"] == pytest.approx(new["prompt_tokens"] / s["wall_s"])
    assert s["cost_per_million_tokens"] == pytest.approx(s["cost_usd"] / new["prompt_tokens"] * 1e6)


def _parts(out) -> int:
    return len([n for n in os.listdir(out) if n.startswith("part-")]) if os.path.isdir(out) else 0


def test_runs_killed_with_sigkill_count_in_time_and_cost(tiny_hf_model_dir, tmp_path):
    """Three runs, the first two killed with SIGKILL once they wrote parts: wall time, device-hours and
    cost sum every run (each killed one's up to its last part), rows/s is the output's over that time."""
    ds = _dataset(tmp_path / "d.jsonl", 24, long=False)
    out = str(tmp_path / "out")
    cmd = [sys.executable, "-m", "jobrunner.cli.main", "submit", ds, "-o", out, "-m", str(tiny_hf_model_dir("llama")),
           "--device", "cpu", "--kv-cache-memory", "16MB", "--template", "{text}", "--max-tokens", "48",
           "--ignore-eos", "--max-num-seqs", "1", "--part-rows", "1", "--device-hourly-cost", "3"]
    for _ in range(2):
        before = _parts(out)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 300
        while time.time() < deadline and _parts(out) < before + 2 and proc.poll() is None:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert before + 2 <= _parts(out) < 24
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    s = read_stats(out)
    runs = s["runs"]
    assert s["rows"] == 24 and s["runs_recorded"] == len(runs) == 3
    assert [bool(r.get("killed")) for r in runs] == [True, True, False]
    assert all(r["wall_s"] > 0 and r["rows"] >= 2 for r in runs)
    assert sum(r["rows"] for r in runs) == 24            # every row written once, by the run that wrote it
    assert s["wall_s"] == pytest.approx(sum(r["wall_s"] for r in runs))
    assert s["device_hours"] == pytest.approx(sum(r["device_hours"] for r in runs))
    assert s["cost_usd"] == pytest.approx(s["device_hours"] * 3)
    assert s["rows_per_s"] == pytest.approx(24 / s["wall_s"])
    assert "optimum_cached_tokens" not in s          # three runs planned: no plan is the output's
    r = CliRunner().invoke(main, ["stats", out])
    assert re.search(r"wall time +.* over 3 runs", r.stdout), r.stdout


def _killed_run(url, config, rows, run_id, wall_s):
    """A run killed after writing `rows`: its parts record its time, it wrote no _stats.json."""
    schema = declared_schema(pa.string(), INPUTS, KINDS["classify"].result_columns)
    record = {"run_id": run_id, "started_at": f"2026-01-0{run_id[-1]}T01:00:00Z", "wall_s": wall_s,
              "model_load_s": 1.0, "device": "cpu", "devices": 1, "device_hours": wall_s / 3600,
              "quantization": "none", "cost_usd": wall_s / 3600 * 7.2}
    w = ResultWriter(url, {"config": config, "model_source": "tiny (/models/tiny)", "dataset_format": "jsonl"},
                     part_rows=4, schema=schema, run_record=lambda: record)
    w.write(rows)
    w.flush()


def test_compare_cost_gate_weighs_every_run_of_each_output(tmp_path):
    """A candidate whose two killed runs burned most of its compute is not 'cheaper' than a base that ran
    once: the gate compares whole outputs."""
    rows = classify_rows(40)
    base = write_output(tmp_path / "base", "classify", rows, runs=[run_record(rows, wall_s=10.0, cost_usd=0.02)])
    url = str(tmp_path / "cand")
    config = {"kind": "classify", "dataset": "data.jsonl", "model": "tiny", "template": None, "quantization": "none"}
    _killed_run(url, config, rows[:12], "k1", 20.0)
    _killed_run(url, config, rows[12:24], "k2", 20.0)
    schema = declared_schema(pa.string(), INPUTS, KINDS["classify"].result_columns)
    last = ResultWriter(url, {"config": config}, part_rows=4, schema=schema)
    last.write(rows[24:])
    last.flush()
    summary = job_summary(url, config, run_record(rows[24:], wall_s=4.0, cost_usd=0.008,
                                                  started_at="2026-01-03T01:00:00Z", run_id="final"))
    mark_complete(url, summary)
    s = read_stats(url)
    assert [r.get("run_id") for r in s["runs"]] == ["k1", "k2", "final"]
    assert s["wall_s"] == pytest.approx(44.0) and s["cost_usd"] == pytest.approx(0.088)
    assert s["rows_per_s"] == pytest.approx(s["rows_computed"] / 44.0)
    r = CliRunner().invoke(main, ["compare", base, url, "--max-cost-increase", "0.1"])
    assert r.exit_code == 3, r.output
    r = CliRunner().invoke(main, ["compare", base, url, "--max-cost-increase", "4", "--json"])
    assert r.exit_code == 0, r.output


def test_stats_before_the_first_part_shows_the_dataset(tmp_path):
    """Killed before its first part: the manifest alone; `stats` says how many rows are left."""
    ds = _dataset(tmp_path / "d.jsonl", 29)
    out = str(tmp_path / "out")
    prepare_output(out, {"config": {"kind": "generate", "dataset": ds}, "dataset_format": "jsonl"})
    r = CliRunner().invoke(main, ["stats", out])
    assert r.exit_code == 0, r.output
    assert "rows         0 of the dataset's 30 (30 left): 0 ok, 0 failed" in r.stdout


def test_each_part_records_its_runs_time(tmp_path):
    """The record is the writer's own at each flush, never one a part read back carried."""
    from jobrunner.output.parts import RUN_METADATA
    rows = classify_rows(8)
    url = str(tmp_path / "out")
    config = {"kind": "classify", "dataset": "data.jsonl"}
    _killed_run(url, config, rows[:4], "k1", 5.0)
    schema = declared_schema(pa.string(), INPUTS, KINDS["classify"].result_columns)
    w = ResultWriter(url, {"config": config}, part_rows=4, schema=schema)      # records no run: none in its part
    w.write(rows[4:])
    w.flush()
    metas = [pq.read_schema(os.path.join(url, n)).metadata for n in sorted(os.listdir(url)) if n.startswith("part-")]
    assert json.loads(metas[0][RUN_METADATA])["run_id"] == "k1" and RUN_METADATA not in metas[1]
    assert b"jobrunner.kinds" in metas[1]


def test_score_and_rerank_lines_count_every_pairs_whole_prompt(tiny_hf_model_dir, tmp_path):
    """usage.prompt_tokens of a /score or /rerank line under --kind classify: each pair's prompt, summed (as
    classify counts the same prompts one a row), not the pairs' shared prefix the request holds."""
    from jobrunner.config.job import job_config
    from jobrunner.pipeline.build import load_engine, open_job
    from tests import openai_fixtures as fx
    from tests.test_openai_scores import NAMES, RERANK
    from tests.test_openai_tools import run_batch

    engine = load_engine(job_config("unused", model=str(tiny_hf_model_dir("llama")), kv_cache_memory=8 * 2**20,
                                    device="cpu"))
    lines = fx.VLLM_INPUT_SCORE_BATCH[:1] + fx.VLLM_RERANK_LINES[:1]
    out = run_batch(engine, tmp_path / "pairs", lines, kind="classify", labels=("yes", "no"), template=RERANK, **NAMES)
    ds = tmp_path / "pairs.jsonl"
    ds.write_text("\n".join(json.dumps({"id": d, "query": "What is the capital of France?", "document": d})
                            for d in fx._DOCUMENTS))
    open_job(job_config(str(ds), output=str(tmp_path / "ref"), kind="classify", labels=("yes", "no"), template=RERANK),
             engine=engine).run()
    whole = sum(r["prompt_tokens"] for r in read_results(str(tmp_path / "ref")).to_pylist())
    for cid in ("request-1", "rerank-1"):
        assert out[cid]["response"]["body"]["usage"]["prompt_tokens"] == whole
    engine.close()
