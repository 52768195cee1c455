"""The command line around a job: stats, validate, models, TOML job files, SIGTERM and resume."""
import json
import logging
import os
import signal
import subprocess
import sys
import time

import click
import pytest
from click.testing import CliRunner

from jobrunner.cli.main import main, submit
from jobrunner.config.cli_options import SECTIONS
from tests.cli_helpers import jsonl


@pytest.mark.default_model
def test_validate_counts_tokens_without_running(default_gguf_path, tmp_path):
    ds = jsonl(tmp_path / "v.jsonl", [{"id": "a", "prompt": "Hello there"}, {"id": "b", "prompt": None}])
    r = CliRunner().invoke(main, ["validate", ds, "--device-hourly-cost", "2.5"])
    assert r.exit_code == 0, r.output
    assert "rows_with_errors             1" in r.output and "prompt_tokens" in r.output
    assert not (tmp_path / "v.jsonl.results").exists()


@pytest.mark.default_model
def test_models_lists_default(default_gguf_path):
    r = CliRunner().invoke(main, ["models"])
    assert r.exit_code == 0 and "smollm2-135m-instruct" in r.output and "cached" in r.output


@pytest.mark.default_model
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
    assert r.exit_code == 0 and "rows         2: 2 ok, 0 failed" in r.output and "per million tokens" in r.output
    r = CliRunner().invoke(main, ["stats", out, "--all"])
    assert r.exit_code == 0 and "rows_ok" in r.output and "cost_usd" in r.output
    bad = tmp_path / "bad.toml"
    bad.write_text("max_tokenz = 3\n")
    r = CliRunner().invoke(main, ["submit", ds, "--config", str(bad)])
    assert r.exit_code == 2 and "max_tokenz" in r.output


def test_sigterm_stops_promptly_and_resume_completes(tmp_path):
    """The tiny random model: the signal and the resume are the point, not the model."""
    rows = [{"id": f"s{i:02d}", "prompt": f"Write a long story about the number {i}."} for i in range(12)]
    ds = jsonl(tmp_path / "s.jsonl", rows)
    out = str(tmp_path / "out")
    tiny = f"dummy:{os.path.join(os.path.dirname(__file__), '..', 'benchmarks', 'configs', 'tiny-llama.json')}"
    cmd = [sys.executable, "-m", "jobrunner.cli.main", "submit", ds, "-o", out, "-m", tiny, "--kv-cache-memory", "4MB",
           "--max-tokens", "32", "--ignore-eos", "--part-rows", "1", "--max-num-seqs", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while time.time() < deadline and not (os.path.isdir(out) and any(p.startswith("part-") for p in os.listdir(out))):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)              # a hang guard, not a timing check
    assert proc.returncode == 130, err
    assert "resume" in err
    from jobrunner.output import read_results
    assert len(read_results(out)) < len(rows)           # it stopped without running the job to its end
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    assert sorted(read_results(out).column("id").to_pylist()) == [r["id"] for r in rows]


@pytest.mark.default_model
def test_async_scheduling_flag_changes_no_output(default_gguf_path, tmp_path):
    """The same job with and without async scheduling (the default model, stop strings, sampling):
    identical rows."""
    from jobrunner.output import read_results
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


def test_version():
    from importlib.metadata import version
    r = CliRunner().invoke(main, ["--version"])
    assert r.exit_code == 0 and version("jobrunner") in r.output


def test_submit_help_groups_every_option_and_describes_it():
    options = [p for p in submit.params if isinstance(p, click.Option)]
    grouped = {n for names in SECTIONS.values() for n in names}
    assert all(p.help for p in options), [p.name for p in options if not p.help]
    assert {p.name for p in options} - grouped == {"verbose"}
    r = CliRunner().invoke(main, ["submit", "--help"])
    assert r.exit_code == 0
    titles = [f"{t} options:" for t in SECTIONS] + ["Other options:"]
    assert [r.output.index(t) for t in titles] == sorted(r.output.index(t) for t in titles)
    assert "completion order" in r.output and r"\n, \t and \\" in r.output


def test_validate_shows_the_first_prompt_and_counts_too_long_prompts(tiny_hf_model_dir, tmp_path):
    """The tiny model's context is 256 tokens: the long row is an error row, as submit makes it."""
    model = str(tiny_hf_model_dir("llama"))
    ds = jsonl(tmp_path / "d.jsonl", [{"id": "a", "q": "fox"}, {"id": "b", "q": "lazy dog " * 200}])
    r = CliRunner().invoke(main, ["validate", ds, "-m", model, "--template", r"Q: {q}\nA:", "--max-tokens", "5"])
    assert r.exit_code == 0, r.output
    assert "rows_with_errors             1" in r.output
    assert "exceeds the model's context of 256 tokens" in r.output
    assert "max_output_tokens_total      5" in r.output        # one ok row x 5 tokens
    assert "<|im_start|>user\nQ: fox\nA:<|im_end|>\n<|im_start|>assistant\n\n----" in r.output

    r = CliRunner().invoke(main, ["validate", ds, "-m", model, "--kind", "score", "--score-column", "q",
                                  "--template", r"Say\t{id}:", "--limit", "1"])
    assert r.exit_code == 0, r.output
    assert "\n----\nSay\ta:\n----" in r.output                  # score: raw text by default


def test_submit_show_prompt_logs_the_first_prompt(tiny_hf_model_dir, tmp_path, caplog):
    ds = jsonl(tmp_path / "d.jsonl", [{"id": "a", "q": "fox"}])
    args = ["submit", ds, "-m", str(tiny_hf_model_dir("llama")), "--template", r"Q: {q}\nA:", "--no-chat",
            "--max-tokens", "1", "-o", str(tmp_path / "out")]
    with caplog.at_level(logging.INFO, logger="jobrunner"):
        r = CliRunner().invoke(main, args + ["--show-prompt"])
    assert r.exit_code == 0, r.output
    assert "first prompt (row a), exactly as the tokenizer gets it:\nQ: fox\nA:" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jobrunner"):
        r = CliRunner().invoke(main, args + ["--overwrite"])
    assert r.exit_code == 0 and "first prompt" not in caplog.text
