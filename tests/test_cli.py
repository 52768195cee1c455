"""The command line around a job: stats, validate, models, TOML job files, SIGTERM and resume."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from jobrunner.cli import main

pytestmark = pytest.mark.default_model


def jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def test_validate_counts_tokens_without_running(default_gguf_path, tmp_path):
    ds = jsonl(tmp_path / "v.jsonl", [{"id": "a", "prompt": "Hello there"}, {"id": "b", "prompt": None}])
    r = CliRunner().invoke(main, ["validate", ds, "--device-hourly-cost", "2.5"])
    assert r.exit_code == 0, r.output
    assert "rows_with_errors             1" in r.output and "prompt_tokens" in r.output
    assert not (tmp_path / "v.results").exists()


def test_models_lists_default(default_gguf_path):
    r = CliRunner().invoke(main, ["models"])
    assert r.exit_code == 0 and "smollm2-135m-instruct" in r.output and "cached" in r.output


def test_toml_config_and_command_line_wins_then_stats(default_gguf_path, tmp_path):
    ds = jsonl(tmp_path / "t.jsonl", [{"id": "a", "q": "Name a color."}, {"id": "b", "q": "Name a fruit."}])
    cfg = tmp_path / "job.toml"
    cfg.write_text('template = "Answer briefly: {q}"\nmax_tokens = 50\ndevice_hourly_cost = 3.0\n')
    out = str(tmp_path / "out")
    r = CliRunner().invoke(main, ["submit", ds, "--config", str(cfg), "--max-tokens", "3", "-o", out])
    assert r.exit_code == 0, r.output
    stats = json.loads(open(os.path.join(out, "_stats.json")).read())
    assert stats["completion_tokens"] <= 6 and stats["cost_usd"] > 0
    manifest = json.loads(open(os.path.join(out, "_manifest.json")).read())
    assert manifest["config"]["template"] == "Answer briefly: {q}" and manifest["config"]["max_tokens"] == 3
    r = CliRunner().invoke(main, ["stats", out])
    assert r.exit_code == 0 and "rows_ok" in r.output and "cost_usd" in r.output
    bad = tmp_path / "bad.toml"
    bad.write_text("max_tokenz = 3\n")
    r = CliRunner().invoke(main, ["submit", ds, "--config", str(bad)])
    assert r.exit_code == 2 and "max_tokenz" in r.output


def test_sigterm_stops_promptly_and_resume_completes(default_gguf_path, tmp_path):
    rows = [{"id": f"s{i:02d}", "prompt": f"Write a long story about the number {i}."} for i in range(8)]
    ds = jsonl(tmp_path / "s.jsonl", rows)
    out = str(tmp_path / "out")
    cmd = [sys.executable, "-m", "jobrunner.cli", "submit", ds, "-o", out, "--max-tokens", "64", "--ignore-eos",
           "--part-rows", "1", "--max-num-seqs", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while time.time() < deadline and not (os.path.isdir(out) and any(p.startswith("part-") for p in os.listdir(out))):
        time.sleep(0.05)
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert time.time() - sent < 60
    assert "resume" in err
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    from jobrunner.writer import read_results
    assert sorted(read_results(out).column("id").to_pylist()) == [r["id"] for r in rows]


def test_async_scheduling_flag_changes_no_output(default_gguf_path, tmp_path):
    """The same job with and without async scheduling (the default model, stop strings, sampling):
    identical rows."""
    from jobrunner.writer import read_results
    rows = [{"id": f"a{i}", "prompt": f"List three things about the number {i}."} for i in range(5)]
    ds = jsonl(tmp_path / "a.jsonl", rows)
    common = ["--max-tokens", "24", "--stop", "\n\n", "--temperature", "0.7", "--seed", "3"]
    tables = []
    for flag in ("--async-scheduling", "--no-async-scheduling"):
        out = str(tmp_path / flag.strip("-"))
        r = CliRunner().invoke(main, ["submit", ds, "-o", out, *common, flag])
        assert r.exit_code == 0, r.output
        t = read_results(out).sort_by("id").select(["id", "output", "finish_reason", "completion_tokens"])
        tables.append(t.to_pylist())
    assert tables[0] == tables[1]
    assert {row["finish_reason"] for row in tables[0]} == {"stop", "length"}   # both ends exercised
