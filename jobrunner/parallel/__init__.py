"""Data parallelism: one worker process per device, each with its own engine, sharing one job.

Two ways to start the workers, one protocol between them:

    jobrunner submit --data-parallel N            torchrun / srun / PyTorchJob (RANK, WORLD_SIZE, ...)
    ----------------------------------            ---------------------------------------------------
    this launcher hosts a TCPStore, starts N      every rank is a worker; rank 0 (or torchrun's agent)
    workers (`python -m jobrunner.parallel`,      hosts the store; a thread of rank 0 coordinates;
    one GPU or cores // N threads each) and       a rank that stops beating its heart fails the job,
    coordinates; it sees a worker die at once     and torchrun's restart (or a rerun) resumes it

Every worker reads and plans the same dataset identically (Job's contract), so a work unit is
named by its index in the plan. The coordinator and the workers talk only through the store.

    world.py        how many workers, on what devices; the checks before any process starts
    launcher.py     --data-parallel N on one machine, and the worker processes it starts
    torchrun.py     torchrun / srun mode, with each rank's heartbeat
    worker.py       a worker: its rounds, its share of the units (the claim), its progress
    coordinator.py  rounds, lost workers, the merged stats and the complete manifest
    protocol.py     every store key, who writes it and its JSON value
"""
from __future__ import annotations

import logging

from jobrunner.config.job import JobConfig
from jobrunner.pipeline.ending import JobResult
from jobrunner.parallel.launcher import launch
from jobrunner.parallel.torchrun import run_distributed
from jobrunner.parallel.world import data_parallel_size, distributed_env
from jobrunner.pipeline.resolve import Resolved, resolve

log = logging.getLogger("jobrunner")

__all__ = ["data_parallel_size", "distributed_env", "preflight", "run_parallel", "wants_parallel"]

def preflight(cfg: JobConfig) -> Resolved:
    """What can fail without a model, before any process starts, and what the job's workers share:
    jobrunner.pipeline.resolve's Resolved (the model's path and precision, the input's format, ...)."""
    return resolve(cfg, parallel=True)


_preflight = preflight      # the name tests/test_errors.py imports


def wants_parallel(cfg: JobConfig) -> bool:
    return distributed_env() is not None or data_parallel_size(cfg.engine, cfg.parallel) > 1


def run_parallel(cfg: JobConfig) -> JobResult:
    """The job over several workers: under torchrun this process is one rank, else a launcher.
    Raises JobConfigError for a configuration that can't run (nothing written)."""
    env = distributed_env()
    if env is not None:
        if cfg.parallel.data_parallel not in (None, env["world"]):
            log.warning("--data-parallel %s ignored: WORLD_SIZE=%d decides", cfg.parallel.data_parallel, env["world"])
        return run_distributed(cfg, env)
    return launch(cfg, data_parallel_size(cfg.engine, cfg.parallel))
