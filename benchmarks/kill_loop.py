"""Crash safety (issue 10): kill -9 a job at random moments, resume, repeat; then check every row
is in the output exactly once and no damaged part is left visible.

    python -m benchmarks.kill_loop --kills 20 --rows 40000

Kills land during model load, planning, generation, part writes and manifest updates alike
(random delays; tiny parts so writes are frequent). Uses a tiny random model so a run is cheap.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

from benchmarks.memory_scale import CONFIG, make_dataset


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--rows", type=int, default=40000)
    ap.add_argument("--max-delay", type=float, default=6.0, help="seconds after start, at most, before a kill")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    with tempfile.TemporaryDirectory() as d:
        ds, out = os.path.join(d, "rows.jsonl"), os.path.join(d, "out")
        make_dataset(ds, a.rows)
        cmd = [sys.executable, "-m", "jobrunner.cli.main", "submit", ds, "-o", out, "-m", f"dummy:{CONFIG}",
               "--max-tokens", "8", "--ignore-eos", "--no-chat", "--part-rows", "25", "--max-num-seqs", "16",
               "--kv-cache-memory", "16MB"]
        kills = 0
        while kills < a.kills:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(rng.uniform(0.05, a.max_delay))
            if proc.poll() is not None:        # the job finished before this kill: nothing left to kill
                break
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills += 1
        final = subprocess.run(cmd, capture_output=True, text=True)
        from jobrunner.output import read_results
        ids = read_results(out).column("id").to_pylist()
        names = os.listdir(out)
        report = {
            "kills": kills, "rows": a.rows, "rows_in_output": len(ids), "distinct_ids": len(set(ids)),
            "exactly_once": sorted(ids) == sorted(f"r{i}" for i in range(a.rows)),
            "final_exit_code": final.returncode,
            "corrupt_parts_set_aside": sum(n.startswith("_corrupt-") for n in names),
            "temp_files_left": sum(n.startswith("_tmp-") for n in names),
            "parts": sum(n.startswith("part-") for n in names),
        }
        print(json.dumps(report))
        if not report["exactly_once"] or final.returncode != 0:
            sys.exit(1)


if __name__ == "__main__":
    main()
