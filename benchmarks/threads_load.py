"""Compute threads against other load: one job under 0 or more busy processes, with --threads 1,
--threads 2 and the automatic choice (threads from the free cores at start, then jobrunner/common/threads.py's
governor following the load), and a load that arrives mid-job.

    python -m benchmarks.threads_load                         # 32 rows x 32 new tokens, load 0 and 1
    python -m benchmarks.threads_load --rows 64 --max-tokens 64 --loads 0,1 --repeats 2
    python -m benchmarks.threads_load --max-tokens 64 --loads 0,1,2 --repeats 3 --choices 1,auto

"Other load" here is K processes each spinning one core (a stand-in for the other jobs of a shared
CI runner or Airflow worker); whatever else runs on the machine adds to it (the table says how much,
from /proc/loadavg before each run).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import threading
from pathlib import Path

from benchmarks import workloads as W
from benchmarks.peers import run_jobrunner


def _spin(stop) -> None:
    while not stop.is_set():
        sum(range(10_000))


class OtherLoad:
    """K processes each keeping one core busy, started after `delay_s`, until stopped."""

    def __init__(self, k: int, delay_s: float = 0.0):
        self.stop = mp.Event()
        self.procs = [mp.Process(target=_spin, args=(self.stop,), daemon=True) for _ in range(k)]
        self.timer = threading.Timer(delay_s, self._start) if delay_s else None

    def _start(self) -> None:
        for p in self.procs:
            p.start()

    def __enter__(self):
        self.timer.start() if self.timer else self._start()
        return self

    def __exit__(self, *exc) -> None:
        if self.timer:
            self.timer.cancel()
        self.stop.set()
        for p in self.procs:
            if p.pid is not None:
                p.join(5)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--loads", default="0,1", help="busy processes of other load, comma-separated")
    ap.add_argument("--late-load-s", type=float, default=10.0,
                    help="also run with one busy process starting this many seconds into the job (0: not)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--choices", default="1,2,auto", help="thread choices to run, of 1, 2 and auto (2 under load "
                                                           "takes minutes a run)")
    args = ap.parse_args(argv)

    work = W.free_generation(W.our_tokenizer(), n=args.rows, min_tokens=64, max_tokens=128)
    tmp = Path(tempfile.mkdtemp(prefix="threads-load-"))
    data = work.write(tmp / "rows.jsonl")
    every = {"1": ("--threads 1", ["--threads", "1"]), "2": ("--threads 2", ["--threads", "2"]), "auto": ("auto", [])}
    choices = dict(every[c] for c in args.choices.split(","))
    scenarios = [(f"{k} busy", k, 0.0) for k in map(int, args.loads.split(","))]
    if args.late_load_s:
        scenarios.append((f"1 busy from {args.late_load_s:.0f} s", 1, args.late_load_s))
    print("| other load | loadavg before | " + " | ".join(choices) + " |\n|---|---|" + "---|" * len(choices))
    for label, k, delay in scenarios:
        for _ in range(args.repeats):
            before, cells = os.getloadavg()[0], []
            for name, extra in choices.items():
                out = tmp / f"out-{name.replace(' ', '').replace('-', '')}"
                with OtherLoad(k, delay):
                    res = run_jobrunner(data, out, ["-m", args.model, "--no-chat", "--max-tokens",
                                                    str(args.max_tokens), "--ignore-eos", *extra])
                cells.append(f"{res['wall_s']:.1f} s" if "wall_s" in res else res.get("error", "failed")[:40])
            print(f"| {label} | {before:.1f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
