"""--deterministic (issue 61, CPU): one small dataset (generate with logprobs, seeded sampling, classify, score,
embed; a shared prefix and a long row) run as jobs under many schedules gives bit-identical results; the
default mode differs somewhere; greedy output still matches transformers; the mode is recorded (manifest,
_stats.json), keyed (result cache) and fingerprinted (resume). Op by op: tests/test_determinism_kernels.py."""
from __future__ import annotations

import json

import math

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import jobrunner
from jobrunner.cache.key import job_model_key
from jobrunner.config.job import job_config
from jobrunner.engine import NUMERICS_VERSION
from jobrunner.engine.api.request import Request, SamplingParams
from jobrunner.engine.config.engine_config import ConfigError
from jobrunner.output import read_results
from jobrunner.report.compare import compare
from jobrunner.report.compare_page import lines
from tests.tiny import engine_for, hf_greedy, hf_model, prompts

PREFIX = "You are a careful assistant. Answer the question about the quick brown fox and the lazy dog. " * 2
LONG = "The quick brown fox jumps over the lazy dog. " * 14         # ~330 tokens: two attention splits
ROWS = ([{"id": f"q{i}", "prompt": PREFIX + f"Question {i}: what does the fox do on day {i}?",
          "answer": f" The fox rests on day {i}."} for i in range(10)]
        + [{"id": "long", "prompt": LONG, "answer": " It jumps."}, {"id": "short", "prompt": "Hi", "answer": " Hello"}])
SCHEDULES = {
    "defaults": {},
    "seqs-1": {"max_num_seqs": 1},
    "seqs-5": {"max_num_seqs": 5},
    "seqs-256": {"max_num_seqs": 256},
    "chunked": {"max_batched_tokens": 24},          # every prompt but "short" in several chunks
    "no-prefix-cache": {"prefix_cache": False},
    "threads-1": {"threads": 1},
    "threads-2": {"threads": 2},
    "speculative": {"speculative": "ngram"},        # drafted positions verified in one chunk, not decoded one by one
}
KINDS = {
    "generate": dict(max_tokens=16, logprobs=True, top_logprobs=2, ignore_eos=True),
    "sampled": dict(max_tokens=12, temperature=0.9, top_p=0.95, seed=11, logprobs=True, ignore_eos=True),
    "classify": dict(kind="classify", labels="yes,no,maybe so"),
    "score": dict(kind="score", score_column="answer"),
    "embed": dict(kind="embed", pooling="mean"),
}
# what says how a row was run, not what it got
SCHEDULE_COLUMNS = {"queue_s", "prefill_s", "decode_s", "cached_tokens", "reused", "draft_tokens", "accepted_tokens"}


@pytest.fixture(scope="module")
def model(tiny_hf_model_dir):
    return str(tiny_hf_model_dir("llama", max_position_embeddings=1024))


def run(model, kind, schedule, deterministic=True) -> pl.DataFrame:
    df = jobrunner.generate(ROWS, model=model, device="cpu", kv_cache_memory="32MB", deterministic=deterministic,
                            **KINDS[kind], **SCHEDULES[schedule])
    assert df["error"].null_count() == len(ROWS), df["error"].to_list()
    return df.sort("id").drop([c for c in df.columns if c in SCHEDULE_COLUMNS])


def rows_of(df: pl.DataFrame) -> list:
    """Every value, floats as Python floats (compared exactly, bit for bit: a float's repr round-trips)."""
    return json.loads(json.dumps(df.to_dicts()))


@pytest.mark.parametrize("kind", list(KINDS))
def test_invariant_results_are_the_same_bits_under_every_schedule(model, kind):
    want = rows_of(run(model, kind, "defaults"))
    schedules = (list(SCHEDULES)[1:] if kind in ("generate", "classify")
                 else ["seqs-1", "chunked", "threads-1", "speculative"])
    for schedule in schedules:
        assert rows_of(run(model, kind, schedule)) == want, schedule


def test_two_data_parallel_workers_and_a_resume_give_the_same_bits(model, tmp_path):
    """Outputs written by jobrunner.submit: one process; two worker processes sharing the rows; five rows,
    then the rest in a resumed run (other batches, another process's engine)."""
    ds = tmp_path / "rows.jsonl"
    ds.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    common = dict(model=model, device="cpu", kv_cache_memory="32MB", deterministic=True, **KINDS["generate"])

    def rows(out, **kw):
        for extra in ([dict(limit=5)] if kw.pop("resume", False) else []) + [{}]:
            assert jobrunner.submit(str(ds), str(out), **common, **kw, **extra).exit_code == 0
        df = pl.DataFrame(read_results(str(out)).to_pylist())
        return rows_of(df.sort("id").drop([c for c in df.columns if c in SCHEDULE_COLUMNS]))
    want = rows(tmp_path / "one")
    assert rows(tmp_path / "two", data_parallel=2) == want
    assert rows(tmp_path / "resumed", resume=True) == want


def test_the_default_mode_differs_somewhere(model):
    """So the test above can fail: without --deterministic, chunked prefill (merged by logsumexp over the
    cached context) and other batches give other last bits of some logprob."""
    def logprobs(schedule):
        df = run(model, "generate", schedule, deterministic=False)
        return [t["logprob"] for row in df["logprobs"].to_list() for t in row]
    base = logprobs("defaults")
    others = [logprobs(s) for s in ("chunked", "seqs-1")]
    assert any(o != base for o in others)
    assert all(max(abs(a - b) for a, b in zip(base, o)) < 1e-3 for o in others)     # rounding, not a bug


@pytest.mark.parametrize("arch", ["llama", "qwen3", "smollm2"])
def test_greedy_output_still_matches_transformers(arch):
    hf = hf_model(arch)
    batch = prompts(1)
    p = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=0)
    refs = [hf_greedy(hf, ids, 24) for ids in batch]
    for invariant in (True, False):
        engine = engine_for(hf, batch_invariant=invariant, max_num_batched_tokens=32)
        assert engine.info.batch_invariant is invariant
        outs = engine.generate([Request(str(i), ids, p) for i, ids in enumerate(batch)])
        for out, (tokens, lps) in zip(outs, refs):
            assert out.token_ids == tokens
            assert max(abs(a.logprob - b) for a, b in zip(out.completions[0].logprobs, lps)) < 1e-4


@pytest.mark.parametrize("overrides,named", [
    (dict(quantization="int8"), "--quantization int8"),
    (dict(packed_weights=False), "--no-packed-weights"),
    (dict(kv_cache_dtype="int8"), "KV cache"),
])
def test_what_the_mode_does_not_cover_is_refused(overrides, named):
    with pytest.raises(ConfigError, match=f"--deterministic .*{named}"):
        engine_for(hf_model("llama"), batch_invariant=True, **overrides)


def test_the_mode_is_recorded_keyed_and_fingerprinted(model, tmp_path):
    ds = tmp_path / "rows.jsonl"
    ds.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:3]))
    out = tmp_path / "out"
    res = jobrunner.submit(str(ds), str(out), model=model, device="cpu", kv_cache_memory="32MB", max_tokens=4,
                           deterministic=True)
    manifest = json.loads((out / "_manifest.json").read_text())
    stats = json.loads((out / "_stats.json").read_text())
    assert manifest["batch_invariant"] is True and manifest["numerics_version"] == NUMERICS_VERSION
    assert manifest["config"]["deterministic"] is True
    assert stats["batch_invariant"] is True and stats["numerics_version"] == NUMERICS_VERSION
    assert res.exit_code == 0
    with pytest.raises(jobrunner.JobConfigError, match="deterministic"):     # resume refuses the other mode
        jobrunner.submit(str(ds), str(out), model=model, device="cpu", kv_cache_memory="32MB", max_tokens=4)
    assert "deterministic" not in job_config("x.jsonl").fingerprint_fields()    # outputs begun before still resume
    engine = engine_for(hf_model("llama"), batch_invariant=True)
    info = engine.info
    keys = {job_model_key(model, info, "none", "auto"),
            job_model_key(model, type(info)(**{**info.__dict__, "batch_invariant": False}), "none", "auto")}
    assert len(keys) == 2


def test_compare_reports_a_changed_bit_between_invariant_outputs_as_a_determinism_failure(model, tmp_path):
    ds = tmp_path / "rows.jsonl"
    ds.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:6]))
    common = dict(model=model, device="cpu", kv_cache_memory="32MB", **KINDS["generate"])
    for name, kw in (("a", dict(deterministic=True)), ("b", dict(deterministic=True, max_num_seqs=1)),
                     ("plain", {})):
        assert jobrunner.submit(str(ds), str(tmp_path / name), **common, **kw).exit_code == 0
    same = compare(str(tmp_path / "a"), str(tmp_path / "b"))
    assert same["determinism"] == {"rows": 0, "ids": []} and same["exit_code"] == 0
    assert {"gate": "determinism", "limit": 0, "value": 0, "crossed": False} in same["gates"]
    assert "determinism" not in compare(str(tmp_path / "a"), str(tmp_path / "plain"))   # no promise to check
    [part] = (tmp_path / "b").glob("part-*.parquet")
    table = pq.read_table(part)
    rows = table.to_pylist()
    rows[2]["logprobs"][0]["logprob"] = math.nextafter(rows[2]["logprobs"][0]["logprob"], 0.0)    # one bit
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), part)
    failed = compare(str(tmp_path / "a"), str(tmp_path / "b"))
    assert failed["determinism"] == {"rows": 1, "ids": [rows[2]["id"]]} and failed["exit_code"] == 3
    assert failed["changed"]["rows"] == 0        # the texts agree: not a change, a failure of the promise
    assert any(line.startswith("determinism 1 unchanged rows differ") for line in lines(failed))
