"""How many workers and on what: torchrun's variables, --data-parallel or the visible GPUs, the CPU
cores to share, and the checks that run before any worker starts."""
from __future__ import annotations

import os

from jobrunner.config import JobConfig, JobConfigError


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


def cuda_count(device: str) -> int:
    if not (device == "auto" or device.startswith("cuda")):
        return 0
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - no usable CUDA: CPU
        return 0


def data_parallel_size(cfg: JobConfig) -> int:
    """--data-parallel, or by default the number of visible GPUs (1 on CPU or with --device cuda:N)."""
    if cfg.data_parallel is not None:
        return cfg.data_parallel
    if cfg.device.startswith("cuda:") or cfg.device == "cpu":
        return 1
    return max(1, cuda_count(cfg.device))


def preflight(cfg: JobConfig) -> None:
    """What can fail without a model, before any process starts."""
    from jobrunner import checks
    cfg.validate()
    fmt, columns = checks.check_dataset(cfg)
    checks.check_template(cfg, columns)
    checks.check_not_empty(cfg, fmt)
    checks.check_output(cfg)
