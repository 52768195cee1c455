"""Running jobrunner from cron or Airflow (issue 58, items 12, 16, 17): a store that goes down mid-job exits 4 with
one line; a lease the store refuses for an unknown reason stops the job (exit 4) unless --lease-optional; a
read-only output is found before the model loads; a deleted manifest names `jobrunner repair`; log lines in a file
carry the date, progress lines a percentage, rows in flight and an ETA; each command's --help lists what it uses
and says its exit codes."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from jobrunner.cli.main import main
from jobrunner.pipeline import build
from jobrunner.pipeline.calibration import TOLERANCE
from jobrunner.pipeline.progress import Progress, progress_line
from jobrunner.output.lease import OutputLease

ROOT = Path(__file__).resolve().parents[1]
TINY = ["-m", f"dummy:{ROOT}/benchmarks/configs/tiny-llama.json", "--kv-cache-memory", "4MB", "--no-chat",
        "--device", "cpu", "--max-tokens", "4"]
DATED = re.compile(r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} (INFO|WARNING|ERROR) ")


def _dataset(path: Path, n: int) -> str:
    path.write_text("".join(json.dumps({"id": i, "prompt": f"Say the number {i} in words."}) + "\n"
                            for i in range(n)))
    return str(path)


def _errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


@pytest.fixture
def no_model(monkeypatch):
    """Loading the model fails the test: the check under test must come first."""
    def load_engine(*args, **kwargs):
        raise AssertionError("the model was loaded before the failing check")
    monkeypatch.setattr(build, "load_engine", load_engine)


# --- item 12: storage faults -------------------------------------------------------------------------

def test_a_store_that_goes_down_mid_job_exits_4_with_one_line(tmp_path):
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    import s3fs
    from moto.server import ThreadedMotoServer
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        # few retries, so that the down store is found in seconds (botocore's default backs off for ~20 s)
        options = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "testing", "secret": "testing",
                   "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}}
        fs = s3fs.S3FileSystem(**options)
        fs.mkdir("ops-down")
        env = {**os.environ, "FSSPEC_S3": json.dumps(options), "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1", "PYTHONPATH": str(ROOT),
               "JOBRUNNER_LEASE_STALE_S": "1"}      # the heartbeat meets the down store too
        cmd = [sys.executable, "-m", "jobrunner.cli.main", "submit", _dataset(tmp_path / "d.jsonl", 400), *TINY,
               "-o", "s3://ops-down/out", "--max-tokens", "16", "--ignore-eos", "--max-num-seqs", "2",
               "--flush-seconds", "0.3"]
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while time.time() < deadline and p.poll() is None and not fs.glob("ops-down/out/part-*.parquet"):
            time.sleep(0.1)
            fs.invalidate_cache()
    finally:
        server.stop()
    try:
        _, err = p.communicate(timeout=180)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 4, err
    assert "Traceback" not in err and "Exception in thread" not in err, err
    errors = _errors(err)
    assert len(errors) == 1 and "output storage failed" in errors[0] and "run the same command again" in errors[0], err
    assert "lease" not in errors[0], err        # the first failure is reported, not the lease's release after it


def test_a_lease_refused_for_an_unknown_reason_exits_4_unless_lease_optional(tmp_path, monkeypatch, caplog):
    def no_exclusive_create(self):
        raise NotImplementedError("this store has no exclusive create")
    monkeypatch.setattr(OutputLease, "_create", no_exclusive_create)
    ds, out = _dataset(tmp_path / "d.jsonl", 3), str(tmp_path / "out")
    with monkeypatch.context() as m:
        m.setattr(build, "load_engine", lambda *a, **k: pytest.fail("the model was loaded without a lease"))
        r = CliRunner().invoke(main, ["submit", ds, "-o", out, *TINY])
    assert r.exit_code == 4, r.output
    assert _errors(r.output) == [_errors(r.output)[0]] and "cannot take its lease" in r.output, r.output
    assert "NotImplementedError: this store has no exclusive create" in r.output and "--lease-optional" in r.output
    assert not Path(out).exists()       # nothing run, nothing left
    r = CliRunner().invoke(main, ["submit", ds, "-o", out, *TINY, "--lease-optional"])
    assert r.exit_code == 0, r.output
    assert "the job runs without one (--lease-optional)" in caplog.text


def test_a_failed_release_keeps_the_first_error_and_the_heartbeat_survives_a_down_store(tmp_path, monkeypatch,
                                                                                       caplog):
    lease = OutputLease(str(tmp_path / "out"), stale_s=0.3).acquire()

    def down(*args, **kwargs):
        raise ConnectionError("the store is down")
    monkeypatch.setattr(lease.fs, "open", down)     # every read of the lease
    time.sleep(0.3)                                 # a few beats fail: warnings, no thread traceback
    assert lease._beat.is_alive() and not lease.lost.is_set()
    with pytest.raises(RuntimeError, match="the job's own error"):
        try:
            raise RuntimeError("the job's own error")
        finally:
            lease.release()
    assert "renewing its lease failed (ConnectionError: the store is down)" in caplog.text
    assert "could not remove its lease" in caplog.text


def _read_only(path: Path):
    """Make path read-only for this process (as root, whom mode bits do not stop: the immutable flag); the
    undo; skip where neither holds."""
    if os.geteuid() == 0:
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(path)]).returncode != 0:
            pytest.skip("cannot make a directory read-only for root here (chattr +i)")
        return lambda: subprocess.run(["chattr", "-i", str(path)], check=True)
    path.chmod(0o555)
    return lambda: path.chmod(0o755)


@pytest.mark.parametrize("lease_optional", [False, True])
def test_a_read_only_output_is_found_before_the_model_loads(tmp_path, monkeypatch, lease_optional):
    ds, out = _dataset(tmp_path / "d.jsonl", 4), tmp_path / "out"
    first = CliRunner().invoke(main, ["submit", ds, "-o", str(out), *TINY, "--limit", "2"])
    assert first.exit_code == 0, first.output
    undo = _read_only(out)
    try:
        monkeypatch.setattr(build, "load_engine", lambda *a, **k: pytest.fail("the model loaded first"))
        r = CliRunner().invoke(main, ["submit", ds, "-o", str(out), *TINY] + ["--lease-optional"] * lease_optional)
    finally:
        undo()
    assert r.exit_code == 4, r.output
    errors = _errors(r.output)
    assert len(errors) == 1 and str(out) in errors[0] and "Traceback" not in r.output, r.output


def test_a_deleted_manifest_names_repair_which_rebuilds_it(tmp_path):
    ds, out = _dataset(tmp_path / "d.jsonl", 3), tmp_path / "out"
    args = [ds, "-o", str(out), *TINY]
    assert CliRunner().invoke(main, ["submit", *args]).exit_code == 0
    (out / "_manifest.json").unlink()
    r = CliRunner().invoke(main, ["submit", *args])
    assert r.exit_code == 2 and "jobrunner repair" in r.output and "no _manifest.json" in r.output, r.output
    # the submit command with `repair` for `submit`, options repair ignores (--part-rows) included
    repaired = CliRunner().invoke(main, ["repair", *args, "--part-rows", "5"])
    assert repaired.exit_code == 0, repaired.output
    assert CliRunner().invoke(main, ["submit", *args]).exit_code == 0


# --- item 16: log lines and progress ---------------------------------------------------------------------

def test_log_lines_in_a_file_carry_the_date(tmp_path):
    cmd = [sys.executable, "-m", "jobrunner.cli.main", "submit", _dataset(tmp_path / "d.jsonl", 2), *TINY,
           "-o", str(tmp_path / "out")]
    p = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    logged = [line for line in p.stderr.splitlines() if re.match(r"^[\d:-]+ [\d:]* ?(INFO|WARNING)", line)]
    assert logged and all(DATED.match(line) for line in logged), p.stderr


def test_plain_progress_lines_show_percentage_rows_in_flight_and_eta(monkeypatch, caplog):
    monkeypatch.setattr("jobrunner.pipeline.progress.LOG_EVERY_S", 0.0)
    monkeypatch.setattr("sys.stderr", open(os.devnull, "w"))        # not a terminal: log lines, no bar
    progress = Progress(total=300, in_flight=lambda: 64)
    stats = SimpleNamespace(rows=0, rows_skipped=0, rows_failed=0, rows_skipped_failed=0, prompt_tokens=900,
                            completion_tokens=0)
    caplog.set_level("INFO", logger="jobrunner")
    progress.start = time.time() - 30
    progress.update(stats)
    assert "0/300 rows (0.0%), 64 in flight" in caplog.text and "ETA once the first rows finish" in caplog.text
    caplog.clear()
    stats.rows, stats.rows_skipped = 50, 100        # 100 written by an earlier run; 50 in 30 s by this one
    progress.start = time.time() - 30
    progress.update(stats)
    assert "150/300 rows (50.0%), 64 in flight, 0 failed" in caplog.text, caplog.text
    assert re.search(r"ETA 1 min 30 s|ETA 1 min 29 s", caplog.text), caplog.text      # 150 rows at 50 per 30 s
    # the data-parallel coordinator's line (jobrunner/parallel/coordinator.py), no in-flight count there
    line = progress_line(30, 120, 20, 10.0, failed=1, tokens_per_s=99.6, more="2 workers")
    assert line == "30/120 rows (25.0%), 1 failed, 100 tokens/s, 2 workers, ETA 45 s"


# --- item 17: help -------------------------------------------------------------------------------------------

def _help(*command: str) -> str:
    r = CliRunner().invoke(main, [*command, "--help"], terminal_width=100)
    assert r.exit_code == 0, r.output
    return r.output


def _listed(help_text: str) -> set[str]:
    """The options a --help lists (each at the start of its line)."""
    return set(re.findall(r"^  (?:-\w, )?(--[a-z-]+)", help_text, re.M))


def test_warmup_and_repair_help_list_only_the_options_they_use():
    submit, warmup, repair = _help("submit"), _help("warmup"), _help("repair")
    assert len(warmup.splitlines()) < 100 and len(repair.splitlines()) < len(submit.splitlines()) - 50
    warmup, repair = _listed(warmup), _listed(repair)
    for option in ("--max-tokens", "--output", "--part-rows", "--data-parallel", "--cache"):
        assert option not in warmup
    for option in ("--model", "--quantization", "--lora", "--tensor-parallel", "--config"):
        assert option in warmup
    for option in ("--part-rows", "--flush-seconds", "--threads", "--overwrite", "--lease-optional"):
        assert option not in repair       # how a job runs: not in its fingerprint
    for option in ("--output", "--model", "--max-tokens", "--template", "--kind"):
        assert option in repair
    bad = CliRunner().invoke(main, ["warmup", "--max-tokens", "3"])
    assert bad.exit_code == 2 and "No such option '--max-tokens'" in bad.output


def test_every_command_that_runs_says_its_exit_codes():
    for command in ("submit", "validate", "repair", "warmup", "stats"):
        assert "Exit codes: 0" in _help(command), command
    r = CliRunner().invoke(main, ["stats", "/nonexistent/output"])
    assert r.exit_code == 2 and "Exit codes: 0 printed; 2 not a jobrunner output" in _help("stats")


def test_the_quantization_threshold_is_the_code_s_in_help_and_readme():
    said = f"within {TOLERANCE:.0%} of float32's perplexity"
    assert said in " ".join(_help("submit").split())
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"within {TOLERANCE:.0%} of float32's" in readme and "within 2% perplexity" not in readme
