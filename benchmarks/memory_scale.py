"""Peak memory of a whole job against its row count (issue 10: bounded memory; issue 58 item 18).

    python -m benchmarks.memory_scale --rows 100000 --rows 1000000
    python -m benchmarks.memory_scale --default-model --rows 2000 --rows 8000 --rows 32000

Each size runs `jobrunner submit` in a fresh process and reports the child's own peak RSS (ru_maxrss
from wait4), its RSS sampled at ten even points of the run (growth shows as a rising series), and
wall time. The tiny random model (default) makes the engine cheap, so the job's own bookkeeping shows:
short rows, one new token each (--max-tokens). `--default-model` runs the nightly classification job
of issue 58 on the default model instead: distinct short reviews, `--template "Review: {text}\nSentiment:"
--kind classify --labels positive,negative,neutral`, the default KV cache. Its RSS first climbs while
the KV pool (CPU_KV_CACHE_BYTES, calloc'ed) is touched block by block, about the first 1,500 rows of
these reviews; that is bounded by the pool, so compare the peaks of sizes past it.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

CONFIG = os.path.join(os.path.dirname(__file__), "configs", "tiny-llama.json")


def make_dataset(path: str, rows: int) -> None:
    words = "alpha beta gamma delta river stone cloud paper".split()
    with open(path, "w") as f:
        for i in range(rows):
            f.write(json.dumps({"id": f"r{i}", "prompt": f"{words[i % 8]} {words[(i // 8) % 8]} row {i}"}) + "\n")


def make_reviews(path: str, rows: int) -> None:
    """Distinct short product reviews (about 28 tokens each), the same for every size's first rows."""
    rng = random.Random(0)
    adjectives = "great terrible fine awful lovely bland superb poor decent amazing mediocre solid flimsy sturdy".split()
    things = "battery screen strap lid handle zipper motor lens cable charger speaker keyboard blender kettle".split()
    verbs = "broke worked arrived failed lasted cracked rattled stalled impressed disappointed surprised".split()
    with open(path, "w") as f:
        for i in range(rows):
            text = (f"The {rng.choice(things)} was {rng.choice(adjectives)} and it {rng.choice(verbs)} after "
                    f"{rng.randint(1, 400)} days; {rng.choice(adjectives)} {rng.choice(things)}, order {i}.")
            f.write(json.dumps({"id": i, "text": text}) + "\n")


def _rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def measure(cmd: list[str], out: str) -> dict:
    """Runs cmd in a child; its own peak RSS (wait4's ru_maxrss), RSS at ten even points, wall, rows written."""
    t0 = time.time()
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    samples = []
    while True:
        pid, status, usage = os.wait4(child.pid, os.WNOHANG)
        if pid:
            break
        rss = _rss_mb(child.pid)
        if rss is not None:
            samples.append(rss)
        time.sleep(0.25)
    code = os.waitstatus_to_exitcode(status)
    if code:
        raise subprocess.CalledProcessError(code, cmd)
    with open(os.path.join(out, "_stats.json")) as f:
        stats = json.load(f)
    return {"rows_written": stats["rows"], "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
            "wall_s": round(time.time() - t0, 1),
            "rss_mb_over_run": [round(samples[len(samples) * k // 10]) for k in range(10)] if samples else []}


def run(rows: int, workdir: str, max_tokens: int = 1) -> dict:
    """The tiny random model's job: its own bookkeeping, the engine cheap."""
    ds = os.path.join(workdir, f"rows-{rows}.jsonl")
    make_dataset(ds, rows)
    out = os.path.join(workdir, f"out-{rows}")
    cmd = [sys.executable, "-m", "jobrunner.cli.main", "submit", ds, "-o", out, "-m", f"dummy:{CONFIG}",
           "--max-tokens", str(max_tokens), "--no-chat", "--part-rows", "50000", "--overwrite", "--kv-cache-memory", "16MB"]
    return {"rows": rows, **measure(cmd, out)}


def run_default_model(rows: int, workdir: str) -> dict:
    """Issue 58's nightly classification job on the default model, one process."""
    ds = os.path.join(workdir, f"reviews-{rows}.jsonl")
    make_reviews(ds, rows)
    out = os.path.join(workdir, f"reviews-out-{rows}")
    cmd = [sys.executable, "-m", "jobrunner.cli.main", "submit", ds, "-o", out, "--overwrite",
           "--template", "Review: {text}\nSentiment:", "--kind", "classify", "--labels", "positive,negative,neutral"]
    return {"rows": rows, "model": "default", **measure(cmd, out)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, action="append", help="row counts, ascending (default 10k, 100k)")
    ap.add_argument("--max-tokens", type=int, default=1, help="new tokens a row (default 1; tiny model)")
    ap.add_argument("--default-model", action="store_true",
                    help="the default model's classification job (default rows 2k, 8k, 32k)")
    a = ap.parse_args()
    peaks = {}
    with tempfile.TemporaryDirectory() as d:
        for n in a.rows or ([2_000, 8_000, 32_000] if a.default_model else [10_000, 100_000]):
            result = run_default_model(n, d) if a.default_model else run(n, d, a.max_tokens)
            peaks[n] = result["peak_rss_mb"]
            print(json.dumps(result), flush=True)
    first = min(peaks)
    print(json.dumps({"peak_rss_mb": peaks,
                      "growth_vs_smallest": {n: f"{(p / peaks[first] - 1) * 100:+.1f}%" for n, p in peaks.items()}}))


if __name__ == "__main__":
    main()
