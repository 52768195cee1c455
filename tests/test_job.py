"""`jobrunner submit` end to end on the default model: formats, fsspec, resume, bad rows, job kinds."""
import json
import os
import signal
import subprocess
import sys
import time

import fsspec
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobrunner.config.job import job_config
from jobrunner.pipeline.exit_codes import EXIT_CONFIG, EXIT_ERROR_RATE, EXIT_OK
from jobrunner.pipeline.build import open_job

pytestmark = pytest.mark.default_model

ROWS = [{"id": f"q{i}", "prompt": p, "answer": a} for i, (p, a) in enumerate([
    ("What is the capital of France? Answer in one word.", "Paris"),
    ("What is 2 + 2? Answer with a number.", "4"),
    ("Name a primary color. One word.", "red"),
    ("What is the opposite of hot? One word.", "cold"),
    ("Which animal says moo? One word.", "cow"),
])]


@pytest.fixture(scope="module")
def engine(default_gguf_path):
    from jobrunner.pipeline.build import load_engine
    return load_engine(job_config("unused"))


def run(engine, dataset, tmp_path=None, **kw):
    kw.setdefault("output", str(tmp_path / "out") if tmp_path else None)
    kw.setdefault("max_tokens", 8)
    job = open_job(job_config(dataset, **kw), engine=engine)
    return job.run()


def results(output) -> pl.DataFrame:
    from jobrunner.output import read_results
    return pl.from_arrow(read_results(output))


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def test_generate_jsonl_writes_every_row_with_stats(engine, tmp_path):
    ds = write_jsonl(tmp_path / "q.jsonl", ROWS)
    res = run(engine, ds, tmp_path, reference_column="answer", match="contains")
    assert res.exit_code == EXIT_OK
    df = results(res.output)
    assert sorted(df["id"]) == [r["id"] for r in ROWS]
    assert df["error"].null_count() == len(ROWS)
    assert (df["completion_tokens"] > 0).all() and (df["prompt_tokens"] > 20).all()
    paris = df.filter(pl.col("id") == "q0")["output"][0]
    assert "Paris" in paris
    stats = json.loads(open(os.path.join(res.output, "_stats.json")).read())
    for key in ("rows", "rows_ok", "rows_failed", "prompt_tokens", "cached_tokens", "completion_tokens", "wall_s",
                "prefill_tokens_per_s", "decode_tokens_per_s", "cache_hit_rate", "queue_s_p50", "decode_s_p99",
                "device", "device_hours", "model_weight_bytes"):
        assert key in stats, key
    assert stats["rows"] == 5 and stats["rows_ok"] == 5
    assert stats["prompt_tokens"] == df["prompt_tokens"].sum()
    assert stats["metrics"]["evaluated_rows"] == 5 and 0 <= stats["metrics"]["accuracy"] <= 1


def test_formats_and_memory_fs_give_same_outputs(engine, tmp_path):
    table = pa.Table.from_pylist(ROWS)
    pq.write_table(table, tmp_path / "q.parquet")
    pl.from_arrow(table).write_csv(tmp_path / "q.csv")
    with fsspec.open("memory://ds/q.jsonl", "w") as f:
        f.write("\n".join(json.dumps(r) for r in ROWS))
    outs = {}
    for name, ds, out in [("parquet", str(tmp_path / "q.parquet"), str(tmp_path / "o1")),
                          ("csv", str(tmp_path / "q.csv"), str(tmp_path / "o2")),
                          ("memory", "memory://ds/q.jsonl", "memory://out/q")]:
        res = run(engine, ds, output=out)
        assert res.exit_code == EXIT_OK, name
        df = results(out).sort("id")
        outs[name] = df["output"].to_list()
    assert outs["parquet"] == outs["csv"] == outs["memory"]


def test_resume_skips_done_rows_and_refuses_other_config(engine, tmp_path):
    ds = write_jsonl(tmp_path / "q.jsonl", ROWS)
    first = run(engine, ds, tmp_path, limit=2)
    assert first.stats["rows"] == 2
    second = run(engine, ds, tmp_path)
    assert second.stats["rows"] == 5 and second.stats["runs_recorded"] == 2      # the summary covers every row
    assert second.stats["runs"][-1]["rows"] == 3 and second.stats["runs"][-1]["rows_skipped_done"] == 2
    assert sorted(results(second.output)["id"]) == [r["id"] for r in ROWS]
    from jobrunner.config.job import JobConfigError
    with pytest.raises(JobConfigError, match="max_tokens"):
        run(engine, ds, tmp_path, max_tokens=9)
    again = run(engine, ds, tmp_path, max_tokens=9, overwrite=True)
    assert again.stats["rows"] == 5


def test_bad_rows_become_error_rows(engine, tmp_path):
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps({"id": "ok", "prompt": "Say hi."}), "{not json", json.dumps({"id": "null", "prompt": None}),
             json.dumps({"id": "num", "prompt": 42}), json.dumps({"id": "empty", "prompt": "  "}),
             json.dumps({"id": "long", "prompt": "word " * 9000}), json.dumps({"id": "ok", "prompt": "dup id"})]
    path.write_bytes("\n".join(lines).encode() + b"\n\xff\xfe broken utf8\n")
    res = run(engine, str(path), tmp_path, max_error_rate=0.5)
    df = results(res.output)
    assert df.height == 8
    errors = dict(zip(df["id"], df["error"]))
    ok_rows = df.filter(pl.col("error").is_null())
    assert ok_rows.height == 1 and ok_rows["id"][0] == "ok"
    assert "context" in errors["long"] or "KV" in errors["long"]
    assert res.stats["duplicate_ids"] == 1
    assert any("line 2" in (e or "") for e in errors.values())
    assert any("line 8" in (e or "") for e in errors.values())
    assert res.exit_code == EXIT_ERROR_RATE


def test_openai_batch_in_and_out(engine, tmp_path):
    rows = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "x", "messages": [{"role": "user", "content": q}], "max_tokens": 3 + i}}
            for i, q in enumerate(["Hi!", "Name a fruit."])]
    ds = write_jsonl(tmp_path / "batch.jsonl", rows)
    res = run(engine, ds, tmp_path, output_format="openai-batch", any_model=True)    # body.model "x"
    df = results(res.output).sort("id")
    assert df["id"].to_list() == ["req-0", "req-1"]
    assert df["completion_tokens"].to_list()[0] <= 3 and df["completion_tokens"].to_list()[1] <= 4
    lines = [json.loads(x) for x in open(os.path.join(res.output, "results.openai.jsonl"))]
    assert sorted(x["custom_id"] for x in lines) == ["req-0", "req-1"]


def test_classify_prefills_prompt_once(engine, tmp_path):
    ds = write_jsonl(tmp_path / "q.jsonl", [{"id": "a", "text": "I loved this film."},
                                            {"id": "b", "text": "Worst film ever."}])
    res = run(engine, ds, tmp_path, kind="classify", labels=("positive", "negative", "neutral and calm"),
              template="Is this review positive or negative? {text}", prefix_cache=False)
    df = results(res.output).sort("id")
    probs = df["label_probs"].to_list()
    assert all(abs(sum(p["prob"] for p in row) - 1) < 1e-5 for row in probs)
    assert set(df["label"]) <= {"positive", "negative", "neutral and calm"}
    counters = res.stats["engine"]
    # every prompt token is computed once or served from the cache: never once per label
    assert counters["prompt_tokens_computed"] + df["cached_tokens"].sum() == df["prompt_tokens"].sum()


def test_kill_9_then_resume_every_id_once(tmp_path):
    """Killed after its first of many parts; the tiny random model: the kill and the resume are the point, not
    the model."""
    rows = [{"id": f"k{i:03d}", "prompt": f"Count from {i} to {i + 20}, separated by commas."} for i in range(24)]
    ds = write_jsonl(tmp_path / "k.jsonl", rows)
    out = str(tmp_path / "out")
    tiny = f"dummy:{os.path.join(os.path.dirname(__file__), '..', 'benchmarks', 'configs', 'tiny-llama.json')}"
    cmd = [sys.executable, "-m", "jobrunner.cli.main", "submit", ds, "-o", out, "-m", tiny, "--kv-cache-memory", "4MB",
           "--max-tokens", "32", "--ignore-eos", "--part-rows", "2", "--max-num-seqs", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while time.time() < deadline and not (os.path.isdir(out) and any(p.startswith("part-") for p in os.listdir(out))):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = len(results(out)) if os.path.isdir(out) else 0
    assert 0 < done_before < len(rows)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    ids = results(out)["id"].to_list()
    assert sorted(ids) == [r["id"] for r in rows]      # every id exactly once


def test_bad_configuration_exits_2_before_work(default_gguf_path, tmp_path):
    ds = write_jsonl(tmp_path / "q.jsonl", ROWS)
    cases = [
        [str(tmp_path / "missing.jsonl")],
        [ds, "--prompt-column", "nope"],
        [ds, "--template", "Q: {nope}"],
        [ds, "--model", "no-such-model"],
        [ds, "--kind", "classify"],
        [ds, "--template", "{prompt}", "--messages-column", "prompt"],
        [ds, "--kv-cache-memory", "lots"],
    ]
    for args in cases:
        r = subprocess.run([sys.executable, "-m", "jobrunner.cli.main", "submit", *args, "-o", str(tmp_path / "o")],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == EXIT_CONFIG, (args, r.stderr)
        assert "error:" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / "o" / "part-00000.parquet")


def test_same_job_twice_gives_identical_outputs_even_with_other_batching(engine, tmp_path):
    from jobrunner.pipeline.build import load_engine
    ds = write_jsonl(tmp_path / "q.jsonl", ROWS)
    other = load_engine(job_config("unused", max_batched_tokens=24, max_num_seqs=2))
    for params in (dict(), dict(temperature=0.9, top_p=0.95, seed=3)):
        runs = [results(run(eng, ds, output=str(tmp_path / f"o{i}-{len(params)}"), max_tokens=12, **params).output)
                .sort("id")["output"].to_list() for i, eng in enumerate((engine, engine, other))]
        assert runs[0] == runs[1] == runs[2], params


def test_duplicate_of_an_already_written_row_is_an_error_row_and_resume_skips_both(tmp_path, monkeypatch):
    """Small windows and a short engine queue, so r0's part is written before its duplicate is read
    (rows are read 1024 at a time: the duplicate comes in the second batch)."""
    from jobrunner.pipeline import build, plan
    from jobrunner.pipeline.build import load_engine
    tiny = f"dummy:{os.path.join(os.path.dirname(__file__), '..', 'benchmarks', 'configs', 'tiny-llama.json')}"
    engine = load_engine(job_config("unused", model=tiny, kv_cache_memory=4 * 10**6))
    for module in (plan, build):        # the planner's window (jobrunner/pipeline/plan.py), and dedup's
        monkeypatch.setattr(module, "WINDOW_ROWS", 50)
    rows = [{"id": f"r{i}", "prompt": f"row {i}"} for i in range(1100)] + [{"id": "r0", "prompt": "again"}]
    ds = write_jsonl(tmp_path / "dup.jsonl", rows)

    def go():
        cfg = job_config(ds, output=str(tmp_path / "out"), model=tiny, max_tokens=1, chat=False, part_rows=10)
        return open_job(cfg, engine=engine, max_in_flight=8).run()

    first = go()
    assert first.stats["rows"] == 1101 and first.stats["duplicate_ids"] == 1
    df = results(first.output)
    r0 = df.filter(pl.col("id") == "r0")
    assert r0.height == 2 and r0["error"].null_count() == 1 and "duplicate id" in r0["error"].drop_nulls()[0]
    again = go()
    assert again.stats["runs"][-1]["rows"] == 0 and again.stats["runs"][-1]["rows_skipped_done"] == 1101
    assert again.stats["rows"] == 1101
    assert results(again.output).height == 1101


def test_latency_percentiles_come_from_a_bounded_sample(monkeypatch):
    from jobrunner.common import run_stats as S
    monkeypatch.setattr(S, "LATENCY_SAMPLE", 1000)
    st = S.JobStats()
    n = 20_000
    for i in range(n):
        v = ((i * 7919) % n) / n                    # a fixed permutation of 0 .. 1
        st.add_row({"id": str(i), "error": None, "queue_s": v, "prefill_s": 2 * v, "decode_s": 3 * v})
    st.add_row({"id": "bad", "error": "x", "queue_s": 99.0})     # errors have no latencies
    assert st.latency_rows == n and len(st.queue) == len(st.prefill) == len(st.decode) == 1000
    assert all(p == 2 * q and d == 3 * q for q, p, d in zip(st.queue, st.prefill, st.decode))  # rows kept whole
    s = st.summary(device="cpu")
    assert abs(s["queue_s_p50"] - 0.5) < 0.05 and abs(s["queue_s_p99"] - 0.99) < 0.01
    assert abs(s["decode_s_p95"] - 3 * 0.95) < 0.05
    exact = S.JobStats()                            # under the sample size: exact percentiles
    for i in range(999):
        exact.add_row({"id": str(i), "error": None, "queue_s": float(i)})
    assert exact.summary(device="cpu")["queue_s_p50"] == 499.0


@pytest.mark.parametrize("planned", [True, False], ids=["plan", "no-plan"])
def test_windows_of_long_prompts_end_at_a_token_budget(tmp_path, monkeypatch, planned):
    """Long prompts fill a planning window by tokens before rows: the job reads, plans and runs
    several windows and still writes every row once, the same rows as with one window."""
    from jobrunner.pipeline import plan as job_plan
    from jobrunner.pipeline.build import load_engine
    from jobrunner.pipeline.plan import JobPlanner
    tiny = f"dummy:{os.path.join(os.path.dirname(__file__), '..', 'benchmarks', 'configs', 'tiny-llama.json')}"
    engine = load_engine(job_config("unused", model=tiny, kv_cache_memory=4 * 10**6))
    rows = [{"id": f"r{i}", "prompt": ("shared context " * 8 if i % 2 else "") + "word " * (5 + 7 * (i % 5))}
            for i in range(40)]
    ds = write_jsonl(tmp_path / "long.jsonl", rows)
    windows = []
    real_units = JobPlanner.units

    def counting_units(self, items):
        for unit in real_units(self, items):
            windows.append(unit.window_end)
            yield unit

    def go(name):
        # dedup off: the rows repeat every 10, and copies never reach a window
        job = open_job(job_config(ds, output=str(tmp_path / name), model=tiny, max_tokens=2, chat=False, plan=planned,
                            dedup=False), engine=engine)
        return results(job.run().output).sort("id")

    whole = go("whole")
    monkeypatch.setattr(JobPlanner, "units", counting_units)
    monkeypatch.setattr(job_plan, "WINDOW_TOKENS", 200)
    cut = go("cut")
    assert cut["id"].to_list() == sorted(r["id"] for r in rows)
    assert cut.select("id", "output", "prompt_tokens").equals(whole.select("id", "output", "prompt_tokens"))
    # a window closes at the row that brings it to 200 tokens: it holds 200 .. 199 + the longest prompt
    total, longest = sum(whole["prompt_tokens"]), max(whole["prompt_tokens"])
    assert total / (199 + longest) <= sum(windows) <= total / 200 + 1 and windows[-1]


