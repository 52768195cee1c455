"""`--ray` against `--data-parallel 2` on one machine, same tiny-model job: wall time, time to the first row,
and the figures docs/RAY.md bounds 100 nodes with (the queue actor's calls per second, the plan's size
in the object store a row).

    python -m benchmarks.ray_overhead [--rows 600] [--max-tokens 24] [--repeats 2] [--before TREE]

A loopback Ray head (127.0.0.1, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0) is started first and not timed: on a
Ray cluster the cluster is already up. `--ray local` (a private cluster started by the job) is timed too.
The first row: a run with --part-rows 1 and --limit 40, the first part file's appearance after the start.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 259, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 1024,
        "tie_word_embeddings": False, "bos_token_id": 256, "eos_token_id": 258}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_DISABLE_USAGE_STATS": "1"}
os.environ.update(RAY_ENV)      # this process joins the cluster too (queue_figures): loopback only, read at import
ENV = dict(os.environ, PYTHONPATH=ROOT)


def start_head(temp: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    head = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head", "--block",
                             "--port", str(port), "--node-ip-address", "127.0.0.1", "--num-cpus", "2",
                             "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", temp,
                             "--object-store-memory", str(200 * 2**20)],
                            env=ENV, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in head.stdout:
        if "Ray runtime started" in line:
            return head, f"127.0.0.1:{port}"
    raise SystemExit("ray start failed")


def run(cmd: list[str], out: str, tree: str = ROOT) -> dict:
    """The command's wall time, its first part's appearance (s after the start) and the job's own wall_s."""
    t0 = time.time()
    p = subprocess.Popen(cmd, env=dict(ENV, PYTHONPATH=tree), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = None
    while p.poll() is None:
        if first is None and os.path.isdir(out) and any(n.startswith("part") for n in os.listdir(out)):
            first = time.time() - t0
        time.sleep(0.01)
    wall = time.time() - t0
    err = p.stderr.read()
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: exit {p.returncode}\n{err[-3000:]}")
    stats = json.load(open(os.path.join(out, "_stats.json")))
    return {"wall_s": round(wall, 2), "first_part_s": round(first, 2) if first else None,
            "job_wall_s": round(stats["wall_s"], 2), "rows": stats["rows"]}


def queue_figures(address: str) -> dict:
    """The queue actor's hand-out latency (one worker, ray.get per bundle, as QueueUnits does) and its
    throughput (many calls in flight, as many workers together would keep it), bundles being object refs."""
    import ray
    from jobrunner.parallel.ray_queue import WorkQueue
    ray.init(address=address, logging_level="WARNING", log_to_driver=False)
    q = ray.remote(WorkQueue).options(num_cpus=0).remote()
    n = 2000
    ref = ray.put(b"a bundle")
    ray.get(q.put.remote([(k, 64, [ref]) for k in range(7 * n)]))
    ray.get(q.next.remote(0))
    t = time.perf_counter()
    for _ in range(n):
        ray.get(q.next.remote(0))
    latency = (time.perf_counter() - t) / n
    t = time.perf_counter()
    ray.get([q.next.remote(k % 100) for k in range(5 * n)])
    throughput = 5 * n / (time.perf_counter() - t)
    ray.shutdown()
    return {"next_latency_ms": round(latency * 1e3, 3), "queue_calls_per_s": round(throughput)}


def plan_bytes(prompt_chars: int = 800, rows: int = 64) -> float:
    """Pickled bytes a row of a shipped bundle (job.pending.ShippedUnit: the row, its request and its
    prompt's token ids as uint32), for prompts of `prompt_chars` characters of ~4 characters a token
    (plus the row's own columns)."""
    from array import array
    from jobrunner.engine import Request, SamplingParams
    from jobrunner.dataset.rows import Row
    from jobrunner.pipeline.pending import PendingRow, ShippedUnit
    from jobrunner.jobs.row import NO_NOTES
    rnd = random.Random(0)
    sampling = SamplingParams(max_tokens=16)
    units = [ShippedUnit([PendingRow(Row(i, f"row-{i}", {"id": f"row-{i}", "prompt": "x" * prompt_chars}),
                                     array("I", (rnd.randrange(150_000) for _ in range(prompt_chars // 4))),
                                     Request(f"row-{i}", [], sampling), NO_NOTES)], {})
             for i in range(rows)]
    return len(pickle.dumps(units)) / rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-local", action="store_true", help="skip --ray local")
    ap.add_argument("--no-first-row", action="store_true", help="skip the first-row runs and the queue figures")
    ap.add_argument("--before", metavar="TREE", help="also run both modes from another checkout (e.g. `git worktree "
                    "add /tmp/before <commit>`), interleaved with this one's, so that the load falls on both alike")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="jr-raybench-")
    os.makedirs(f"{work}/model")
    json.dump(TINY, open(f"{work}/model/config.json", "w"))
    rnd = random.Random(0)
    with open(f"{work}/data.jsonl", "w") as f:
        for i in range(args.rows):
            f.write(json.dumps({"id": f"r{i}", "prompt": "".join(rnd.choice("abcdefghij ") for _ in range(20 + i % 60))})
                    + "\n")
    head, address = start_head(f"/tmp/jr-raybench-{os.getpid()}")
    try:
        base = [sys.executable, "-m", "jobrunner.cli.main", "submit", f"{work}/data.jsonl", "-m", f"dummy:{work}/model",
                "--max-tokens", str(args.max_tokens), "--max-num-seqs", "8", "--device", "cpu", "--data-parallel", "2"]
        modes = {"data-parallel 2": [], "ray (running cluster)": ["--ray", address], "ray local": ["--ray", "local"]}
        if args.before:
            modes = {f"before: {name}": modes[name] for name in list(modes)[:2]} | modes
        tree_of = {name: args.before if name.startswith("before: ") else ROOT for name in modes}
        if args.no_local:
            del modes["ray local"]
        results: dict[str, list] = {m: [] for m in modes}
        for rep in range(args.repeats):
            for name, extra in modes.items():
                if name == "ray local" and rep:
                    continue            # the cluster's own start-up, once
                out = f"{work}/out-{len(os.listdir(work))}"
                results[name].append(run(base + extra + ["-o", out, "--part-rows", "100"], out, tree_of[name]))
                print(name, results[name][-1], file=sys.stderr, flush=True)
        first = {}
        for name, extra in ({} if args.no_first_row else modes).items():
            out = f"{work}/first-{len(os.listdir(work))}"
            first[name] = run(base + extra + ["-o", out, "--part-rows", "1", "--limit", "40"], out,
                              tree_of[name])["first_part_s"]
            print(name, "first row", first[name], file=sys.stderr, flush=True)
        figures = {"runs": results, "first_row_s": first, "uptime": os.popen("uptime").read().strip(),
                   **({} if args.no_first_row else queue_figures(address)),
                   "plan_bytes_per_row_800_chars": round(plan_bytes())}
        print(json.dumps(figures, indent=1))
    finally:
        stop_head(head)


def stop_head(head: subprocess.Popen) -> None:
    """SIGKILL to the head and every process of its session (raylet, GCS, workers): ours, by pid."""
    pids = [head.pid]
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and int(open(f"/proc/{name}/stat").read().rsplit(")", 1)[1].split()[3]) == head.pid:
                pids.append(int(name))
        except OSError:
            continue
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    head.wait()


if __name__ == "__main__":
    main()
