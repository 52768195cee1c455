"""Peak memory of a whole job against its row count (issue 10: bounded memory).

    python -m benchmarks.memory_scale --rows 100000 --rows 1000000

Each size runs `jobrunner submit` in a fresh process on a tiny random model (so the engine is cheap
and the job's own bookkeeping shows), short rows, one new token each (--max-tokens), and reports the
child's peak RSS (ru_maxrss), its RSS sampled at ten even points of the run (growth shows as a rising
series), and wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
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


def _rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def run(rows: int, workdir: str, max_tokens: int = 1) -> dict:
    ds = os.path.join(workdir, f"rows-{rows}.jsonl")
    make_dataset(ds, rows)
    out = os.path.join(workdir, f"out-{rows}")
    cmd = [sys.executable, "-m", "jobrunner.cli.main", "submit", ds, "-o", out, "-m", f"dummy:{CONFIG}",
           "--max-tokens", str(max_tokens), "--no-chat", "--part-rows", "50000", "--overwrite", "--kv-cache-memory", "16MB"]
    t0 = time.time()
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    samples = []
    while child.poll() is None:
        rss = _rss_mb(child.pid)
        if rss is not None:
            samples.append(rss)
        time.sleep(0.25)
    if child.returncode:
        raise subprocess.CalledProcessError(child.returncode, cmd)
    peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    stats = json.load(open(os.path.join(out, "_stats.json")))
    return {"rows": rows, "rows_written": stats["rows"], "peak_rss_mb": round(peak_kb / 1024, 1),
            "peak_grew_vs_previous_child": peak_kb > before, "wall_s": round(time.time() - t0, 1),
            "rss_mb_over_run": [round(samples[len(samples) * k // 10]) for k in range(10)] if samples else []}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, action="append", help="row counts, ascending (default 10k, 100k)")
    ap.add_argument("--max-tokens", type=int, default=1, help="new tokens a row (default 1)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        for n in a.rows or [10_000, 100_000]:
            print(json.dumps(run(n, d, a.max_tokens)), flush=True)


if __name__ == "__main__":
    main()
