"""Issue 28: exit codes describe the whole output, over whole job histories (first run, rerun, rerun
after an interruption or a kill); rows that failed always say why; one definition of a row for the
warning and the summary; reused rows apart from computed ones; usage errors exit 2. Tiny models."""
import json
import logging
import os

import pytest
from click.testing import CliRunner

from jobrunner.pipeline import build
from jobrunner.cli.main import main
from jobrunner.config.job import job_config, JobConfigError
from jobrunner.pipeline.build import open_job
from jobrunner.pipeline.exit_codes import EXIT_CONFIG, EXIT_ERROR_RATE, EXIT_INTERRUPTED, EXIT_OK
from jobrunner.output import read_results
from jobrunner.pipeline.progress import Progress

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = f"dummy:{ROOT}/benchmarks/configs/tiny-llama.json"
TINY_OPTS = ["-m", TINY, "--kv-cache-memory", "4MB", "--no-chat"]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def tiny_engine():
    return build.load_engine(job_config("unused", model=TINY, kv_cache_memory=4 * 10**6))


def _stopping_after(rows: int):
    """A progress reporter that asks its job to stop once `rows` rows are written (as a SIGTERM does)."""
    class StopAfter(Progress):
        stop = None         # the job's stop event, once the job is built

        def update(self, stats):
            super().update(stats)
            if stats.rows >= rows:
                self.stop.set()
    return StopAfter(total=None)


def run_job(engine, dataset, output, stop_after=None, **kw):
    cfg = job_config(dataset, output=output, model=TINY, max_tokens=2, chat=False, **kw)
    if stop_after is None:
        return open_job(cfg, engine=engine).run()
    progress = _stopping_after(stop_after)
    job = open_job(cfg, engine=engine, progress=progress, max_in_flight=1)  # one row at a time: rows left at the stop
    progress.stop = job.stop
    return job.run()


def _kill_remains(output):
    """What a kill -9 leaves: the parts written and the manifest, no summary."""
    for name in os.listdir(output):
        if name.startswith("_stats"):
            os.remove(os.path.join(output, name))


# Rows: "ok" ones run; "bad" ones have an empty prompt (the engine's "empty prompt" row error).
def _rows(ok: int, bad: int, bad_first: bool = False):
    oks = [{"id": f"ok{i}", "prompt": f"row {i} of the tiny job"} for i in range(ok)]
    bads = [{"id": f"bad{i}", "prompt": ""} for i in range(bad)]
    return bads + oks if bad_first else oks + bads


# (name, (ok rows, bad rows[, bad first]), steps): each step (options, what happens first, expected exit code);
# the same dataset and output throughout. "stop": interrupted after one row; "kill": then its summary gone.
HISTORIES = [
    ("all ok, rerun", (3, 0), [({}, None, EXIT_OK), ({}, None, EXIT_OK)]),
    ("over the rate, rerun still over", (2, 2), [({"max_error_rate": 0.25}, None, EXIT_ERROR_RATE),
                                                ({"max_error_rate": 0.25}, None, EXIT_ERROR_RATE)]),
    ("within the rate, rerun", (3, 1), [({"max_error_rate": 0.5}, None, EXIT_OK),
                                        ({"max_error_rate": 0.5}, None, EXIT_OK)]),
    ("every row failed, rerun, opted out", (0, 3), [({}, None, EXIT_ERROR_RATE), ({}, None, EXIT_ERROR_RATE),
                                                    ({"allow_all_failed": True}, None, EXIT_OK)]),
    ("every row failed, opted out from the start", (0, 2), [({"allow_all_failed": True}, None, EXIT_OK)]),
    ("interrupted, then over the rate", (2, 3), [({"max_error_rate": 0.5}, "stop", EXIT_INTERRUPTED),
                                                 ({"max_error_rate": 0.5}, None, EXIT_ERROR_RATE),
                                                 ({"max_error_rate": 0.5}, None, EXIT_ERROR_RATE)]),
    ("killed, then over the rate", (2, 3), [({"max_error_rate": 0.5}, "kill", None),
                                            ({"max_error_rate": 0.5}, None, EXIT_ERROR_RATE),
                                            ({"max_error_rate": 0.5}, None, EXIT_ERROR_RATE)]),
    ("killed, rerun within the rate", (3, 1), [({"max_error_rate": 0.3}, "kill", None),
                                               ({"max_error_rate": 0.3}, None, EXIT_OK)]),
    ("the first rows failed, the rest did not", (2, 2, True), [
        ({"limit": 2, "max_error_rate": 0.5}, None, EXIT_ERROR_RATE), ({"max_error_rate": 0.5}, None, EXIT_OK)]),
]


@pytest.mark.parametrize("name,shape,steps", HISTORIES, ids=[h[0] for h in HISTORIES])
def test_exit_codes_over_job_histories(tiny_engine, tmp_path, name, shape, steps):
    rows = _rows(*shape)
    ds = write_jsonl(tmp_path / "d.jsonl", rows)
    out = str(tmp_path / "out")
    for options, event, expected in steps:
        # a stopped job leaves its requests in flight in its engine: it gets an engine of its own
        engine = build.load_engine(job_config("unused", model=TINY, kv_cache_memory=4 * 10**6)) if event \
            else tiny_engine
        res = run_job(engine, ds, out, stop_after=1 if event else None, **options)
        if event == "kill":
            assert res.exit_code == EXIT_INTERRUPTED
            _kill_remains(out)
            continue
        assert res.exit_code == expected, (name, options, res.stats.get("rows"), res.stats.get("rows_failed"))
        if expected == EXIT_ERROR_RATE:
            assert res.error, "an exit 3 says why"
    final = read_results(out).to_pylist()
    assert sorted(r["id"] for r in final) == sorted(r["id"] for r in rows)     # every row once


def test_a_rerun_over_the_rate_says_so_over_the_whole_output(tiny_engine, tmp_path, caplog):
    ds = write_jsonl(tmp_path / "d.jsonl", _rows(2, 2))
    out = str(tmp_path / "out")
    assert run_job(tiny_engine, ds, out, max_error_rate=0.1).exit_code == EXIT_ERROR_RATE
    with caplog.at_level(logging.WARNING, logger="jobrunner"):
        res = run_job(tiny_engine, ds, out, max_error_rate=0.1)
    assert res.exit_code == EXIT_ERROR_RATE
    assert res.error == ("2 of 4 rows failed, over --max-error-rate 0.1 "
                         "(in the whole output: 4 of its rows were written before this run)")
    assert "2 of 4 rows failed; their errors are in the `error` column" in caplog.text


def test_every_row_failed_exits_3_on_the_command_line_unless_allowed(tmp_path):
    ds = write_jsonl(tmp_path / "d.jsonl", _rows(0, 2))
    r = CliRunner().invoke(main, ["submit", ds, *TINY_OPTS, "-o", str(tmp_path / "o1")])
    assert r.exit_code == EXIT_ERROR_RATE, r.output
    assert "every row failed (2 of 2)" in r.output and "--allow-all-failed" in r.output
    r = CliRunner().invoke(main, ["submit", ds, *TINY_OPTS, "-o", str(tmp_path / "o2"), "--allow-all-failed"])
    assert r.exit_code == EXIT_OK, r.output
    toml = tmp_path / "job.toml"
    toml.write_text("allow_all_failed = true\n")
    r = CliRunner().invoke(main, ["submit", ds, *TINY_OPTS, "-o", str(tmp_path / "o3"), "--config", str(toml)])
    assert r.exit_code == EXIT_OK, r.output


def test_a_model_that_fails_to_load_exits_2_with_its_error_not_as_storage(tmp_path, monkeypatch):
    """A checkpoint file gone while the engine loads it (another worker's conversion, a cache cleaned) is
    the model's failure: its error and exit 2, not "output storage failed" and exit 4 (issue 41, item 4)."""
    from jobrunner import engine

    def gone(self, config):
        raise FileNotFoundError(2, "No such file or directory", "/cache/float/x/model.safetensors")
    monkeypatch.setattr(engine.Engine, "__init__", gone)
    ds = write_jsonl(tmp_path / "d.jsonl", _rows(2, 0))
    r = CliRunner().invoke(main, ["submit", ds, *TINY_OPTS, "-o", str(tmp_path / "out")])
    assert r.exit_code == EXIT_CONFIG, r.output
    assert "failed to load: FileNotFoundError" in r.output and "model.safetensors" in r.output
    assert "storage" not in r.output


def test_generate_raises_when_every_row_failed(tiny_engine):
    import jobrunner
    from jobrunner.api.submit import JobFailedError
    rows = [{"id": "a", "prompt": ""}, {"id": "b", "prompt": ""}]
    opts = dict(model=TINY, kv_cache_memory=4 * 10**6, max_tokens=2, chat=False)
    with pytest.raises(JobFailedError, match=r"every row failed \(2 of 2\).*allow_all_failed=True"):
        jobrunner.generate(rows, **opts)
    df = jobrunner.generate(rows, allow_all_failed=True, **opts)
    assert df["error"].null_count() == 0


# ---------------------------------------------------------------- usage errors (item 14)


def test_a_negative_limit_is_a_usage_error(tmp_path):
    ds = write_jsonl(tmp_path / "d.jsonl", _rows(2, 0))
    r = CliRunner().invoke(main, ["submit", ds, *TINY_OPTS, "-o", str(tmp_path / "o"), "--limit", "-1"])
    assert r.exit_code == EXIT_CONFIG and "--limit must be >= 0" in r.output, r.output
    assert not os.path.exists(tmp_path / "o")
    with pytest.raises(JobConfigError, match="--limit"):
        job_config(ds, limit=-1)


def test_cache_stats_on_a_path_without_a_cache_exits_2(tmp_path):
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "empty", tmp_path / "missing"):
        r = CliRunner().invoke(main, ["cache", "stats", str(path)])
        assert r.exit_code == EXIT_CONFIG and "no result cache there" in r.output, r.output
