"""`--ray`: a job whose workers are Ray actors, on a real local Ray cluster bound to loopback only.

One head node for the module (`ray start --head --block`, 127.0.0.1, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0,
which keeps every Ray listener on loopback; a second node would need its own network namespace), with
two workers on it. Its authentication is Ray's default for `ray start`: a token, the one in
~/.ray/auth_token of the HOME it and the drivers share (a temporary one), which jobrunner finds as
Ray's own clients do. Each job runs as `jobrunner submit --ray 127.0.0.1:PORT` in a subprocess, so that a
worker's process or the driver can be killed mid-job. The rows: a tiny random Llama (dummy weights, byte
tokenizer), one shared-prefix group and many small unique prompts; the reference is a local run.
"""
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

# The cluster's token, in the HOME of the cluster and of the drivers (never the user's ~/.ray).
TOKEN = secrets.token_hex(32)
HOME = Path(tempfile.mkdtemp(prefix="jr-ray-home-"))
(HOME / ".ray").mkdir()
(HOME / ".ray" / "auth_token").write_text(TOKEN)
# this process joins the cluster too (the Ray Data test): loopback only, with the token; Ray reads these at import
os.environ.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=TOKEN)
ray = pytest.importorskip("ray")

from jobrunner.config.job import job_config  # noqa: E402
from jobrunner.pipeline.exit_codes import EXIT_OK  # noqa: E402
from jobrunner.pipeline.build import open_job  # noqa: E402
from jobrunner.output import read_results, read_stats  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 259, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 1024,
        "tie_word_embeddings": False, "bos_token_id": 256, "eos_token_id": 258}
OPTIONS = ["--max-tokens", "8", "--max-num-seqs", "2", "--part-rows", "4", "--device", "cpu"]
# loopback only; Ray's authentication as `ray start` sets it up by default (no RAY_AUTH_* variable: the token
# file in HOME)
ENV = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
ENV.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", PYTHONPATH=ROOT, RAY_DISABLE_USAGE_STATS="1", HOME=str(HOME))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A one-node Ray cluster on 127.0.0.1 with 3 CPUs (two workers and room), ended with its process group."""
    port = _free_port()
    temp = f"/tmp/jr-ray-{os.getpid()}"        # Ray's socket paths must stay short
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    head = subprocess.Popen([ray_bin, "start", "--head", "--block", "--port", str(port), "--node-ip-address",
                             "127.0.0.1", "--num-cpus", "3", "--include-dashboard", "false", "--disable-usage-stats",
                             "--temp-dir", temp, "--object-store-memory", str(100 * 2**20)],
                            env=ENV, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    started, said = time.time(), []
    for line in head.stdout:
        said.append(line)
        if "Ray runtime started" in line:
            break
        assert time.time() - started < 120, "ray start took over 2 minutes"
    else:
        pytest.fail(f"ray start failed (exit {head.wait()})")
    assert any("Token authentication is enabled" in line for line in said), "".join(said)    # Ray's default
    threading.Thread(target=lambda: [None for _ in head.stdout], daemon=True).start()     # keep the pipe drained
    yield {"address": f"127.0.0.1:{port}", "sid": head.pid}     # a session leader: its sid is its pid
    for pid in [head.pid] + _session_pids(head.pid):      # every Ray process of this node is in its session
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    head.wait()
    shutil.rmtree(temp, ignore_errors=True)
    shutil.rmtree(HOME, ignore_errors=True)


def _session_pids(sid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                fields = open(f"/proc/{name}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid:       # stat fields after the name: state ppid pgrp session ...
                pids.append(int(name))
    return pids


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray")
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text(json.dumps(TINY))
    rnd = random.Random(0)
    context = "Context: " + " ".join(f"fact {i} is {i * 7 % 13}." for i in range(16))
    rows = [{"id": f"big{i}", "prompt": f"{context} Which fact is {i}? {rnd.choice('abcdefgh')}"} for i in range(20)]
    rows += [{"id": f"s{i}", "prompt": "".join(rnd.choice("abcdefghij ") for _ in range(10 + i % 17))}
             for i in range(260)]
    rnd.shuffle(rows)
    path = root / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = f"dummy:{root / 'model'}"
    cfg = job_config(str(path), model=model, max_tokens=8, max_num_seqs=2, part_rows=4, device="cpu",
                     output=str(root / "local"))
    job = open_job(cfg)     # the reference: a local run in this process
    try:
        assert job.run().exit_code == EXIT_OK
    finally:
        job.engine.close()
    return {"root": root, "path": str(path), "model": model, "ids": sorted(r["id"] for r in rows),
            "reference": _outputs(cfg.output_url)}


def _outputs(output: str) -> dict:
    rows = read_results(output).to_pylist()
    twice = [k for k, v in Counter(r["id"] for r in rows).items() if v > 1]
    assert not twice, f"ids written twice: {twice}"
    return {r["id"]: (r["output"], r["completion_tokens"], r["error"]) for r in rows}


def _rows(output: str) -> list[tuple]:
    return sorted(((r["id"], r["output"], r["completion_tokens"], r["error"]) for r in read_results(output).to_pylist()),
                  key=repr)


def _command(cluster, data, out, *extra) -> list[str]:
    return [sys.executable, "-m", "jobrunner.cli.main", "submit", data["path"], "-m", data["model"], "-o", str(out),
            *OPTIONS, "--ray", cluster["address"], *extra]


class Driver:
    """`jobrunner submit --ray ...` in a subprocess, its log read as it comes (the workers' pids are in it)."""

    def __init__(self, cmd, env=ENV, cwd=None):
        self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def worker_pid(self, rank: int) -> int | None:
        m = re.search(rf"ray: worker {rank} loaded on \S+ \(node \w+, pid (\d+)[,)]", self.log)
        return int(m.group(1)) if m else None

    def wait(self, timeout: float = 240) -> int:
        rc = self.proc.wait(timeout)
        self.reader.join(10)
        return rc


def _wait_for(condition, timeout: float = 120, what: str = "") -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _parts(out, prefix: str = "part-") -> list[str]:
    return [n for n in os.listdir(out) if n.startswith(prefix) and n.endswith(".parquet")] if out.is_dir() else []


def test_two_workers_write_the_rows_of_a_local_run(cluster, data):
    out = data["root"] / "two"
    d = Driver(_command(cluster, data, out, "--data-parallel", "2", "--ray-min-workers", "2"))
    assert d.wait() == 0, d.log[-4000:]
    assert _outputs(str(out)) == data["reference"]
    s = read_stats(str(out))
    assert s["rows"] == s["rows_ok"] == len(data["ids"]) and s["devices"] == 2
    assert set(s["workers"]) == {"rank0", "rank1"}
    assert all(w["rows"] > 0 and w["units"] > 0 for w in s["workers"].values()), s["workers"]
    assert sum(w["rows"] for w in s["workers"].values()) == len(data["ids"])
    assert s["data_parallel"]["rounds"] == 1 and s["data_parallel"]["balance"] > 0
    assert {n.split("-")[1] for n in _parts(out)} == {"r0", "r1"}      # each worker's own parts (no hit, no error)
    assert "planned 280 rows in" in d.log       # once, by the driver
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["complete"] is True and manifest["model_source"].startswith("dummy:")
    assert re.fullmatch(r"[0-9a-f]+", manifest["ray"]["job_id"]) and manifest["ray"]["workers"] == 2


def test_relative_paths_and_the_drivers_cache_reach_the_workers(cluster, data, tmp_path):
    """A dataset, output and JOBRUNNER_CACHE given relative to the driver's directory: the workers (in Ray's
    directory) read and write the same files, and keep the driver's cache (issue 41, items 3 and 4)."""
    shutil.copy(data["path"], tmp_path / "p.jsonl")
    cmd = _command(cluster, dict(data, path="p.jsonl"), "rel-out", "--data-parallel", "2", "--ray-min-workers", "2")
    d = Driver(cmd, env=dict(ENV, JOBRUNNER_CACHE="cache-here"), cwd=tmp_path)
    assert d.wait() == 0, d.log[-4000:]
    assert _outputs(str(tmp_path / "rel-out")) == data["reference"]
    assert d.log.count(f"cache {tmp_path / 'cache-here'})") == 2, d.log[-4000:]


def test_a_client_without_the_clusters_token_is_told_how_to_join(cluster, data, tmp_path):
    # no ~/.ray/auth_token here; Ray's driver tries the GCS 3 times (a second apart), not its default 20
    env = dict(ENV, HOME=str(tmp_path), RAY_NUM_REDIS_GET_RETRIES="3", RAY_gcs_server_port_wait_time_s="3")
    d = Driver(_command(cluster, data, tmp_path / "out"), env=env)
    assert d.wait(120) == 2, d.log[-4000:]
    assert "token authentication" in d.log and "~/.ray/auth_token" in d.log, d.log[-4000:]
    assert not (tmp_path / "out").exists()


def test_the_cluster_listens_on_loopback_only(cluster):
    listing = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    ours = set(_session_pids(cluster["sid"]))
    seen = 0
    for line in listing.splitlines():
        pids = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        if pids & ours:
            seen += 1
            local = line.split()[3]
            assert local.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:", "[::1]:")), line
    assert seen >= 2        # the GCS and the raylet at least


def test_a_worker_killed_mid_job_loses_only_its_unwritten_rows(cluster, data):
    out = data["root"] / "killed"
    d = Driver(_command(cluster, data, out, "--data-parallel", "2", "--ray-min-workers", "2"))
    _wait_for(lambda: d.worker_pid(1) and _parts(out, "part-r1-"), what="worker 1's first part")
    os.kill(d.worker_pid(1), signal.SIGKILL)
    assert d.wait() == 0, d.log[-4000:]
    assert _outputs(str(out)) == data["reference"]       # every id once, as a local run wrote it
    s = read_stats(str(out))
    assert s["rows"] == len(data["ids"])
    dp = s["data_parallel"]
    assert dp["lost_workers"] == [1] and dp["rounds"] == 1, dp     # its units went back to the queue: one pass
    assert 0 < dp["rows_by_lost_workers"] < len(data["ids"]), dp
    assert "worker 1 stopped" in d.log and "go back to the queue" in d.log
    # the rows it wrote are its parts' (none redone), the others' the workers' and the plan's own
    assert sum(w["rows"] for w in s["workers"].values()) + dp["rows_by_lost_workers"] == len(data["ids"])


def test_the_driver_killed_mid_job_then_the_same_command_resumes(cluster, data):
    out = data["root"] / "driver"
    cmd = _command(cluster, data, out, "--data-parallel", "2")
    d = Driver(cmd)
    _wait_for(lambda: len(_parts(out)) >= 3, what="three parts")
    d.proc.kill()
    d.wait()
    written = len(read_results(str(out)))
    assert 0 < written < len(data["ids"])
    assert json.loads((out / "_manifest.json").read_text())["complete"] is False
    again = Driver(cmd)
    assert again.wait() == 0, again.log[-4000:]
    assert _outputs(str(out)) == data["reference"]      # every id exactly once
    s = read_stats(str(out))
    assert s["runs"][-1]["rows_skipped_done"] >= written and s["rows"] == len(data["ids"])


def test_a_cluster_without_the_resources_exits_2_within_the_timeout(cluster, data):
    out = data["root"] / "unplaced"
    started = time.time()
    d = Driver(_command(cluster, data, out, "--ray-resources", '{"TPU": 1}', "--ray-timeout", "3"))
    assert d.wait(120) == 2, d.log[-4000:]
    assert time.time() - started < 60
    assert "placed 0 of the 1 workers needed within 3 s" in d.log and "'TPU': 1.0" in d.log
    assert not _parts(out)


def test_a_ray_data_pipeline_hands_off_to_a_job_and_reads_the_results_back(cluster, data):
    from jobrunner.ray_data import read_results_dataset, submit_dataset
    from ray._private.authentication_test_utils import reset_auth_token_state
    rows = [json.loads(line) for line in open(data["path"])][:40]
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=TOKEN)
    reset_auth_token_state()        # Ray read its auth mode when first imported: maybe by another module's test
    ray.init(address=cluster["address"], logging_level="WARNING", log_to_driver=False)
    try:
        res = submit_dataset(ray.data.from_items(rows), str(data["root"] / "ray-data"), model=data["model"],
                             max_tokens=8, max_num_seqs=2, part_rows=4, device="cpu", ray=cluster["address"],
                             data_parallel=2)
        assert res.exit_code == EXIT_OK
        back = read_results_dataset(res.output).take_all()
    finally:
        ray.shutdown()
    assert sorted(r["id"] for r in back) == sorted(r["id"] for r in rows)      # _stats.parquet not read
    assert {r["id"]: r["output"] for r in back} == {r["id"]: data["reference"][r["id"]][0] for r in rows}


def test_copies_cache_hits_and_error_rows_are_a_local_runs(cluster, data, tmp_path):
    """Dedup copies go with their leader's unit; the driver writes the rows that need no engine (an error,
    a duplicate id, result-cache hits and their copies) in its own parts; a second run is all cache hits."""
    rnd = random.Random(1)
    prompts = ["".join(rnd.choice("abcdefghij ") for _ in range(12 + i % 9)) for i in range(30)]
    rows = [{"id": f"d{i}", "prompt": prompts[i % 30]} for i in range(70)]
    rows += [{"id": "d3", "prompt": "a duplicate id"}, {"id": "bad", "prompt": None}]
    path = tmp_path / "dups.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dups = dict(data, path=str(path))
    local = tmp_path / "local"
    cfg = job_config(str(path), model=data["model"], max_tokens=8, max_num_seqs=2, part_rows=4, device="cpu",
                     output=str(local), cache=str(tmp_path / "cache-local"))
    job = open_job(cfg)
    try:
        code = job.run().exit_code
    finally:
        job.engine.close()
    reference = _rows(str(local))
    for run, out in enumerate((tmp_path / "first", tmp_path / "again")):
        d = Driver(_command(cluster, dups, out, "--data-parallel", "2", "--cache", str(tmp_path / "cache")))
        assert d.wait() == code, d.log[-4000:]      # the error rows: the local run's exit
        assert _rows(str(out)) == reference     # d3 twice: its row, and the duplicate's error row
        s = read_stats(str(out))
        assert s["rows"] == len(reference) and s["duplicate_ids"] == 1, s
        if run == 0:
            assert s["rows_reused"] == 40 and s["rows_from_cache"] == 0, s     # 40 copies of 30 leaders
        else:
            assert s["rows_from_cache"] == 30 and s["rows_reused"] == 40, s
            assert not _parts(out, "part-r"), "every row came from the cache: the driver wrote them all"
        assert _parts(out, "part-plan-")        # the error rows (and hits) are the driver's


def test_the_drivers_progress_line_every_ten_seconds_counts_rows_and_says_its_eta(monkeypatch, caplog):
    """The driver's progress line (not on a terminal), driven by a clock of our own: the first call only
    starts the count, one 10 s later logs rows, rate and ETA from the queue's progress; none in between."""
    from jobrunner.parallel import ray_driver

    class Remote:
        def __init__(self, value):
            self.value = value

        def remote(self):
            return self.value

    class Queue:
        status = Remote({"progress": {0: {"rows": 10, "failed": 1, "tokens": 300}}, "handed": 3, "queued": 2})

    class Ray:
        @staticmethod
        def get(value, timeout=None):
            return value

    clock = [1000.0]
    monkeypatch.setattr(ray_driver.time, "time", lambda: clock[0])
    driver = object.__new__(ray_driver.RayDriver)
    driver.ray, driver.queue, driver.parts, driver.total, driver.runs, driver.last_log = Ray, Queue, None, 50, {0: 0}, 0.0
    caplog.set_level("INFO", logger=ray_driver.log.name)
    driver._progress()                                              # starts the count, logs the start
    Queue.status.value["progress"][0]["rows"] = 30
    clock[0] += ray_driver.PROGRESS_LOG_S / 2
    driver._progress()                                              # too soon: nothing
    before = len(caplog.records)
    clock[0] += ray_driver.PROGRESS_LOG_S / 2
    driver._progress()
    assert len(caplog.records) == before + 1
    line = caplog.records[-1].getMessage()
    assert line.startswith("30/50 rows, 1 failed, 300 tokens, 2.0 rows/s, ETA 10 s, 1 workers"), line


def test_a_deterministic_run_through_ray_gives_a_local_runs_bits(cluster, tiny_hf_model_dir, tmp_path):
    """--deterministic (issue 61) over Ray: two workers, other batch sizes, each worker's own engine and
    threads; every row's tokens and logprobs the bits of one local process (tests/test_determinism.py holds
    the other schedules)."""
    import jobrunner
    from tests.test_determinism import KINDS, ROWS, SCHEDULE_COLUMNS, rows_of
    import polars as pl

    model = str(tiny_hf_model_dir("llama", max_position_embeddings=1024))
    ds = tmp_path / "rows.jsonl"
    ds.write_text("".join(json.dumps(r) + "\n" for r in ROWS))

    def rows(out) -> list:
        df = pl.DataFrame(read_results(str(out)).to_pylist())
        return rows_of(df.sort("id").drop([c for c in df.columns if c in SCHEDULE_COLUMNS]))

    assert jobrunner.submit(str(ds), str(tmp_path / "local"), model=model, device="cpu", kv_cache_memory="32MB",
                            deterministic=True, **KINDS["generate"]).exit_code == 0
    d = Driver([sys.executable, "-m", "jobrunner.cli.main", "submit", str(ds), "-m", model, "-o",
                str(tmp_path / "ray"), "--device", "cpu", "--kv-cache-memory", "32MB", "--deterministic",
                "--max-tokens", "16", "--top-logprobs", "2", "--ignore-eos", "--max-num-seqs", "3",
                "--part-rows", "4", "--ray", cluster["address"], "--data-parallel", "2", "--ray-min-workers", "2"])
    assert d.wait() == 0, d.log[-4000:]
    assert set(read_stats(str(tmp_path / "ray"))["workers"]) == {"rank0", "rank1"}
    assert rows(tmp_path / "ray") == rows(tmp_path / "local")
