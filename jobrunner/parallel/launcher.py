"""The single-node launcher (`--data-parallel N`) and the worker processes it starts.

The launcher hosts a TCPStore, starts N workers (WORKER_COMMAND: `python -m jobrunner.parallel`,
one GPU or cores // N threads each; with --tensor-parallel T, T GPUs each, or cores // (N * T) threads
for each of their engines' processes) and coordinates. It sees a worker die at once (its process
ends), and hands the rows that worker had not written to another round of the workers left.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict

from jobrunner.config.job import JobConfig, JobConfigError, field_value
from jobrunner.pipeline.ending import JobResult
from jobrunner.parallel import protocol
from jobrunner.parallel.coordinator import Coordinator
from jobrunner.parallel.protocol import EXIT_FAILED
from jobrunner.parallel.worker import worker_loop
from jobrunner.pipeline.checks import check_gpus, check_spread_device
from jobrunner.pipeline.precision import cuda_count
from jobrunner.pipeline.progress import log_datefmt
from jobrunner.pipeline.resolve import Resolved, resolve
from jobrunner.parallel.world import gpu_groups
from jobrunner.common.run_stats import RUN_ID_ENV
from jobrunner.common.threads import threads_each

log = logging.getLogger("jobrunner")

# What each worker process runs (worker_process_main, through __main__.py); its environment says which
# worker it is. Tests point this at a wrapper that injects faults.
WORKER_COMMAND = [sys.executable, "-m", "jobrunner.parallel"]


def launch(cfg: JobConfig, n: int) -> JobResult:
    """The job over n worker processes on this machine, coordinated from this one."""
    resolved = resolve(cfg, parallel=True)
    gpus = cuda_count(cfg.engine.device)
    on_gpu = gpus > 0 and cfg.engine.device != "cpu"
    check_spread_device(cfg.engine.device, f"use --device cuda --data-parallel {n} (or CUDA_VISIBLE_DEVICES) "
                                           "to spread the job over several")
    if cfg.engine.device == "cuda" and not on_gpu:
        raise JobConfigError("--device cuda was asked for but no CUDA GPU is visible")
    if on_gpu:
        check_gpus(cfg.engine, cfg.parallel, n)
    tp = cfg.parallel.tensor_parallel
    groups = gpu_groups(os.environ.get("CUDA_VISIBLE_DEVICES"), gpus, n, tp)
    # a worker's threads are its engine's, shared by its tensor-parallel ranks (JobConfig.cpu_threads):
    # free // n // tp == free // (n * tp) threads for each of the n * tp processes
    threads = cfg.engine.threads or threads_each(None, n)
    server = protocol.host_store(n + 1)
    store = protocol.namespace(server)
    procs = _start_workers(cfg, resolved, n, server.port, groups if on_gpu else None, threads)
    engines = f" of {tp} tensor-parallel ranks" if tp > 1 else ""
    log.info("data parallel: %d workers%s on %s", n, engines, f"GPUs {' | '.join(groups)}" if on_gpu
             else f"CPU, {threads_each(threads, tp)} threads a process")
    coord = Coordinator(cfg.input, cfg.output, cfg.output_url, cfg.engine, cfg.parallel, store=store, world=n,
                        alive=lambda r: procs[r].poll() is None, retry=True, fingerprint=resolved.fingerprint(cfg))

    def on_signal(signum, frame):
        coord.stopping = True
        log.warning("signal %d: workers finish what is written, then stop", signum)
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        result = coord.run()
    except BaseException:
        if not protocol.aborted(store):
            coord._abort(EXIT_FAILED)
        raise
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _reap(procs)
    return coord.raise_or(result)


def _start_workers(cfg: JobConfig, resolved, n: int, port: int, gpus: list[str] | None,
                   threads: int) -> dict[int, subprocess.Popen]:
    """One process per rank: its CUDA_VISIBLE_DEVICES from `gpus` (one GPU, or a comma list of its engine's
    tensor-parallel GPUs), or (gpus None) `threads` CPU threads for its engine."""
    worker_cfg = config_to_json(cfg)
    run_id = uuid.uuid4().hex[:16]      # the workers' parts record one run (jobrunner/common/run_stats.py: time_record)
    procs: dict[int, subprocess.Popen] = {}
    for rank in range(n):
        env = dict(os.environ, JOBRUNNER_LAUNCHER_PID=str(os.getpid()), JOBRUNNER_WORKER_CONFIG=worker_cfg,
                   **{RUN_ID_ENV: run_id},
                   JOBRUNNER_WORKER_RESOLVED=resolved.to_json(),
                   RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus[rank]
        else:
            per_process = str(threads_each(threads, cfg.parallel.tensor_parallel))
            env.update(OMP_NUM_THREADS=per_process, RAYON_NUM_THREADS=per_process, JOBRUNNER_THREADS=str(threads))
        # A session of its own: a Ctrl-C on the terminal reaches the launcher only, which forwards one SIGTERM.
        procs[rank] = subprocess.Popen(WORKER_COMMAND, env=env, start_new_session=True)
    return procs


def _reap(procs: dict[int, subprocess.Popen], timeout_s: float = 30) -> None:
    deadline = time.time() + timeout_s
    for p in procs.values():
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def worker_process_main() -> int:
    """`python -m jobrunner.parallel`: one worker started by launch."""
    _setup_worker_logging(int(os.environ["RANK"]))
    cfg = config_from_json(os.environ["JOBRUNNER_WORKER_CONFIG"])
    resolved = Resolved.from_json(os.environ["JOBRUNNER_WORKER_RESOLVED"])     # the launcher's, not again
    parent = int(os.environ["JOBRUNNER_LAUNCHER_PID"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    threading.Thread(target=_orphan_watch, args=(parent,), daemon=True).start()
    client = protocol.client_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world + 1)
    threads = int(os.environ.get("JOBRUNNER_THREADS") or 0) or None
    return worker_loop(cfg, resolved, rank, world, protocol.namespace(client), threads=threads)


def _orphan_watch(parent: int) -> None:
    """The launcher was killed (SIGKILL, OOM): stop at once, so that a rerun never races this worker."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(EXIT_FAILED)


def config_to_json(cfg: JobConfig) -> str:
    """cfg's flat options as JSON, for its workers (config_from_json); `ray` as its table."""
    return json.dumps({**cfg.options(), "given": sorted(cfg.given)}, default=asdict)


def config_from_json(text: str) -> JobConfig:
    """The launcher's JobConfig, from its flat options as JSON (lists back to tuples)."""
    d = json.loads(text)
    given = d.pop("given", ())
    return JobConfig.from_options({**{k: v if v is None else field_value(k, v) for k, v in d.items()},
                                   "given": given})


def _setup_worker_logging(rank: int) -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, datefmt=log_datefmt(),
                            format=f"%(asctime)s worker {rank} %(levelname)s %(message)s")
