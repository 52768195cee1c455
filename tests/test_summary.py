"""Issue 15: the job summary describes every row in the output, whatever runs wrote it (summary.py)."""
import json
import os

import pyarrow.compute as pc
import pytest
from click.testing import CliRunner

from jobrunner.cli.main import main
from jobrunner.config.job import job_config
from jobrunner.pipeline.exit_codes import EXIT_OK
from jobrunner.pipeline.build import open_job
from jobrunner.common.run_stats import percentile
from jobrunner.parallel.merged_stats import merge_stats
from jobrunner.output.summary import job_summary, over_runs, part_figures, stored_name
from jobrunner.output import ResultWriter, read_results, read_stats, write_stats


def row(i, **extra):
    return {"id": f"r{i}", "output": "x", "finish_reason": "stop", "prompt_tokens": 10 + i, "cached_tokens": i,
            "completion_tokens": 2, "queue_s": 0.1 * i, "prefill_s": 0.01, "decode_s": 0.5, "error": None, **extra}


def write_parts(out, config, batches):
    w = ResultWriter(str(out), {"config": config}, part_rows=1)
    for rows in batches:
        w.write(rows)
    w.close()


def test_stored_name_follows_the_input_renaming():
    classify = ("label", "label_probs", "label_logprobs", "confidence", "correct")
    assert stored_name("answer", classify, {"answer", "label"}) == "answer"
    assert stored_name("label", classify, {"label", "input_label"}) == "input_label"
    # inputs `label` and `input_label`: the gold `label` became input_input_label
    assert stored_name("label", classify, {"label", "input_label", "input_input_label"}) == "input_input_label"
    assert stored_name("output", (), {"output", "input_output"}) == "input_output"     # a fixed column's name
    assert stored_name("answer", classify, {"label"}) is None


def test_row_figures_and_classify_metrics_from_parts(tmp_path):
    config = {"kind": "classify", "reference_column": "label", "match": "normalized"}
    batches = [[row(0, label="Positive", input_label="positive")],
               [row(1, label="Positive", input_label="negative")],
               [row(2, label=None, input_label="negative", error="prompt too long", queue_s=9.0)],
               [row(3, label="Negative", input_label="negative"), row(4, label="Negative", input_label=None)]]
    write_parts(tmp_path / "out", config, batches)
    s = part_figures(str(tmp_path / "out"), config)
    assert (s["rows"], s["rows_ok"], s["rows_failed"]) == (5, 4, 1)
    assert s["prompt_tokens"] == 10 * 5 + 10 and s["cached_tokens"] == 10 and s["completion_tokens"] == 10
    assert s["queue_s_p50"] == percentile([0.0, 0.1, 0.3, 0.4], 0.5)       # ok rows only
    m = s["metrics"]
    assert m["evaluated_rows"] == 3 and m["accuracy"] == pytest.approx(2 / 3)
    assert m["confusion_matrix"] == {"labels": ["Negative", "Positive"], "counts": [[1, 1], [0, 1]]}


def test_samples_count_once_and_generate_accuracy_from_correct(tmp_path):
    config = {"kind": "generate", "reference_column": "answer", "match": "normalized", "n": 2}
    batches = [[row(0, sample_index=0, correct=True), row(0, sample_index=1, correct=False)],
               [{**row(1), "error": "bad row", "prompt_tokens": 0}],      # an error row: no sample_index
               [row(2, sample_index=0, correct=None), row(2, sample_index=1, correct=True)]]
    write_parts(tmp_path / "out", config, batches)
    s = part_figures(str(tmp_path / "out"), config)
    assert (s["rows"], s["rows_ok"], s["rows_failed"]) == (3, 2, 1)
    assert s["prompt_tokens"] == 10 + 12 and s["completion_tokens"] == 10
    assert s["metrics"] == {"evaluated_rows": 3, "accuracy": pytest.approx(2 / 3)}


def test_score_metrics_from_parts(tmp_path):
    config = {"kind": "score", "score_column": "cont"}
    write_parts(tmp_path / "out", config, [[row(0, scored_tokens=2, logprob=-3.0)], [row(1, scored_tokens=4,
                                                                                           logprob=-1.0)]])
    m = part_figures(str(tmp_path / "out"), config)["metrics"]
    assert m["scored_tokens"] == 6 and m["mean_logprob"] == pytest.approx(-4 / 6)


def test_runs_are_carried_forward_and_summed(tmp_path):
    out = str(tmp_path / "out")
    config = {"kind": "generate"}
    write_parts(out, config, [[row(0)], [row(1)]])
    first = {"rows": 1, "rows_ok": 1, "rows_failed": 0, "prompt_tokens": 10, "cached_tokens": 0,
             "completion_tokens": 2, "wall_s": 10.0, "device_hours": 10 / 3600, "cost_usd": 0.01,
             "engine": {"steps": 4}, "device": "cpu", "devices": 1, "interrupted": True, "rows_skipped_done": 0}
    write_stats(out, job_summary(out, config, first))
    second = {**first, "prompt_tokens": 11, "wall_s": 30.0, "device_hours": 30 / 3600, "cost_usd": 0.03,
              "engine": {"steps": 6, "preemptions": 1}, "interrupted": False, "rows_skipped_done": 1}
    s = job_summary(out, config, second)
    assert s["runs_recorded"] == 2 and s["runs"] == [first, second]
    assert s["rows"] == 2 and s["prompt_tokens"] == 21          # from the parts
    assert s["wall_s"] == 40.0 and s["device_hours"] == pytest.approx(40 / 3600)
    assert s["cost_usd"] == pytest.approx(0.04)
    assert s["cost_per_million_tokens"] == pytest.approx(0.04 / 25 * 1e6)
    assert "cost_per_million_input_tokens" not in s and "cost_per_million_output_tokens" not in s
    assert s["engine"] == {"steps": 10, "preemptions": 1} and s["interrupted"] is False
    assert s["prefill_tokens_per_s"] == pytest.approx(21 / 40)   # over the recorded runs


def test_merged_data_parallel_run_keeps_every_prefix_figure():
    """The merged stats lacked partial_block_optimum_cached_tokens: one list of keys now (stats.PREFIX_KEYS)."""
    prefix = {"planned_prompt_tokens": 100, "optimum_cached_tokens": 60, "block_optimum_cached_tokens": 48,
              "partial_block_optimum_cached_tokens": 55, "optimum_exact": True}
    worker = {"rows": 2, "rows_ok": 2, "rows_failed": 0, "prompt_tokens": 50, "cached_tokens": 24,
              "completion_tokens": 4, "device_hours": 0.001, **prefix}
    results = [{"rank": k, "slot": k, "round": 0, "device": "cpu", "exit_code": 0, "units": 1, "run_s": 1.0,
                "summary": worker} for k in range(2)]
    cfg = job_config("x", device_hourly_cost=1.0)
    run = merge_stats(results, cfg.engine, cfg.parallel, cfg.output, wall_s=2.0, devices=2, rounds=1, lost=[])
    assert {k: run[k] for k in prefix} == prefix
    assert run["cache_hit_of_block_optimum"] == pytest.approx(48 / 48)
    assert run["cost_per_million_tokens"] == pytest.approx(0.002 / 108 * 1e6) and "metrics" not in run
    top = over_runs([run])
    assert top["partial_block_optimum_cached_tokens"] == 55 and top["optimum_cache_hit_rate"] == 0.6
    # two runs that planned: no plan is the output's (issue 58: never summed), each run keeps its own
    assert "optimum_cache_hit_rate" not in over_runs([run, run])


def _job(model_dir, ds, out, **kw):
    job = open_job(job_config(str(ds), model=str(model_dir), output=str(out), device="cpu", **kw))
    return job.run()


def test_resumed_job_summary_describes_every_row(tiny_hf_model_dir, tmp_path):
    """Issue 15 (4): after a resume, _stats.json described only the last run's rows and accuracy."""
    gold = ["yes", "no", "no", "yes", "yes", "no", "no", "yes"]
    ds = tmp_path / "ds.jsonl"
    ds.write_text("\n".join(json.dumps({"id": f"r{i}", "prompt": f"question {i}?", "label": g})
                            for i, g in enumerate(gold)))
    out = tmp_path / "out"
    kw = dict(kind="classify", labels=("Yes", "No"), reference_column="label", match="normalized")
    first = _job(tiny_hf_model_dir("llama"), ds, out, limit=3, **kw)
    assert first.exit_code == EXIT_OK and first.stats["rows"] == 3
    second = _job(tiny_hf_model_dir("llama"), ds, out, **kw)
    assert second.exit_code == EXIT_OK
    s = read_stats(str(out))
    assert s == json.loads(json.dumps(second.stats))
    t = read_results(str(out))
    correct = t.column("correct").to_pylist()
    assert s["rows"] == s["rows_ok"] == t.num_rows == 8
    assert s["prompt_tokens"] == pc.sum(t.column("prompt_tokens")).as_py()
    assert s["metrics"]["evaluated_rows"] == 8 and s["metrics"]["accuracy"] == sum(correct) / 8
    assert set(s["metrics"]["confusion_matrix"]["labels"]) <= {"Yes", "No"}     # keyed by normalized label
    assert s["queue_s_p95"] == percentile(t.column("queue_s").to_pylist(), 0.95)
    runs = s["runs"]
    assert s["runs_recorded"] == 2 and [r["rows"] for r in runs] == [3, 5] and runs[1]["rows_skipped_done"] == 3
    assert s["wall_s"] == pytest.approx(runs[0]["wall_s"] + runs[1]["wall_s"])
    assert all(r["started_at"] for r in runs) and "metrics" not in runs[1]


def test_stats_command_on_a_killed_job_and_a_missing_directory(tmp_path):
    """Issue 15 (12): parts but no _stats.json (a kill -9) give a partial summary from the parts; a
    directory that does not exist is named as such, exit 2, no traceback."""
    out = tmp_path / "out"
    config = {"kind": "generate", "reference_column": "answer", "match": "normalized"}
    w = ResultWriter(str(out), {"config": config}, part_rows=2)
    w.write([row(0, correct=True), row(1, correct=False), row(2, correct=True)])   # no close: killed
    w.flush()
    r = CliRunner().invoke(main, ["stats", str(out), "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["partial"] is True and s["rows"] == 3 and s["runs_recorded"] == 0
    assert s["metrics"]["accuracy"] == pytest.approx(2 / 3)
    assert "did not finish" in r.stderr
    r = CliRunner().invoke(main, ["stats", str(out)])
    assert r.exit_code == 0 and "rows         3: 3 ok, 0 failed" in r.stdout
    assert "accuracy 0.6667" in r.stdout and "wall time" not in r.stdout     # no run recorded a time
    r = CliRunner().invoke(main, ["stats", str(out), "--all"])
    assert r.exit_code == 0 and "rows_ok" in r.stdout and "queue_s_p95" in r.stdout
    missing = str(tmp_path / "nope")
    r = CliRunner().invoke(main, ["stats", missing])
    assert r.exit_code == 2 and f"no jobrunner output at {missing}" in r.stderr
    assert "Traceback" not in r.output and not os.path.exists(missing)


def test_submit_ends_with_a_ten_line_summary(tiny_hf_model_dir, tmp_path):
    """Issue 16 (9): the end of submit (and `jobrunner stats`) is about ten lines a person reads;
    every figure stays in _stats.json and `jobrunner stats --all`."""
    ds = tmp_path / "d.jsonl"
    ds.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"question {i}?", "label": "Yes"}) + "\n"
                          for i in range(4)) + '{"id": "bad", "prompt": null, "label": "No"}\n')
    out = str(tmp_path / "out")
    args = ["submit", str(ds), "-o", out, "-m", str(tiny_hf_model_dir("llama")), "--device", "cpu",
            "--kv-cache-memory", "16MB", "--kind", "classify", "--labels", "Yes,No", "--reference-column", "label",
            "--device-hourly-cost", "2.5"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert 8 <= len(lines) <= 12, r.stdout
    assert [line.split("  ")[0] for line in lines] == [
        "output", "rows", "tokens", "cache hits", "wall time", "throughput", "cost", "metrics", "device",
        "report", "all figures"]
    assert lines[0].split() == ["output", out]
    assert lines[1] == "rows         5: 4 ok, 1 failed (their errors are in the `error` column)"
    assert "completion tokens/s" in lines[5] and lines[6].startswith("cost         $")
    assert "accuracy" in lines[7] and "macro_f1" in lines[7] and "confusion" not in r.stdout
    assert lines[-2].startswith(f"report       jobrunner report {out} ")
    assert lines[-1] == f"all figures  jobrunner stats --all {out} (or _stats.json)"
    r = CliRunner().invoke(main, ["stats", out])
    assert r.exit_code == 0 and r.stdout.splitlines()[:4] == lines[:4]
    full = CliRunner().invoke(main, ["stats", out, "--all"]).stdout
    assert all(k in full for k in ("\nrows_ok ", "\nqueue_s_p99 ", "\ncost_per_million_tokens ", "\nengine:\n",
                                   "\nruns:\n"))
