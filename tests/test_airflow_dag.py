"""The Airflow example (examples/airflow/nightly_dag.py, pasted in docs/guides/nightly.md) runs under Airflow's
own `airflow dags test`: a night without a baseline skips the gate, a night like the one before passes it,
a night that lost rows fails it (compare exits 3: the task fails at once, its retries unused); and each exit
code of jobrunner maps to its task outcome.

Airflow lives in a virtual environment of its own (never ours: its pins would meet ours), built on first use
under ~/.cache/jobrunner-test-airflow (JOBRUNNER_TEST_AIRFLOW_CACHE) and reused; `pip install apache-airflow`
pinned to AIRFLOW_VERSION, with Airflow's constraints file when it can be fetched. The tests skip, saying why,
when that environment cannot be built (no network). Building it took 88-90 s on a 2-core machine; the tests
take 2.5 minutes once it exists (each `airflow dags test` starts Airflow's API in process).
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DAG_FILE = ROOT / "examples" / "airflow" / "nightly_dag.py"
REVIEWS = ROOT / "examples" / "reviews.jsonl"
TINY_MODEL = f"dummy:{ROOT / 'benchmarks' / 'configs' / 'tiny-llama.json'}"
AIRFLOW_VERSION = "3.3.2"
PY = f"{sys.version_info.major}.{sys.version_info.minor}"
CONSTRAINTS = f"https://raw.githubusercontent.com/apache/airflow/constraints-{AIRFLOW_VERSION}/constraints-{PY}.txt"
CACHE = Path(os.environ.get("JOBRUNNER_TEST_AIRFLOW_CACHE", Path.home() / ".cache" / "jobrunner-test-airflow"))
INSTALL_TIMEOUT_S = 1800


def _clean_env(**extra: str) -> dict:
    """This process's environment without our virtual environment's marks, plus extra."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    return {**env, **extra}


def _constraints(dest: Path) -> Path | None:
    """Airflow's constraints file for the pinned version and this Python, or None when unreachable."""
    try:
        with urllib.request.urlopen(CONSTRAINTS, timeout=15) as r:
            dest.write_bytes(r.read())
        return dest
    except OSError:
        return None


def _build(venv: Path) -> str | None:
    """Creates the virtual environment and installs Airflow into it; the reason it failed, or None."""
    shutil.rmtree(venv, ignore_errors=True)
    base = getattr(sys, "_base_executable", sys.executable)     # a venv of the interpreter, not of ours
    subprocess.run([base, "-m", "venv", str(venv)], check=True, env=_clean_env())
    args = [str(venv / "bin" / "pip"), "install", "-q", f"apache-airflow=={AIRFLOW_VERSION}"]
    if (constraints := _constraints(venv / "constraints.txt")) is not None:
        args += ["-c", str(constraints)]
    t0 = time.monotonic()
    try:
        p = subprocess.run(args, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, env=_clean_env())
    except subprocess.TimeoutExpired:
        return f"pip install apache-airflow=={AIRFLOW_VERSION} took over {INSTALL_TIMEOUT_S} s"
    if p.returncode != 0:
        errors = [line for line in p.stderr.splitlines() if "ignored: it is neither" not in line]
        return f"pip install apache-airflow=={AIRFLOW_VERSION} exited {p.returncode}: {' | '.join(errors[-3:])}"
    (venv / "jobrunner-test-done").write_text(json.dumps({
        "install_s": round(time.monotonic() - t0), "constraints": constraints is not None}) + "\n")
    return None


@pytest.fixture(scope="module")
def airflow_bin() -> Path:
    """The bin directory of the Airflow environment: built once (under a lock, so concurrent sessions build
    it once) and reused; the module is skipped when it cannot be built."""
    venv = CACHE / f"airflow-{AIRFLOW_VERSION}-py{PY}"
    if not (venv / "jobrunner-test-done").is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        with open(CACHE / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (venv / "jobrunner-test-done").is_file() and (why := _build(venv)) is not None:
                shutil.rmtree(venv, ignore_errors=True)
                pytest.skip(f"Airflow's own virtual environment cannot be built (no network?): {why}")
    return venv / "bin"


@pytest.fixture(scope="module")
def airflow(airflow_bin, tmp_path_factory):
    """run(*args) -> CompletedProcess of `airflow ...` in a fresh AIRFLOW_HOME (sqlite, no examples) whose
    dags folder holds the example DAG, with JOBRUNNER set to this environment's jobrunner command."""
    jobrunner = Path(sys.executable).parent / "jobrunner"
    if not jobrunner.is_file():
        pytest.skip(f"no jobrunner command beside {sys.executable} (pip install -e .)")
    home = tmp_path_factory.mktemp("airflow-home")
    (home / "dags").mkdir()
    shutil.copy(DAG_FILE, home / "dags" / DAG_FILE.name)
    env = _clean_env(AIRFLOW_HOME=str(home), AIRFLOW__CORE__LOAD_EXAMPLES="False",
                     AIRFLOW__CORE__DAGS_FOLDER=str(home / "dags"),
                     AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{home / 'airflow.db'}", JOBRUNNER=str(jobrunner))

    def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
        return subprocess.run([str(airflow_bin / "airflow"), *args], env=env, cwd=home, capture_output=True,
                              text=True, timeout=timeout)

    p = run("db", "migrate")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    run.home = home
    return run


def _runs(home: Path) -> list[tuple[str, dict[str, tuple[str, int]]]]:
    """Each DAG run in order: (its state, {task: (state, try number)})."""
    with sqlite3.connect(home / "airflow.db") as db:
        runs = db.execute("SELECT run_id, state FROM dag_run ORDER BY id").fetchall()
        return [(state, {t: (s, n) for t, s, n in db.execute(
            "SELECT task_id, state, try_number FROM task_instance WHERE run_id = ?", (run_id,))})
            for run_id, state in runs]


@pytest.mark.slow
def test_a_night_passes_its_gate_and_a_night_that_lost_rows_fails_it_without_retry(airflow, tmp_path):
    out = tmp_path / "runs"
    nights = {"dataset": str(REVIEWS), "output": f"{out}/{{ds}}/", "model": TINY_MODEL}
    lost = tmp_path / "reviews-lost-rows.jsonl"              # the third night's job read 9 of the 12 rows
    lost.write_text("".join(REVIEWS.read_text().splitlines(keepends=True)[:9]))
    logs = []
    for night, conf in (("2025-01-01", nights), ("2025-01-02", nights), ("2025-01-03", {**nights, "dataset": str(lost)})):
        p = airflow("dags", "test", "-c", json.dumps(conf), "jobrunner_nightly", night)
        logs.append(p.stdout + p.stderr)

    runs = _runs(airflow.home)
    assert runs[0] == ("success", {"label": ("success", 1), "gate": ("skipped", 1)}), logs[0][-4000:]
    assert "no baseline" in logs[0]
    assert runs[1] == ("success", {"label": ("success", 1), "gate": ("success", 1)}), logs[1][-4000:]
    assert "gate        max_missing_rate 0 against 0: ok" in logs[1]
    # compare exits 3 on --max-missing-rate: AirflowFailException, so the gate's 3 retries are never used
    assert runs[2] == ("failed", {"label": ("success", 1), "gate": ("failed", 1)}), logs[2][-4000:]
    assert "jobrunner compare exited 3: the quality gate failed" in logs[2]
    assert all((out / night / "_stats.json").is_file() for night in ("2025-01-01", "2025-01-02", "2025-01-03"))


def test_each_exit_code_maps_to_its_task_outcome(airflow_bin):
    """2 and 3 fail without retry (AirflowFailException), 1, 4 and 130 fail for a retry, 0 succeeds: the
    DAG file's own mapping, in Airflow's environment, around a command that exits each code."""
    code = textwrap.dedent("""
        import importlib.util, json, sys
        spec = importlib.util.spec_from_file_location("nightly_dag", sys.argv[1])
        dag_file = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(dag_file)
        outcomes = {}
        for n in (0, 1, 2, 3, 4, 130):
            try:
                dag_file.run("jobrunner submit", [sys.executable, "-c", f"raise SystemExit({n})"])
                outcomes[n] = "success"
            except Exception as e:
                outcomes[n] = type(e).__name__
        print(json.dumps(outcomes))
    """)
    p = subprocess.run([str(airflow_bin / "python"), "-c", code, str(DAG_FILE)], capture_output=True, text=True,
                       timeout=300, env=_clean_env(JOBRUNNER="jobrunner"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {
        "0": "success", "1": "RuntimeError", "2": "AirflowFailException", "3": "AirflowFailException",
        "4": "RuntimeError", "130": "RuntimeError"}


def test_the_guide_shows_the_dag_file_as_it_is():
    guide = (ROOT / "docs" / "guides" / "nightly.md").read_text()
    assert f"```python\n{DAG_FILE.read_text()}```" in guide
