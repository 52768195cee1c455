"""How many workers and on what: torchrun's variables, --data-parallel or the visible GPUs, each
worker's GPUs and configuration, and the checks that run before any worker starts."""
from __future__ import annotations

import os
from dataclasses import replace

from jobrunner.config.job import JobConfig, JobConfigError
from jobrunner.pipeline.precision import cuda_count
from jobrunner.pipeline.resolve import resolve


def distributed_env() -> dict | None:
    """RANK, WORLD_SIZE, ... when started by torchrun (or srun, PyTorchJob) with a world over 1."""
    if os.environ.get("JOBRUNNER_LAUNCHER_PID"):
        return None                         # our own worker processes; see launcher.worker_process_main
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return None
    if world <= 1 or "RANK" not in os.environ:
        return None
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise JobConfigError(f"WORLD_SIZE={world} but {', '.join(missing)} not set: start the job with torchrun, "
                             "or set MASTER_ADDR and MASTER_PORT to rank 0's host and a free port")
    rank = int(os.environ["RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return {"rank": rank, "world": world, "local_rank": int(os.environ.get("LOCAL_RANK", rank % local_world)),
            "local_world": local_world}


def data_parallel_size(cfg: JobConfig) -> int:
    """--data-parallel, or by default as many engines of --tensor-parallel GPUs as the visible GPUs hold
    (1 on CPU or with --device cuda:N)."""
    if cfg.parallel.data_parallel is not None:
        return cfg.parallel.data_parallel
    if cfg.engine.device.startswith("cuda:") or cfg.engine.device == "cpu":
        return 1
    return max(1, cuda_count(cfg.engine.device) // cfg.parallel.tensor_parallel)


def gpu_groups(visible: str | None, count: int, workers: int, tp: int) -> list[str]:
    """Each worker's CUDA_VISIBLE_DEVICES: worker k the k-th run of `tp` GPUs of the user's list (`visible`,
    else 0..count-1); its engine's ranks are then that list's cuda:0, cuda:1, ..."""
    ids = [d.strip() for d in (visible or "").split(",") if d.strip()] or [str(i) for i in range(count)]
    return [",".join(ids[k * tp:(k + 1) * tp]) for k in range(workers)]


def worker_config(cfg: JobConfig, threads: int | None) -> JobConfig:
    """cfg as a worker runs it: the coordinator (or the Ray driver) alone prepares, and overwrites, the
    output; the launcher shares the cores out (`threads` for its engine; None: cfg's)."""
    return replace(cfg, output=replace(cfg.output, overwrite=False),
                   engine=replace(cfg.engine, threads=threads or cfg.engine.threads))


def preflight(cfg: JobConfig):
    """What can fail without a model, before any process starts, and what the job's workers share:
    jobrunner.job.resolve's Resolved (the model's path and precision, the input's format, ...)."""
    return resolve(cfg, parallel=True)
