"""The result cache (issue 19): a job whose rows are mostly cached against the same job cold, and
lookups against a cache of a million entries.

    python -m benchmarks.cache_bench --rows 100000 --cached 0.9 --max-tokens 8
    python -m benchmarks.cache_bench --store-sizes 100000 --store-sizes 1000000 --skip-job

The job part runs `jobrunner submit` (what users run) in fresh processes on a tiny random Llama
(benchmarks/configs/tiny-llama.json, dummy weights: the engine is cheap, so the job's own work
shows and the ratio is a conservative one; with a real model the cold run costs far more while a
cached row costs the same): cold over `rows` rows, storing every result (--cache-mode write-only);
then a job of as many rows, the first `cached` share of them yesterday's and the rest new, with
--cache. It reports both runs' wall time (the run's own,
from _stats.json, so interpreter and model start-up are left out; the processes' walls too), their
ratio, and the lookup cost per row (cache_lookup_s / cache_lookups in _stats.json: batch lookup
and decoding of the hits).

The store part fills a cache with N synthetic entries (values the size of a short generate
result), then in a fresh process looks up 100k keys (90% present) in batches of the job's
LOOKUP_ROWS and reports microseconds a key and the process's peak RSS over its RSS before the
first lookup: bounded by the store's index budget, not by N.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = Path(__file__).resolve().parent / "configs" / "tiny-llama.json"
VALUE = json.dumps({"completions": [{"index": 0, "token_ids": list(range(100, 108)), "text": "x" * 40,
                                     "finish_reason": "length", "logprobs": None}],
                    "prompt_tokens": 20, "cached_tokens": 0, "completion_tokens": 8, "queue_s": 0.01,
                    "prefill_s": 0.02, "decode_s": 0.03, "error": None, "prompt_logprobs": None,
                    "candidate_logprobs": None}).encode()


def make_dataset(path: Path, rows: range) -> None:
    words = "alpha beta gamma delta river stone cloud paper".split()
    with open(path, "w") as f:
        for i in rows:
            f.write(json.dumps({"id": f"r{i}", "prompt": f"{words[i % 8]} {words[(i // 8) % 8]} row {i}"}) + "\n")


def _submit(dataset: Path, out: Path, max_tokens: int, cache: Path | None, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "jobrunner.cli.main", "submit", str(dataset), "-o", str(out), "-m", f"dummy:{CONFIG}",
           "--device", "cpu", "--max-tokens", str(max_tokens), "--ignore-eos", "--part-rows", "50000",
           "--overwrite", "--kv-cache-memory", "64MB"]
    if cache is not None:
        cmd += ["--cache", str(cache), *extra]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    s = json.loads((out / "_stats.json").read_text())
    s["process_wall_s"] = time.perf_counter() - start
    return s


def job_bench(rows: int, cached: float, max_tokens: int, work: Path) -> dict:
    """Cold: `rows` rows, storing every result (--cache-mode write-only: the cold run fills the
    cache, so the fill costs no third run). Warm: the first `cached` share of those rows plus new ones."""
    yesterday, today = work / "yesterday.jsonl", work / "today.jsonl"
    old = int(rows * cached)
    make_dataset(yesterday, range(rows))
    with open(today, "w") as f:         # the first `old` rows of yesterday, then new ones
        f.writelines(list(open(yesterday))[:old])
    with open(today, "a") as f, tempfile.NamedTemporaryFile("r+") as new:
        make_dataset(Path(new.name), range(rows, 2 * rows - old))
        f.write(new.read())
    cache = work / "cache"
    cold = _submit(yesterday, work / "cold", max_tokens, cache, "--cache-mode", "write-only")
    warm = _submit(today, work / "warm", max_tokens, cache)
    return {"rows": rows, "cached_share": cached, "max_tokens": max_tokens,
            "cold_wall_s": cold["wall_s"], "warm_wall_s": warm["wall_s"], "wall_ratio": warm["wall_s"] / cold["wall_s"],
            "cold_process_wall_s": cold["process_wall_s"], "warm_process_wall_s": warm["process_wall_s"],
            "rows_from_cache": warm["rows_from_cache"],
            "warm_generated_tokens": warm["engine"]["generated_tokens"],
            "lookup_us_per_row": 1e6 * warm["cache_lookup_s"] / max(warm["cache_lookups"], 1),
            "lookup_cpu_us_per_row": 1e6 * warm.get("cache_lookup_cpu_s", 0) / max(warm["cache_lookups"], 1)}


def fill_store(url: str, n: int) -> None:
    from jobrunner.cache.store import CacheStore
    store = CacheStore(url, flush_entries=100_000)
    for i in range(n):
        store.put(_key(i), VALUE)
    store.flush()


def _key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


LOOKUP_CHILD = """
import resource, sys, time
from benchmarks.cache_bench import _key, _rss_mb
from jobrunner.cache.store import CacheStore
from jobrunner.cache.reuse import LOOKUP_ROWS
url, size, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
keys = [_key(size + i if i % 10 == 9 else i) for i in range(n)]      # 1 in 10 absent
store = CacheStore(url)
before = _rss_mb()
start, cpu, hits = time.perf_counter(), time.process_time(), 0
for at in range(0, n, LOOKUP_ROWS):
    hits += len(store.get_many(keys[at:at + LOOKUP_ROWS]))
wall, cpu = time.perf_counter() - start, time.process_time() - cpu
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(f'{{"lookups": {n}, "hits": {hits}, "us_per_lookup": {1e6 * wall / n}, "cpu_us_per_lookup": {1e6 * cpu / n}, "rss_before_mb": {before}, "peak_rss_mb": {peak}}}')
"""


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def store_bench(size: int, lookups: int, work: Path) -> dict:
    url = str(work / f"store-{size}")
    start = time.perf_counter()
    fill_store(url, size)
    fill_s = time.perf_counter() - start
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", LOOKUP_CHILD, url, str(size), str(lookups)], env=env, check=True,
                         capture_output=True, text=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    return {"cached_entries": size, "fill_s": fill_s, **r}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--cached", type=float, default=0.9)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--store-sizes", type=int, action="append", help="synthetic cache sizes (default 1M)")
    p.add_argument("--lookups", type=int, default=100_000)
    p.add_argument("--skip-job", action="store_true")
    p.add_argument("--workdir", help="keep datasets, outputs and caches here (default: a temporary directory)")
    a = p.parse_args(argv)
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(a.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        result = {"load_average_at_start": load, "cpus": os.cpu_count()}
        if not a.skip_job:
            result["job"] = job_bench(a.rows, a.cached, a.max_tokens, work)
            print(json.dumps(result["job"], indent=1), flush=True)
        result["store"] = []
        for size in a.store_sizes or [1_000_000]:
            result["store"].append(store_bench(size, a.lookups, work))
            print(json.dumps(result["store"][-1], indent=1), flush=True)
        result["load_average_at_end"] = os.getloadavg()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
