"""The process-wide settings engines change, held while any engine is open and put back by the last to close.

    setting                      changed                                          put back
    gc threshold (generation 0)  raised to 50,000 while an engine is open         its value before the first engine
    C heap (CPU engines)         engine/run/host_memory.py's thresholds               glibc's defaults, heap trimmed
    torch intra-op threads       EngineConfig.num_threads (build_runtime),        the count before the first change
                                 Engine.set_threads (the thread governor)
    current CUDA device          an indexed device (resolve_device)               the one before, when CUDA was
                                                                                  initialized then (same thread)

A setting's value before the first change is kept until the last engine closes (Engine.close, or the engine's
finalizer when it is collected unclosed), which restores it; an engine that fails to open restores what its
runtime changed when no other engine is open. Nothing runs at interpreter exit: the process is ending.
The current CUDA device is per thread: it is restored only on the thread that changed it, and not at all if
CUDA was not initialized before (setting device 0 then would create a context on a GPU the job does not use).
torch's inter-op threads and environment variables are never changed (child processes get their own env).

Why the gc threshold: a step allocates thousands of small objects (chunks, token lists, outputs); with Python's
default threshold (700) the cyclic collector runs every few hundred of them and, every tenth of those, walks
older objects too: ~40% of the host time of a 1000-sequence step. With 50,000, cycles are still freed, only
later. (gc.freeze() would save more but makes nanobind report leaks at exit.)
"""
from __future__ import annotations

import gc
import threading

import torch

from jobrunner.engine.run import host_memory

GC_GEN0 = 50_000

_open = 0                            # engines open
_saved: dict[str, object] = {}       # setting -> its value before the first change, until the last close


def set_threads(n: int) -> None:
    """torch.set_num_threads(n), the count in force before saved."""
    _saved.setdefault("threads", torch.get_num_threads())
    torch.set_num_threads(n)


def set_cuda_device(device: torch.device) -> None:
    """torch.cuda.set_device(device), the current device before saved (only if CUDA was initialized)."""
    if "cuda_device" not in _saved and torch.cuda.is_initialized():
        _saved["cuda_device"] = (threading.get_ident(), torch.cuda.current_device())
    torch.cuda.set_device(device)


def hold(cpu: bool) -> bool:
    """An engine opens: the first raises the gc threshold; a CPU engine holds the C heap too. Returns whether
    this one holds the heap (pass it to release)."""
    global _open
    _open += 1                        # first: a finalizer run by a collection in between sees this engine open
    if "gc" not in _saved:
        _saved["gc"] = gen0, gen1, gen2 = gc.get_threshold()
        gc.set_threshold(max(gen0, GC_GEN0), gen1, gen2)
    return cpu and host_memory.hold()


def release(heap: bool) -> None:
    """An engine that held closes (once: Engine.close and its finalizer share one call); the last restores."""
    global _open
    _open -= 1
    if heap:
        host_memory.release()
    restore_if_idle()


def restore_if_idle() -> None:
    """No engine open: every saved setting gets its value back."""
    if _open:
        return
    if "gc" in _saved:
        gc.set_threshold(*_saved.pop("gc"))
    if "threads" in _saved:
        torch.set_num_threads(_saved.pop("threads"))
    if "cuda_device" in _saved:
        thread, index = _saved.pop("cuda_device")
        if thread == threading.get_ident():
            torch.cuda.set_device(index)
