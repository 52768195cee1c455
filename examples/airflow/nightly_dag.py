"""A nightly jobrunner DAG (Airflow 2.7+ and 3.x): label a fixed evaluation set with the model in production,
then gate the night's labels against the night before's with `jobrunner compare` (a changed model, template
or quantization shows up as changed labels, lost accuracy or missing rows). docs/guides/nightly.md ("Airflow")
explains it; tests/test_airflow_dag.py runs it with `airflow dags test`.

jobrunner runs as a command from its own environment (JOBRUNNER), never imported into Airflow's, so the
two sets of pins never meet. Each exit code of `jobrunner submit` and `jobrunner compare` is a task outcome:

    0               success
    2               AirflowFailException: bad configuration or input, or another run holds the output's
                    lease; a retry cannot fix it
    3               AirflowFailException: the quality gate (--max-error-rate, a compare gate) failed; a
                    rerun would exit 3 again
    1, 4, 130, ...  a plain failure: Airflow retries, and the retry resumes the job (rows written are kept)

A night without a baseline (the first, or after a failed night) skips the gate (AirflowSkipException).
execution_timeout stops the job with SIGTERM: jobrunner finishes the rows in flight, keeps its parts and
exits 130; the retry resumes from there.
"""
from __future__ import annotations

import os
import subprocess
from datetime import date, datetime, timedelta

try:                                                    # Airflow 3
    from airflow.sdk import DAG, Param, task
    from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException
except ImportError:                                     # Airflow 2
    from airflow import DAG
    from airflow.decorators import task
    from airflow.exceptions import AirflowFailException, AirflowSkipException
    from airflow.models.param import Param

# jobrunner's own virtual environment, e.g. /opt/jobrunner/bin/jobrunner
JOBRUNNER = os.environ.get("JOBRUNNER", "jobrunner")
NO_RETRY = {
    2: "a retry cannot fix it: bad configuration or input, or another run holds the output's lease",
    3: "the quality gate failed: a rerun would exit 3 again",
}


def run(step: str, args: list[str]) -> None:
    """Run one jobrunner command (its output goes to the task's log) and turn its exit code into the
    task's outcome."""
    print("+", " ".join(args), flush=True)
    proc = subprocess.Popen(args)
    try:
        code = proc.wait()
    except BaseException:       # execution_timeout, or the task was stopped: SIGTERM, so the job keeps its parts
        proc.terminate()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    if code == 0:
        return
    if code in NO_RETRY:
        raise AirflowFailException(f"{step} exited {code}: {NO_RETRY[code]}")
    raise RuntimeError(f"{step} exited {code}: retrying (the retry resumes the job)")     # 1, 4, 130


with DAG(
    dag_id="jobrunner_nightly",
    schedule="0 2 * * *",
    start_date=datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=1,          # one writer per output: a second run would exit 2 on the output's lease
    default_args={"retries": 3, "retry_delay": timedelta(minutes=5)},
    params={
        "dataset": Param("s3://lake/eval/reviews.parquet", type="string"),     # the same rows every night
        "output": Param("s3://lake/eval-runs/{ds}/", type="string"),            # {ds}: the night's date
        "model": Param("smollm2-135m-instruct", type="string"),
        "labels": Param("positive,negative,neutral", type="string"),
        "max_changed_rate": Param(0.05, type="number"),
        "max_accuracy_drop": Param(0.02, type="number"),
    },
) as dag:

    @task(execution_timeout=timedelta(hours=8))
    def label(params=None, ds=None) -> str:
        output = params["output"].format(ds=ds)
        run("jobrunner submit", [
            JOBRUNNER, "submit", params["dataset"], "-o", output, "-m", params["model"],
            "--kind", "classify", "--labels", params["labels"], "--reference-column", "label",
            "--max-error-rate", "0.01"])
        return output

    @task(execution_timeout=timedelta(minutes=30))
    def gate(output: str, params=None, ds=None) -> None:
        night_before = params["output"].format(ds=(date.fromisoformat(ds) - timedelta(days=1)).isoformat())
        if subprocess.run([JOBRUNNER, "stats", night_before], capture_output=True).returncode != 0:
            raise AirflowSkipException(f"no baseline: {night_before} is not a jobrunner output")
        run("jobrunner compare", [
            JOBRUNNER, "compare", night_before, output,
            "--max-changed-rate", str(params["max_changed_rate"]),
            "--max-accuracy-drop", str(params["max_accuracy_drop"]), "--max-missing-rate", "0"])

    gate(label())
