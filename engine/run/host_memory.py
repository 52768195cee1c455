"""While a CPU engine is open the C heap keeps what it frees, so that a step's activations reuse pages
already mapped.

glibc gives every block over its mmap threshold (128 KiB, rising to 32 MiB as it adapts) its own
mapping and unmaps it on free, and trims the heap's free top back to the OS. A prefill chunk's
activations are 1-25 MiB each, made and freed at every layer: every step faults them in again, and
the kernel zeroes each page before handing it over (a 2048-token chunk of the default model: ~380,000
page faults and 0.6 s of system time a step, a tenth of the step). Raised thresholds keep them in the
heap; the process holds its peak activations, which a batch job reaches again at the next step.

The last engine to close gives the free heap back (malloc_trim) and sets glibc's default thresholds
again; its adaptive mmap threshold stays off (mallopt cannot turn it back on). A user's
MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ (glibc's tunables) wins: nothing is changed then. C
libraries without mallopt (musl) are left as they are.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# a larger model's activations pass 32 MiB; glibc before 2.35 refuses a threshold over 32 MiB (64-bit)
MMAP_THRESHOLDS = (1 << 30, 32 << 20)
TRIM_THRESHOLD = 1 << 30
GLIBC_DEFAULT = 128 << 10            # both thresholds' starting values
TUNABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

_holders = 0


@functools.cache
def _libc():
    """glibc's mallopt and malloc_trim, or None (looked up once)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt, trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    return mallopt, trim


def hold() -> bool:
    """An engine opens: the first raises the thresholds. True if this one holds them (release it)."""
    global _holders
    if _holders:
        _holders += 1
        return True
    libc = None if any(k in os.environ for k in TUNABLES) else _libc()
    if libc is None:
        return False
    mallopt, _ = libc
    if not (any(mallopt(M_MMAP_THRESHOLD, t) for t in MMAP_THRESHOLDS) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return False
    _holders = 1
    return True


def release() -> bool:
    """An engine that held them closes; the last gives the free heap back. Returns False (held no more)."""
    global _holders
    _holders -= 1
    if _holders == 0:
        mallopt, trim = _libc()
        mallopt(M_MMAP_THRESHOLD, GLIBC_DEFAULT)
        mallopt(M_TRIM_THRESHOLD, GLIBC_DEFAULT)
        trim(0)
    return False
