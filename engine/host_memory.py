"""The C heap keeps what it frees, so that a CPU step's activations reuse pages already mapped.

glibc gives every block over its mmap threshold (128 KiB, rising to 32 MiB as it adapts) its own
mapping and unmaps it on free, and trims the heap's free top back to the OS. A prefill chunk's
activations are 1-25 MiB each, made and freed at every layer: every step faults them in again, and
the kernel zeroes each page before handing it over (a 2048-token chunk of the default model: ~380,000
page faults and 0.6 s of system time a step, a tenth of the step). Raised thresholds keep them in the
heap; the process then holds its peak activations, which a batch job reaches again at the next step.

A user's MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ (glibc's tunables) wins: nothing is changed
then. Other C libraries (musl) have no mallopt and are left as they are.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger("jobrunner")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# a larger model's activations pass 32 MiB; glibc before 2.35 refuses a threshold over 32 MiB (64-bit)
MMAP_THRESHOLDS = (1 << 30, 32 << 20)
TRIM_THRESHOLD = 1 << 30

_done = False


def keep_freed_memory() -> bool:
    """Once per process; True if the thresholds were raised now or before."""
    global _done
    if _done:
        return True
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _done = any(mallopt(M_MMAP_THRESHOLD, t) for t in MMAP_THRESHOLDS) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not _done:
        log.debug("mallopt refused the heap thresholds; CPU steps fault their activations in each time")
    return _done
