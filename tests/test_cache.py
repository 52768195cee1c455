"""Issue 19: identical rows computed once (dedup) and a result cache across runs, end to end on a
tiny dummy model in this process: engine counters show what was computed; outputs equal a cold run's."""
import json
import logging
import os

import pytest

from jobrunner.pipeline.exit_codes import EXIT_OK
from tests.cache_helpers import MAX_TOKENS, outputs, prompts, run_job, tiny_model, write_jsonl


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from jobrunner.pipeline.build import load_engine
    from jobrunner.config.job import job_config
    model = tiny_model(tmp_path_factory.mktemp("cache-model"))
    return load_engine(job_config("unused", model=model, device="cpu"))


def _values(out: dict, ids) -> list:
    return [out[i][:4] for i in ids]


def test_copies_under_different_ids_are_generated_once(engine, tmp_path):
    """12 prompts x 4 copies: the engine generates for 12 rows; --no-dedup: 48; every copy's output equals its original."""
    rows = [{"id": f"c{copy}-{i}", "prompt": p} for copy in range(4) for i, p in enumerate(prompts(12))]
    ds = write_jsonl(tmp_path / "d.jsonl", rows)
    res = run_job(engine, ds, str(tmp_path / "dedup"))
    assert res.exit_code == EXIT_OK
    assert res.stats["engine"]["generated_tokens"] == 12 * MAX_TOKENS
    assert res.stats["rows_reused"] == 36 and res.stats["rows_from_cache"] == 0
    got = outputs(res.output)
    assert sum(v[4] for v in got.values()) == 36
    for i in range(12):
        assert len({got[f"c{copy}-{i}"][:4] for copy in range(4)}) == 1
    plain = run_job(engine, ds, str(tmp_path / "plain"), dedup=False)
    assert plain.stats["engine"]["generated_tokens"] == 48 * MAX_TOKENS and plain.stats["rows_reused"] == 0
    ref = outputs(plain.output)
    assert _values(got, sorted(ref)) == _values(ref, sorted(ref))
    assert not any(v[4] for v in ref.values())
    assert len({v[0] for v in ref.values()}) > 1           # the prompts matter to the outputs


def test_rerun_over_a_grown_dataset_computes_only_the_new_rows(engine, tmp_path):
    """Yesterday's 30 rows, then 30 + 10 new with --cache: 10 rows computed, each output a cold run's."""
    cache = str(tmp_path / "cache")
    today = [{"id": f"r{i}", "prompt": p} for i, p in enumerate(prompts(40))]
    yesterday = write_jsonl(tmp_path / "yesterday.jsonl", today[:30])
    grown = write_jsonl(tmp_path / "today.jsonl", today)
    cold = outputs(run_job(engine, grown, str(tmp_path / "cold")).output)
    first = run_job(engine, yesterday, str(tmp_path / "y"), cache=cache)
    assert first.stats["rows_from_cache"] == 0
    res = run_job(engine, grown, str(tmp_path / "t"), cache=cache, device_hourly_cost=3.0)
    assert res.exit_code == EXIT_OK
    assert res.stats["engine"]["generated_tokens"] == 10 * MAX_TOKENS
    assert res.stats["rows_from_cache"] == 30
    got = outputs(res.output)
    assert _values(got, sorted(cold)) == _values(cold, sorted(cold))
    assert sorted(i for i, v in got.items() if v[4]) == sorted(f"r{i}" for i in range(30))
    # a cached row keeps its original token counts; the saving is accounted
    saved = sum(got[f"r{i}"][1] + got[f"r{i}"][2] for i in range(30))
    s = json.loads((tmp_path / "t" / "_stats.json").read_text())
    assert s["tokens_saved"] == saved and s["rows_from_cache"] == 30 and s["rows_reused"] == 0
    assert s["cost_saved_usd"] > 0
    from jobrunner.cli.summary_text import summary_lines
    assert any(line.startswith("reused") and "30 rows from the cache" in line for line in summary_lines(s, "x"))


def test_what_does_not_matter_is_served_and_what_matters_is_not(engine, tmp_path):
    """Other ids, another dataset path, another column order: all from the cache. Another
    temperature with a seed, another seed, --cache-mode refresh or write-only: nothing."""
    cache = str(tmp_path / "cache")
    ps = prompts(8)
    first = write_jsonl(tmp_path / "a.jsonl", [{"id": f"a{i}", "prompt": p, "x": i} for i, p in enumerate(ps)])
    run_job(engine, first, str(tmp_path / "o1"), cache=cache)
    (tmp_path / "elsewhere").mkdir()
    moved = write_jsonl(tmp_path / "elsewhere" / "b.jsonl",
                        [{"x": -i, "prompt": p, "id": f"other-{i}"} for i, p in enumerate(ps)])
    res = run_job(engine, moved, str(tmp_path / "o2"), cache=cache)
    assert res.stats["rows_from_cache"] == 8 and res.stats["engine"]["generated_tokens"] == 0
    for kw in ({"temperature": 0.7, "seed": 1}, {"max_tokens": MAX_TOKENS + 1}, {"cache_mode": "refresh"},
               {"cache_mode": "write-only"}, {"system": "Be brief."}):
        res = run_job(engine, moved, str(tmp_path / f"o-{len(os.listdir(tmp_path))}"), cache=cache, **kw)
        assert res.stats["rows_from_cache"] == 0, kw
    res = run_job(engine, moved, str(tmp_path / "seeded"), cache=cache, temperature=0.7, seed=2)
    assert res.stats["rows_from_cache"] == 0        # another seed
    res = run_job(engine, moved, str(tmp_path / "seeded-again"), cache=cache, temperature=0.7, seed=1)
    assert res.stats["rows_from_cache"] == 8        # the same seed: deterministic, served


def test_rows_sampled_without_a_seed_are_never_reused(engine, tmp_path):
    cache = str(tmp_path / "cache")
    ds = write_jsonl(tmp_path / "d.jsonl", [{"id": f"s{c}-{i}", "prompt": p}
                                            for c in range(2) for i, p in enumerate(prompts(4))])
    for name in ("one", "two"):
        res = run_job(engine, ds, str(tmp_path / name), cache=cache, temperature=0.9)
        assert res.stats["rows_reused"] == res.stats["rows_from_cache"] == 0
        assert res.stats["engine"]["generated_tokens"] == 8 * MAX_TOKENS
    assert not (tmp_path / "cache").exists() or not any(f for _, _, f in os.walk(tmp_path / "cache"))


def test_classify_labels_are_part_of_the_key(engine, tmp_path):
    cache = str(tmp_path / "cache")
    ds = write_jsonl(tmp_path / "d.jsonl", [{"id": f"k{i}", "prompt": p} for i, p in enumerate(prompts(5))])
    run_job(engine, ds, str(tmp_path / "a"), cache=cache, kind="classify", labels=("yes", "no"))
    res = run_job(engine, ds, str(tmp_path / "b"), cache=cache, kind="classify", labels=("yes", "no"))
    assert res.stats["rows_from_cache"] == 5
    assert outputs(res.output) == {k: v[:4] + (True,) for k, v in outputs(str(tmp_path / "a")).items()}
    res = run_job(engine, ds, str(tmp_path / "c"), cache=cache, kind="classify", labels=("yes", "maybe"))
    assert res.stats["rows_from_cache"] == 0


def test_damaged_truncated_and_foreign_shards_are_skipped_and_recomputed(engine, tmp_path, caplog):
    from jobrunner.cache.shards import LAYOUT
    cache = tmp_path / "cache"
    ds = write_jsonl(tmp_path / "d.jsonl", [{"id": f"d{i}", "prompt": p} for i, p in enumerate(prompts(24))])
    cold = outputs(run_job(engine, ds, str(tmp_path / "cold"), cache=str(cache)).output)
    shards = sorted(p for p in (cache / LAYOUT).rglob("*.parquet"))
    assert len(shards) >= 6     # 24 entries over 64 buckets
    shards[0].write_bytes(shards[0].read_bytes()[:-40])                         # an index truncated
    values = shards[1].with_suffix(".values")
    data = bytearray(values.read_bytes())
    data[len(data) // 3: len(data) // 3 + 8] = os.urandom(8)                    # values damaged inside
    values.write_bytes(bytes(data))
    shards[2].write_bytes(b"not parquet at all")                                # garbage under a shard's name
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"key": [b"x" * 16], "value": [b"{}"]}), shards[3])  # a foreign Parquet file
    values = shards[4].with_suffix(".values")
    values.write_bytes(values.read_bytes()[:-5])                                # values truncated
    (shards[5].parent / "notes.txt").write_text("garbage beside the shards")
    with caplog.at_level(logging.WARNING, logger="jobrunner"):
        res = run_job(engine, ds, str(tmp_path / "warm"), cache=str(cache))
    assert res.exit_code == EXIT_OK
    got = outputs(res.output)
    assert _values(got, sorted(cold)) == _values(cold, sorted(cold))
    assert 24 - 5 * 4 <= res.stats["rows_from_cache"] <= 24 - 5      # 5 damaged shards, each 1-4 entries
    assert "not a cache shard" in caplog.text and "failed their check" in caplog.text


def test_a_cache_of_another_numeric_path_is_not_used(engine, tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    ds = write_jsonl(tmp_path / "d.jsonl", [{"id": f"n{i}", "prompt": p} for i, p in enumerate(prompts(4))])
    run_job(engine, ds, str(tmp_path / "a"), cache=cache)
    import jobrunner.engine as engine_pkg      # the public name the cache key reads
    monkeypatch.setattr(engine_pkg, "NUMERICS_VERSION", engine_pkg.NUMERICS_VERSION + 1)
    assert run_job(engine, ds, str(tmp_path / "b"), cache=cache).stats["rows_from_cache"] == 0


def test_cache_url_from_toml_and_environment(tmp_path, monkeypatch):
    from jobrunner.api.submit import build_config
    from jobrunner.config.job import JobConfigError
    from jobrunner.pipeline.resolve import cache_url
    toml = tmp_path / "job.toml"
    toml.write_text('cache = "/tmp/c1"\ncache_mode = "read-only"\ndedup = false\n')
    monkeypatch.setenv("JOBRUNNER_CACHE_URL", "/tmp/env-cache")
    assert cache_url(build_config("d.jsonl", {})) == "/tmp/env-cache"      # found by resolve, beside the config
    cfg = build_config("d.jsonl", {}, str(toml))
    assert (cfg.reuse.cache, cfg.reuse.cache_mode, cfg.reuse.dedup) == ("/tmp/c1", "read-only", False)
    assert cache_url(build_config("d.jsonl", {"cache": "/tmp/c2"}, str(toml))) == "/tmp/c2"
    with pytest.raises(JobConfigError, match="--cache-mode must be"):
        build_config("d.jsonl", {"cache_mode": "sometimes"})
    assert "cache" not in build_config("d.jsonl", {}).fingerprint_fields()


def test_an_unopenable_cache_url_exits_2_before_any_work(tmp_path):
    from click.testing import CliRunner

    from jobrunner.cli.main import main
    ds = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt": "hi"}])
    r = CliRunner().invoke(main, ["submit", ds, "-m", "dummy:smollm2-135m", "--cache", "nosuchproto://x/y"])
    assert r.exit_code == 2 and "--cache" in r.output
    assert not (tmp_path / "d.jsonl.results").exists()


def test_two_data_parallel_workers_share_one_cache(engine, tmp_path):
    """Workers serve cached rows and copies of the units they claim, and each stores what it computed:
    every row once, outputs as one worker's without a cache, and no entry lost."""
    from jobrunner.config.job import job_config
    from jobrunner.parallel import run_parallel
    cache = str(tmp_path / "cache")
    rows = [{"id": f"p{i}", "prompt": p} for i, p in enumerate(prompts(20))]
    rows += [{"id": f"copy{i}", "prompt": p} for i, p in enumerate(prompts(4))]
    old = write_jsonl(tmp_path / "old.jsonl", rows[:10])
    ds = write_jsonl(tmp_path / "d.jsonl", rows)
    run_job(engine, old, str(tmp_path / "old"), cache=cache)
    cold = outputs(run_job(engine, ds, str(tmp_path / "cold")).output)
    cfg = job_config(ds, output=str(tmp_path / "dp"), model=engine.config.model, max_tokens=MAX_TOKENS,
                    ignore_eos=True, device="cpu", cache=cache, data_parallel=2, max_num_seqs=2)
    res = run_parallel(cfg)
    assert res.exit_code == EXIT_OK
    got = outputs(res.output)
    assert _values(got, sorted(cold)) == _values(cold, sorted(cold))
    assert res.stats["rows_from_cache"] == 10 and res.stats["rows_reused"] == 4
    assert res.stats["engine"]["generated_tokens"] == 10 * MAX_TOKENS
    again = run_job(engine, ds, str(tmp_path / "again"), cache=cache)
    assert again.stats["rows_from_cache"] == 20 and again.stats["engine"]["generated_tokens"] == 0


def test_long_prompts_end_a_lookup_batch_before_its_row_count(engine, tmp_path, monkeypatch):
    """Rows held for one batch lookup are unpacked token lists: their tokens bound the batch too, and
    every row is still served (from the cache on the second run)."""
    import jobrunner.pipeline.intake as J
    from jobrunner.cache.reuse import Reuse
    rows = [{"id": f"t{i}", "prompt": p} for i, p in enumerate(prompts(12))]
    ds = write_jsonl(tmp_path / "d.jsonl", rows)
    cache = str(tmp_path / "cache")
    assert run_job(engine, ds, str(tmp_path / "cold"), cache=cache).exit_code == EXIT_OK
    batches = []
    real_fetch = Reuse.fetch
    monkeypatch.setattr(Reuse, "fetch", lambda self, ids: batches.append(len(ids)) or real_fetch(self, ids))
    monkeypatch.setattr(J, "HELD_TOKENS", 40)
    warm = run_job(engine, ds, str(tmp_path / "warm"), cache=cache)
    assert len(batches) > 1 and sum(batches) == 12
    assert warm.stats["rows_from_cache"] == 12
    assert _values(outputs(warm.output), sorted(r["id"] for r in rows)) == \
        _values(outputs(str(tmp_path / "cold")), sorted(r["id"] for r in rows))
