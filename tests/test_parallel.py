"""Data parallelism on CPU: 2 and 3 workers match 1, a worker killed mid-job, two ranks started the torchrun way.

A tiny random Llama (dummy weights, byte tokenizer) keeps each worker's start-up to a few seconds;
the rows are uneven on purpose: one big prefix group and many small unique prompts.
"""
import json
import os
import random
import socket
import subprocess
import sys
from collections import Counter

import pytest

from jobrunner.config.job import job_config
from jobrunner.pipeline.exit_codes import EXIT_OK
from jobrunner.pipeline.build import open_job
from jobrunner.parallel import data_parallel_size, distributed_env, run_parallel
from jobrunner.parallel import launcher
from jobrunner.parallel.merged_stats import merge_stats
from jobrunner.output import read_results, read_stats
from tests import faulty_worker

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 259, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 1024,
        "tie_word_embeddings": False, "bos_token_id": 256, "eos_token_id": 258}
N_BIG, N_SMALL = 10, 16


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text(json.dumps(TINY))
    rnd = random.Random(0)
    context = "Context: " + " ".join(f"fact {i} is {i * 7 % 13}." for i in range(16))
    rows = [{"id": f"big{i}", "prompt": f"{context} Which fact is {i}? {rnd.choice('abcdefgh')}"}
            for i in range(N_BIG)]
    rows += [{"id": f"s{i}", "prompt": "".join(rnd.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(8 + i))}
             for i in range(N_SMALL)]
    rnd.shuffle(rows)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = job_config(str(data), model=f"dummy:{root / 'model'}", max_tokens=6, max_num_seqs=2, part_rows=2,
                    device="cpu", output=str(root / "one"))
    job = open_job(cfg)          # the reference: one worker, in this process
    res = job.run()
    assert res.exit_code == EXIT_OK
    return {"root": root, "cfg": cfg, "ids": sorted(r["id"] for r in rows), "reference": _outputs(res.output)}


def _outputs(output: str) -> dict:
    rows = read_results(output).to_pylist()
    counts = Counter(r["id"] for r in rows)
    assert max(counts.values()) == 1, f"ids written twice: {[k for k, v in counts.items() if v > 1]}"
    return {r["id"]: (r["output"], r["completion_tokens"], r["error"]) for r in rows}


def _check_same(setup, output: str) -> None:
    got = _outputs(output)
    assert sorted(got) == setup["ids"]
    assert got == setup["reference"]
    assert len({v[0] for v in got.values()}) > 5        # the outputs differ from row to row
    manifest = json.loads(open(os.path.join(output, "_manifest.json")).read())
    assert manifest["complete"] is True and manifest["model_source"].startswith("dummy:")
    assert manifest["sampling"]["temperature"] == {"value": 0.0, "source": "default"}     # the workers' manifest


@pytest.mark.parametrize("workers", [2, 3])
def test_workers_give_the_same_rows_as_one(setup, workers):
    cfg = setup["cfg"].with_options(data_parallel=workers, output=str(setup["root"] / f"dp{workers}"))
    res = run_parallel(cfg)
    assert res.exit_code == EXIT_OK
    _check_same(setup, res.output)
    s = read_stats(res.output)
    assert s["rows"] == s["rows_ok"] == len(setup["ids"]) and s["devices"] == workers
    assert set(s["workers"]) == {f"rank{k}" for k in range(workers)}
    assert sum(w["rows"] for w in s["workers"].values()) == len(setup["ids"])
    assert s["data_parallel"]["rounds"] == 1 and s["data_parallel"]["lost_workers"] == []
    assert s["data_parallel"]["units"] >= N_SMALL       # small prompts are units of their own
    reference = read_stats(setup["cfg"].output_url)
    for k in ("prompt_tokens", "completion_tokens", "optimum_cached_tokens"):
        assert s[k] == reference[k], k
    assert s["device_hours"] == pytest.approx(sum(w["device_hours"] for w in s["workers"].values()))
    assert s["decode_s_p50"] is not None


def test_a_few_rows_sharing_a_prefix_are_spread_over_both_workers(setup, tmp_path):
    """Rows sharing a long prefix plan into one unit; two workers each get a half (not one worker all),
    with the same outputs as one worker."""
    context = "Shared instructions: " + " ".join(f"rule {i} says {i * 5 % 11}." for i in range(12))
    rows = [{"id": f"p{i}", "prompt": f"{context} Question {i}?"} for i in range(6)]
    data = tmp_path / "prefix.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    one = setup["cfg"].with_options(dataset=str(data), output=str(tmp_path / "one"))
    job = open_job(one)
    assert job.run().exit_code == EXIT_OK
    res = run_parallel(one.with_options(data_parallel=2, output=str(tmp_path / "two")))
    assert res.exit_code == EXIT_OK
    assert _outputs(res.output) == _outputs(one.output_url)
    workers = read_stats(res.output)["workers"]
    assert set(workers) == {"rank0", "rank1"}
    assert all(w["units"] > 0 and w["rows"] > 0 for w in workers.values()), workers


def test_killed_worker_loses_only_its_unwritten_rows(setup, monkeypatch):
    # rank 1 dies like a crash once it has written a row, holding unfinished units
    monkeypatch.setattr(launcher, "WORKER_COMMAND", faulty_worker.command(rank=1, rows=1))
    cfg = setup["cfg"].with_options(data_parallel=2, part_rows=1, output=str(setup["root"] / "killed"))
    res = run_parallel(cfg)
    assert res.exit_code == EXIT_OK
    _check_same(setup, res.output)
    s = read_stats(res.output)
    assert s["data_parallel"]["lost_workers"] == [1] and s["data_parallel"]["rounds"] == 2
    assert any(n.startswith("part-r1-") for n in os.listdir(res.output))    # what rank 1 wrote was kept
    by_rank1 = sum(len(read_results_part(res.output, n)) for n in os.listdir(res.output) if n.startswith("part-r1-"))
    assert s["data_parallel"]["rows_by_lost_workers"] == by_rank1
    assert s["runs"][-1]["rows"] + by_rank1 == len(setup["ids"]) and "rank1" not in s["workers"]
    assert s["rows"] == len(setup["ids"])       # the summary counts every row in the output, rank 1's too


def read_results_part(output, name):
    import pyarrow.parquet as pq
    return pq.read_table(os.path.join(output, name))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_way(setup, out: str, world: int, extra_env=None, timeout=180, jobrunner=None, part_rows=None):
    """Each rank runs `jobrunner submit` (or `jobrunner`: a command to run instead of the CLI's module)."""
    cfg = setup["cfg"]
    port = _free_port()
    args = ["submit", cfg.input.dataset, "-m", cfg.engine.model, "-o", out, "--max-tokens", str(cfg.sampling.max_tokens),
            "--max-num-seqs", str(cfg.engine.max_num_seqs), "--part-rows", str(part_rows or cfg.output.part_rows),
            "--device", "cpu"]
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **(extra_env or {}))
        env.pop("JOBRUNNER_LAUNCHER_PID", None)
        procs.append(subprocess.Popen((jobrunner or [sys.executable, "-m", "jobrunner.cli.main"]) + args, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    return [p.returncode for p in procs], outs


def test_two_ranks_launched_the_torchrun_way_share_one_job(setup, tmp_path):
    out = str(tmp_path / "torchrun")        # a fresh output each run: the test can be repeated
    codes, logs = _torchrun_way(setup, out, 2)
    assert codes == [0, 0], logs
    _check_same(setup, out)
    s = read_stats(out)
    assert s["devices"] == 2 and set(s["workers"]) == {"rank0", "rank1"}
    assert all(w["rows"] > 0 for w in s["workers"].values()), s["workers"]    # both took work


def test_torchrun_rank_lost_then_resume(setup):
    """Under torchrun a lost rank ends the job (exit 1) with what was written kept; the rerun finishes it."""
    out = str(setup["root"] / "torchrun-lost")
    # rank 1 dies once it finished a row, which is still in its writer's buffer (parts of 100 rows): lost
    codes, logs = _torchrun_way(setup, out, 2, {"JOBRUNNER_HEARTBEAT_TIMEOUT": "3"},
                                jobrunner=faulty_worker.command(rank=1, rows=1), part_rows=100)
    assert codes[1] == faulty_worker.DIE_CODE and codes[0] == 1, logs
    assert json.loads(open(os.path.join(out, "_manifest.json")).read())["complete"] is False
    before = len(read_results(out))
    assert 0 < before < len(setup["ids"]), logs
    job = open_job(setup["cfg"].with_options(output=out))      # the resume: any number of workers; one here
    assert job.run().exit_code == EXIT_OK
    _check_same(setup, out)
    s = read_stats(out)
    assert s["runs"][-1]["rows_skipped_done"] == before and s["rows"] == len(setup["ids"])


def test_heartbeat_stop_waits_for_a_store_call_in_flight():
    """stop() returns only once the heartbeat thread is out of the store: a rank that then exits (or whose
    store rank 0 then destroys) never leaves a thread inside a store call ("terminate called ...")."""
    import threading
    import time

    from jobrunner.parallel.torchrun import _Heartbeat

    class SlowStore:
        def __init__(self):
            self.inside, self.release, self.calls = threading.Event(), threading.Event(), 0

        def add(self, key, n):
            self.inside.set()
            self.release.wait()
            self.calls += 1
            return self.calls
    store = SlowStore()
    beat = _Heartbeat(store, 1, every_s=0.0)
    beat.start()
    assert store.inside.wait(10)
    threading.Timer(0.2, store.release.set).start()
    t0 = time.monotonic()
    beat.stop()
    assert not beat.is_alive() and store.calls >= 1 and time.monotonic() - t0 >= 0.1
    beat.stop()     # again: a no-op


HEARTBEAT_EXIT = """
import time
from datetime import timedelta
import torch.distributed as dist
from jobrunner.parallel.torchrun import _Heartbeat
server = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=30), wait_for_workers=False)
beat = _Heartbeat(dist.TCPStore("127.0.0.1", server.port, 2, False, timeout=timedelta(seconds=30)), 1, every_s=0.0)
beat.start()
time.sleep(0.05)
beat.stop()
"""


def test_a_process_exits_cleanly_right_after_stopping_its_heartbeat():
    """The torchrun flake itself: a heartbeat left in TCPStore.add at interpreter exit aborted the rank
    (about one exit in two with a busy heartbeat before stop() joined it)."""
    for _ in range(3):
        p = subprocess.run([sys.executable, "-c", HEARTBEAT_EXIT], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]


def test_sigterm_to_the_launcher_then_resume(setup, tmp_path):
    """SIGTERM (cron's timeout, Airflow's kill) reaches the launcher; its workers stop after what they
    have written (exit 130); the same command again finishes with every id once."""
    import signal
    import time
    rnd = random.Random(1)
    rows = [{"id": f"x{i}", "prompt": "".join(rnd.choice("abcdefghij ") for _ in range(10 + i % 17))}
            for i in range(120)]        # a part a row: the first part comes with over 100 rows still to go
    data = tmp_path / "many.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "jobrunner.cli.main", "submit", str(data), "-m", setup["cfg"].engine.model, "-o", str(out),
           "--max-tokens", "8", "--max-num-seqs", "2", "--part-rows", "1", "--device", "cpu", "--data-parallel", "2"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (out.is_dir() and any(n.startswith("part-") for n in os.listdir(out))):
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    log = p.communicate(timeout=120)[0]
    assert p.returncode == 130, log
    s = read_stats(str(out))
    assert s["interrupted"] is True and 0 < len(read_results(str(out))) < len(rows)
    assert json.loads((out / "_manifest.json").read_text())["complete"] is False
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert p.returncode == 0, p.stdout
    ids = [r["id"] for r in read_results(str(out)).to_pylist()]
    assert sorted(ids) == sorted(r["id"] for r in rows)      # every id exactly once


# --- pure parts -------------------------------------------------------------------------------

def test_data_parallel_defaults(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "JOBRUNNER_LAUNCHER_PID"):
        monkeypatch.delenv(k, raising=False)
    assert distributed_env() is None
    for options, size in ((dict(device="cpu"), 1), (dict(device="cpu", data_parallel=3), 3),
                          (dict(device="cuda:1"), 1)):
        cfg = job_config("x", **options)
        assert data_parallel_size(cfg.engine, cfg.parallel) == size
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert distributed_env() == {"rank": 1, "world": 4, "local_rank": 1, "local_world": 2}


def test_merge_stats():
    def result(rank, rows, wall):
        summary = {"rows": rows, "rows_ok": rows, "rows_failed": 0, "prompt_tokens": 10 * rows, "cached_tokens": rows,
                   "completion_tokens": 2 * rows, "rows_skipped_done": 5, "duplicate_ids": 0,
                   "device_hours": wall / 3600, "model_load_s": 1.0,
                   "engine": {"steps": rows, "preemptions": 0}, "interrupted": False}
        lat = [0.1 * (i + 1) for i in range(rows)]
        return {"rank": rank, "slot": rank, "round": 0, "device": "cpu", "exit_code": 0, "units": rows,
                "run_s": wall, "summary": summary,
                "sketch": {k: {"n": rows, "q": lat} for k in ("queue", "prefill", "decode")}}
    a, b = result(0, 3, 10.0), result(1, 1, 8.0)
    cfg = job_config("x", device_hourly_cost=3.6)
    s = merge_stats([a, b], cfg.engine, cfg.parallel, cfg.output, wall_s=10.0, devices=2, rounds=1, lost=[])
    assert s["rows"] == 4 and s["prompt_tokens"] == 40 and s["rows_skipped_done"] == 5
    assert s["device_hours"] == pytest.approx(18 / 3600) and s["cost_usd"] == pytest.approx(0.018)
    assert s["decode_tokens_per_s"] == pytest.approx(0.8)
    assert s["engine"] == {"steps": 4, "preemptions": 0}
    assert s["workers"]["rank0"]["rows"] == 3 and s["data_parallel"]["balance"] == pytest.approx(0.8)
    assert s["queue_s_p50"] == pytest.approx(0.1, abs=0.11)
    assert "metrics" not in s       # a run's record; the job's metrics come from the parts (summary.py)


def test_worker_hands_out_largest_units_first_within_each_window():
    """Largest first, but never across a planning window (the planner marks where each ends;
    windows cut by tokens hold any number of rows)."""
    from jobrunner.parallel.worker import SharedUnits
    from jobrunner.planner import WorkUnit
    units = [WorkUnit(["a"], 5, 5), WorkUnit(["b", "c"], 10, 50, window_end=True),
             WorkUnit(["d"], 100, 100), WorkUnit(["e"], 1, 1), WorkUnit(["f"], 300, 300, window_end=True),
             WorkUnit(["g"], 2, 2)]
    work = SharedUnits(claim=lambda index: True, rank=0, world=1, out_tokens=0)     # one worker: nothing to spread
    assert [u.items for u, _ in work.units(iter(units), {}, None)] == [["b", "c"], ["a"], ["f"], ["d"], ["e"], ["g"]]


def test_worker_spreads_a_window_of_fewer_units_than_workers():
    """One 5-row unit for 2 workers: two halves, figures from the rows' packed token ids, largest first."""
    from array import array
    from types import SimpleNamespace

    from jobrunner.parallel.worker import SharedUnits
    from jobrunner.planner import WorkUnit
    prefix = [9] * 30
    tokens = {"a": prefix + [1], "b": prefix + [2], "c": prefix + [3, 3], "d": prefix + [4, 4, 4, 4], "e": prefix + [5]}
    pending = {k: SimpleNamespace(tokens=array("I", t)) for k, t in tokens.items()}     # the job's PendingRows
    claimed = []
    work = SharedUnits(claim=lambda index: claimed.append(index) or index == 1, rank=0, world=2, out_tokens=0)
    units = list(work.units(iter([WorkUnit(list(tokens), 30, 159, window_end=True)]), pending, None))
    # computed tokens: [a, b, c] 94 - 2 * 30 = 34, [d, e] 65 - 30 = 35, so [d, e] goes first
    assert [(u.items, u.shared_prefix_len, u.prompt_tokens) for u, _ in units] == \
        [(["d", "e"], 30, 65), (["a", "b", "c"], 30, 94)]
    assert claimed == [0, 1] and [mine for _, mine in units] == [False, True]     # claimed by index, in order
