"""Rank 0 of a tensor-parallel group: start the other ranks, join the group with them, watch them.

The other ranks are child processes (`python -m jobrunner.engine.run.follower`) of the process whose
engine they serve, on the same machine: a group never spans machines. Rank r uses CUDA device
base + r of those visible (base: the index in --device cuda:N, else 0), or the CPU with the
config's threads each. Rendezvous is a TCPStore on a free local port.

A rank that dies ends the engine: rank 0's next collective fails (gloo reports a closed
connection at once) and Engine raises EngineFailure; should a collective hang instead (NCCL),
the watcher ends rank 0's process after LOST_GRACE_S. The other ranks leave when rank 0 sends
the end, when its connection closes, or when it is gone (their parent changes).
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import torch

from jobrunner.engine.config.engine_config import EngineConfig
from jobrunner.engine.parallel.channel import StepChannel
from jobrunner.engine.parallel.group import TensorParallel

log = logging.getLogger("jobrunner")

FOLLOWER_COMMAND = [sys.executable, "-m", "jobrunner.engine.run.follower"]
EXIT_LOST = 1             # the process exit code when a lost rank leaves rank 0 stuck (jobrunner's "workers lost")
LOST_GRACE_S = 60.0       # a step still running this long after a rank died is stuck in a collective
RENDEZVOUS_TIMEOUT = timedelta(minutes=2)   # the ranks' start-up (imports) before the group forms; no weights yet
# A rank waits for rank 0's next plan as long as rank 0 idles (an API user may hold an engine for hours):
# the host group's collectives never time out; a dead peer fails them through its closed connection.
HOST_TIMEOUT = timedelta(days=30)
DEVICE_TIMEOUT = timedelta(minutes=30)


def join_group(config: EngineConfig, rank: int, port: int, device: torch.device) -> TensorParallel:
    """Rank `rank` > 0 joins the group whose rank 0 (Followers) hosts the store on local `port`."""
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", port, config.tensor_parallel, False, timeout=RENDEZVOUS_TIMEOUT)
    return _init(store, rank, config, device)


def _init(store, rank: int, config: EngineConfig, device: torch.device) -> TensorParallel:
    import torch.distributed as dist
    backend = "nccl" if device.type == "cuda" else "gloo"
    size = config.tensor_parallel
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,    # gloo carries the plans too
                            timeout=DEVICE_TIMEOUT if backend == "nccl" else HOST_TIMEOUT,
                            **({"device_id": device} if device.type == "cuda" else {}))
    host = dist.new_group(backend="gloo", timeout=HOST_TIMEOUT) if backend == "nccl" else dist.group.WORLD
    return TensorParallel(rank=rank, size=size, group=dist.group.WORLD, host=host, moe_split=config.moe_split)


class Followers:
    """Ranks 1..size-1 of rank 0's group, as child processes."""

    def __init__(self, config: EngineConfig, device: torch.device):
        import torch.distributed as dist
        size = config.tensor_parallel
        self.store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=RENDEZVOUS_TIMEOUT, wait_for_workers=False)
        path = os.pathsep.join(p for p in sys.path if p)     # the child imports what this process does
        env = dict(os.environ, PYTHONPATH=path, JOBRUNNER_TP_CONFIG=json.dumps(asdict(config)), JOBRUNNER_TP_PORT=str(self.store.port), JOBRUNNER_TP_LEADER_PID=str(os.getpid()))
        if config.num_threads:
            env.update(OMP_NUM_THREADS=str(config.num_threads))
        self.procs = {r: subprocess.Popen(FOLLOWER_COMMAND, env=dict(env, JOBRUNNER_TP_RANK=str(r)))
                      for r in range(1, size)}
        log.info("tensor parallel: %d ranks; ranks 1-%d are processes %s", size, size - 1,
                 ", ".join(str(p.pid) for p in self.procs.values()))
        self.closing = False
        self.step_since: float | None = None      # when rank 0's step in progress began (Engine.step sets it)
        try:
            self.tp = _init(self.store, 0, config, device)
        except BaseException:       # a rank died before the group formed (its error is above), or timed out
            self.close(abort=True)
            raise
        threading.Thread(target=self._watch, name="jobrunner-tp-watch", daemon=True).start()
        atexit.register(self.close)

    def lost(self, wait_s: float = 0.0) -> str | None:
        """Which rank has died, in words, or None (after waiting up to wait_s for one to)."""
        deadline = time.time() + wait_s
        while True:
            for r, p in self.procs.items():
                if p.poll() is not None and not self.closing:
                    return f"tensor-parallel rank {r} (process {p.pid}) exited with code {p.returncode}"
            if time.time() >= deadline:
                return None
            time.sleep(0.1)

    def close(self, abort: bool = False) -> None:
        """Ends the other ranks: tells them (StepChannel's end) and waits for them; `abort` (a rank is
        lost, the group is broken): kills those left."""
        if self.closing:
            return
        self.closing = True
        if abort or any(p.poll() is not None for p in self.procs.values()):    # a broken group: no clean end
            for p in self.procs.values():
                if p.poll() is None:
                    p.kill()
        else:
            try:
                StepChannel(self.tp, torch.device("cpu")).send(None)
            except RuntimeError:      # a rank went at the same moment: it is ending anyway
                pass
        deadline = time.time() + 30
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        destroy_group()

    def _watch(self) -> None:
        """A lost rank fails rank 0's next collective (Engine.step raises EngineFailure); only a step
        stuck past LOST_GRACE_S after the loss (a collective that never fails) ends the process."""
        while not self.closing and not (why := self.lost()):
            time.sleep(0.5)
        if self.closing:
            return
        log.error("%s; the engine stops", why)
        lost_at = time.monotonic()
        while not self.closing:
            since = self.step_since
            if since is not None and time.monotonic() - max(since, lost_at) > LOST_GRACE_S:
                log.error("rank 0 is still waiting for the lost rank after %.0f s: exiting", LOST_GRACE_S)
                os._exit(EXIT_LOST)
            time.sleep(0.5)


def destroy_group() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a peer is gone: nothing left to tear down cleanly
            pass
