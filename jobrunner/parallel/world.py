"""How many workers and on what: torchrun's variables, --data-parallel or the visible GPUs, each
worker's GPUs. (A worker's configuration: worker.worker_config; the checks before any worker starts:
resolve(cfg, parallel=True), parallel.preflight.)"""
from __future__ import annotations

import os
from jobrunner.config.job import JobConfigError
from jobrunner.config.sections import EngineOptions, ParallelOptions
from jobrunner.pipeline.precision import cuda_count


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


def data_parallel_size(engine: EngineOptions, parallel: ParallelOptions) -> int:
    """--data-parallel, or by default as many engines of --tensor-parallel GPUs as the visible GPUs hold
    (1 on CPU or with --device cuda:N)."""
    if parallel.data_parallel is not None:
        return parallel.data_parallel
    if engine.device.startswith("cuda:") or engine.device == "cpu":
        return 1
    return max(1, cuda_count(engine.device) // parallel.tensor_parallel)


def gpu_groups(visible: str | None, count: int, workers: int, tp: int) -> list[str]:
    """Each worker's CUDA_VISIBLE_DEVICES: worker k the k-th run of `tp` GPUs of the user's list (`visible`,
    else 0..count-1); its engine's ranks are then that list's cuda:0, cuda:1, ..."""
    ids = [d.strip() for d in (visible or "").split(",") if d.strip()] or [str(i) for i in range(count)]
    return [",".join(ids[k * tp:(k + 1) * tp]) for k in range(workers)]

