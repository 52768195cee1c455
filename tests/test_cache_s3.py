"""Object stores for real: a local S3-compatible server (moto in server mode, as s3fs's own tests
run it) holds a job's input, output and result cache; the job is killed -9 mid-way and resumed.

Skipped when s3fs or moto[server] is not installed (both are in the `test` extra)."""
import json
import os
import urllib.request
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")
pytest.importorskip("flask")

from tests.cache_helpers import prompts, run_job, tiny_model  # noqa: E402

BUCKET = "jobs"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """(s3fs filesystem, the FSSPEC_S3 options) of a fresh moto server with one bucket."""
    import fsspec.config
    import s3fs
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    options = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "testing", "secret": "testing"}
    # moto's backends are process-wide: another module's server may have left buckets behind
    urllib.request.urlopen(urllib.request.Request(f"{options['endpoint_url']}/moto-api/reset", method="POST")).close()
    saved = fsspec.config.conf.get("s3")
    fsspec.config.conf["s3"] = dict(options)        # every s3:// URL in this process reaches the server
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    old_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem(**options)
    fs.mkdir(BUCKET)
    yield fs, options
    server.stop()
    fsspec.config.conf.pop("s3", None)
    if saved is not None:
        fsspec.config.conf["s3"] = saved
    for k, v in old_env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    s3fs.S3FileSystem.clear_instance_cache()


def _put_jsonl(fs, path: str, rows: list[dict]) -> str:
    fs.pipe_file(path, "".join(json.dumps(r) + "\n" for r in rows).encode())
    return f"s3://{path}"


def _outputs(url: str) -> dict:
    from tests.cache_helpers import outputs
    return outputs(url)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from jobrunner.pipeline.build import load_engine
    from jobrunner.config.job import job_config
    return load_engine(job_config("unused", model=tiny_model(tmp_path_factory.mktemp("s3-model")), device="cpu"))


def test_a_job_with_input_output_and_cache_on_s3(s3, engine):
    fs, _ = s3
    rows = [{"id": f"s{i}", "prompt": p} for i, p in enumerate(prompts(10))]
    rows += [{"id": f"copy{i}", "prompt": p} for i, p in enumerate(prompts(3))]
    ds = _put_jsonl(fs, f"{BUCKET}/in/data.jsonl", rows)
    cache = f"s3://{BUCKET}/cache"
    first = run_job(engine, ds, f"s3://{BUCKET}/out1", cache=cache)
    assert first.exit_code == 0 and first.stats["rows"] == 13 and first.stats["rows_reused"] == 3
    second = run_job(engine, ds, f"s3://{BUCKET}/out2", cache=cache)
    assert second.stats["rows_from_cache"] == 10 and second.stats["engine"]["generated_tokens"] == 0
    a, b = _outputs(f"s3://{BUCKET}/out1"), _outputs(f"s3://{BUCKET}/out2")
    assert {k: v[:4] for k, v in a.items()} == {k: v[:4] for k, v in b.items()}
    assert fs.find(f"{BUCKET}/cache") and not [p for p in fs.find(f"{BUCKET}/cache") if "_tmp-" in p]


def test_kill_9_on_s3_then_resume_every_row_once_and_served_from_the_cache_after(s3, engine):
    fs, options = s3
    model = engine.config.model
    rows = [{"id": f"k{i:03d}", "prompt": p} for i, p in enumerate(prompts(400))]   # outlasts the first flush
    ds = _put_jsonl(fs, f"{BUCKET}/kill/data.jsonl", rows)
    out, cache = f"s3://{BUCKET}/kill/out", f"s3://{BUCKET}/kill/cache"
    env = {**os.environ, "FSSPEC_S3": json.dumps(options), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [sys.executable, "-m", "jobrunner.cli.main", "submit", ds, "-m", model, "-o", out, "--cache", cache,
           "--device", "cpu", "--max-tokens", "8", "--ignore-eos", "--max-num-seqs", "2", "--part-rows", "10000",
           "--flush-seconds", "0.3"]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None and not _parts(fs, f"{BUCKET}/kill/out"):
        time.sleep(0.05)
    assert p.poll() is None, p.communicate()[1]        # killed mid-job, not after it ended
    p.send_signal(signal.SIGKILL)
    p.communicate()
    kept = _outputs(out)
    assert 0 < len(kept) < len(rows)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    got = _outputs(out)
    assert sorted(got) == [r["id"] for r in rows]       # every row once: none lost, none twice
    assert {k: got[k] for k in kept} == kept
    again = run_job(engine, ds, out + "2", cache=cache, max_tokens=8, max_num_seqs=2)
    s = again.stats
    # the rows computed by the resumed run are cached; those of the killed run were not flushed yet
    assert s["rows_from_cache"] == len(rows) - len(kept) and s["engine"]["generated_tokens"] == 8 * len(kept)
    second = _outputs(out + "2")
    assert {k: v[:4] for k, v in second.items()} == {k: v[:4] for k, v in got.items()}


def _parts(fs, path: str) -> list:
    fs.invalidate_cache(path)
    try:
        return [n for n in fs.ls(path, detail=False) if n.rsplit("/", 1)[-1].startswith("part-")]
    except FileNotFoundError:
        return []


def test_an_output_on_s3_has_one_writer_at_a_time(s3):
    """The lease by a conditional create (If-None-Match), as S3 serves it."""
    from jobrunner.output.lease import OutputBusyError, OutputLease
    fs, _ = s3
    url = f"s3://{BUCKET}/leased/out"
    first = OutputLease(url).acquire()
    with pytest.raises(OutputBusyError, match="being written by another job"):
        OutputLease(url).acquire()
    assert json.loads(fs.cat_file(f"{BUCKET}/leased/out/_lease.json"))["holder"] == first.record["holder"]
    first.release()
    assert not fs.exists(f"{BUCKET}/leased/out/_lease.json")
    with OutputLease(url) as second:
        assert second.held
