"""torchrun / srun / PyTorchJob: every rank is a worker; a thread of rank 0 also coordinates.

torchrun's store (rank 0's, or its agent's) carries the protocol. No process watches the others, so
each rank beats its heart into the store, and a rank whose heart stops counts as lost: the job ends
(exit 1) with what was written kept, and torchrun's --max-restarts, or the next run, resumes it.

With --tensor-parallel T each rank's engine starts its own T-1 follower processes on its node (GPUs
L*T .. L*T+T-1 for local rank L): start `torchrun --nproc-per-node GPUS/T`. A rank whose follower dies
leaves without a result, and the job ends with exit 1 like for any lost rank.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace

from jobrunner.config.job import JobConfig
from jobrunner.pipeline.ending import JobResult
from jobrunner.pipeline.resolve import resolve
from jobrunner.parallel import protocol
from jobrunner.parallel.coordinator import Coordinator
from jobrunner.parallel.worker import worker_loop
from jobrunner.pipeline.checks import check_gpus
from jobrunner.pipeline.precision import cuda_count
from jobrunner.common.threads import available_cores, threads_each

log = logging.getLogger("jobrunner")


def run_distributed(cfg: JobConfig, env: dict) -> JobResult:
    """This process's rank of the job; `env` is world.distributed_env()."""
    rank, world = env["rank"], env["world"]
    on_gpu = cuda_count(cfg.engine.device) > 0 and cfg.engine.device != "cpu"
    threads = None
    if on_gpu:
        # each rank's engine spans tensor_parallel GPUs of its own node: local rank L has cuda:L*T and its
        # engine's followers the next T-1 (engine.parallel.launch), so a tensor-parallel group never spans
        # nodes; `torchrun --nproc-per-node GPUS/T`
        check_gpus(cfg.engine, cfg.parallel, env["local_world"])
        cfg = replace(cfg, engine=replace(cfg.engine, device=f"cuda:{env['local_rank'] * cfg.parallel.tensor_parallel}"))
    else:   # the other local ranks are ours; this rank's share is its engine's, split among its processes
        threads = cfg.engine.threads or threads_each(None, env["local_world"], available_cores())
    resolved = resolve(cfg, parallel=True)       # each rank is its own process: it resolves once, for all its rounds
    store = protocol.rendezvous_store()
    ns = protocol.namespace(store, attempt=os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log.info("rank %d of %d (%s)", rank, world, cfg.engine.device if on_gpu else f"CPU, {threads} threads")
    beat = _Heartbeat(ns.clone(), rank)
    beat.start()
    try:
        if rank == 0:
            return _coordinate_and_work(cfg, resolved, ns, world, threads)
        # once this rank has acknowledged the end (`exited`), rank 0 may destroy the store: stop beating first
        code = worker_loop(cfg, resolved, rank, world, ns, threads=threads, before_exit=beat.stop)
        return JobResult(code, {}, cfg.output_url)
    finally:
        beat.stop()     # joined: no thread of ours is inside a store call when the interpreter exits


def _coordinate_and_work(cfg: JobConfig, resolved, ns, world: int, threads: int | None) -> JobResult:
    """Rank 0: the coordinator in a thread, this process's worker in the main thread."""
    monitor = _HeartbeatMonitor(ns.clone())
    # the local worker counts as gone once worker_loop has returned without acknowledging the end (e.g.
    # stopped by a signal); one that acknowledged is counted in `exited`, so stays a member for the handshake
    coord = Coordinator(cfg.input, cfg.output, cfg.output_url, cfg.engine, cfg.parallel, store=ns.clone(), world=world,
                        retry=False,
                        alive=lambda r: monitor(r) and not (r == 0 and coord.local_done),
                        fingerprint=resolved.fingerprint(cfg))
    thread = threading.Thread(target=coord.run_in_thread, name="jobrunner-coordinator", daemon=True)
    thread.start()
    acked: list[bool] = []
    try:
        worker_loop(cfg, resolved, 0, world, ns, threads=threads, before_exit=lambda: acked.append(True))
    finally:
        coord.local_done = not acked
    thread.join()       # it uses the store until every live worker has acknowledged the end
    return coord.raise_or(coord.result)


class _Heartbeat(threading.Thread):
    def __init__(self, store, rank: int, every_s: float = 2.0):
        super().__init__(name="jobrunner-heartbeat", daemon=True)
        self.store, self.rank, self.every_s = store, rank, every_s
        self._stop_event = threading.Event()

    def run(self):
        while not self._stop_event.is_set():
            try:
                protocol.beat(self.store, self.rank)
            except Exception:  # noqa: BLE001 - the store is gone: the job is over
                return
            self._stop_event.wait(self.every_s)

    def stop(self, timeout: float = 30.0):
        """Stop beating; on return the thread is out of the store (a store call ends or fails well within
        `timeout`). A daemon thread left inside a store call aborts the process at exit ("terminate called
        without an active exception"), and a store call racing its destruction may hang or fail."""
        self._stop_event.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout)
            if self.is_alive():
                log.warning("the heartbeat thread did not stop within %.0f s", timeout)


class _HeartbeatMonitor:
    """alive(rank): its heartbeat counter moved within JOBRUNNER_HEARTBEAT_TIMEOUT seconds (coordinator's clock)."""

    def __init__(self, store):
        self.store = store
        self.timeout = float(os.environ.get("JOBRUNNER_HEARTBEAT_TIMEOUT", "120"))
        self.seen: dict[int, tuple[int, float]] = {}

    def __call__(self, rank: int) -> bool:
        value = protocol.beats(self.store, rank)
        now = time.monotonic()
        last = self.seen.get(rank)
        if last is None or last[0] != value:
            self.seen[rank] = (value, now)
            return True
        return now - last[1] < self.timeout
