"""How many CPU threads a job computes with.

torch starts one intra-op thread per core. On a machine where other processes keep cores
busy, a thread that waits for a busy core stalls every step of the whole team (each matmul
ends at a barrier): two threads on a loaded 2-core machine measured several times slower
than one. So a job takes the cores of its affinity set that nothing else is running on
when it starts, and `--threads N` decides it for the user who knows better.
"""
from __future__ import annotations

import os
import statistics
import time

_SAMPLES, _GAP_S = 5, 0.005


def _running_elsewhere() -> int | None:
    """Runnable threads on the machine other than this one (Linux: /proc/stat's procs_running)."""
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("procs_running"):
                    return max(0, int(line.split()[1]) - 1)
    except OSError:
        pass
    return None


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                       # not Linux
        return os.cpu_count() or 1


def free_cores() -> int:
    """Cores this process may use that other runnable threads are not busy on (the median of a few
    samples over ~25 ms: one sample catches passing bursts), at least 1."""
    cores = available_cores()
    samples = []
    for i in range(_SAMPLES):
        busy = _running_elsewhere()
        if busy is None:
            return cores
        samples.append(busy)
        if i + 1 < _SAMPLES:
            time.sleep(_GAP_S)
    return max(1, cores - int(statistics.median(samples)))
