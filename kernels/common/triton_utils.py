"""Shared plumbing for the Triton kernels: availability, dispatch choice, launching.

Nothing here imports triton at module import time: `import kernels` must work where
triton is not installed (the dispatch functions then always take the torch references).

Dispatch rule (one place, used by every op's dispatch function):

    CUDA tensors                 -> Triton kernel (if triton imports), else reference
    other tensors                -> torch reference
    JOBRUNNER_TRITON=1 (any dev) -> Triton kernel; on CPU tensors it runs in Triton's
                                    interpreter (slow; meant for tests)

Interpreter mode. Triton decides between compiling and interpreting when `@triton.jit`
decorates a function (it reads TRITON_INTERPRET then), so the env var alone is fragile:
if any module decorated our kernels before a test set it, the kernels would be compiled
for a GPU that isn't there. `launch` therefore picks per call: CPU tensors always go
through an `InterpretedFunction` built from the kernel's Python source, whatever
TRITON_INTERPRET said at import, and calls to other `@triton.jit` functions made inside
a kernel (triton.language's own tl.sum, tl.max, ... are such functions) are routed to
the interpreter for the duration of that launch. TRITON_INTERPRET=1 is then not needed
for CPU runs at all; setting it early (tests do) is harmless.
"""
from __future__ import annotations

import functools
import os
import threading

import torch

ENV_FORCE = "JOBRUNNER_TRITON"


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install (missing driver libs)
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    """True when the op on tensor `t` should take the Triton path (see module doc)."""
    if t.is_cuda:
        return triton_available()
    return os.environ.get(ENV_FORCE, "") == "1" and triton_available()


_interpreted: dict = {}
_interpret_lock = threading.Lock()


def launch(kernel, grid, device: torch.device, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs), compiled on CUDA, interpreted elsewhere."""
    if device.type == "cuda":
        if device.index is not None and device.index != torch.cuda.current_device():
            with torch.cuda.device(device):
                kernel[grid](*args, **kwargs)
        else:
            kernel[grid](*args, **kwargs)
        return
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    def interpreted(jit_fn):
        if isinstance(jit_fn, InterpretedFunction):
            return jit_fn
        # keyed by id: a JITFunction hashes by its compile cache key, which fails here
        entry = _interpreted.get(id(jit_fn))
        if entry is None or entry[0] is not jit_fn:
            entry = _interpreted[id(jit_fn)] = (jit_fn, InterpretedFunction(jit_fn.fn))
        return entry[1]

    # triton.language's own helpers (tl.sum, tl.max, tl.sigmoid, ...) are @triton.jit
    # functions decorated when triton was imported; unless TRITON_INTERPRET was set then,
    # they are JITFunctions, whose __call__ refuses to run outside a compiled kernel.
    # Route those calls through the interpreter for the duration of this launch only.
    # (A lock: two threads patching and restoring in turn could leave the patch in place.)
    with _interpret_lock:
        original_call = JITFunction.__call__
        JITFunction.__call__ = lambda self, *a, **k: interpreted(self)(*a, **k)
        try:
            interpreted(kernel)[grid](*args, **kwargs)
        finally:
            JITFunction.__call__ = original_call


# ----------------------------------------------------------------------------- checks

def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_float(name: str, t: torch.Tensor) -> None:
    check(t.dtype in FLOAT_DTYPES, f"{name}: dtype {t.dtype} not supported (float16, bfloat16, float32)")


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    devs = {n: t.device for n, t in tensors.items()}
    first = next(iter(devs.values()))
    check(all(d == first for d in devs.values()), f"tensors on different devices: {devs}")
    return first


def check_last_contiguous(name: str, t: torch.Tensor) -> None:
    check(t.shape[-1] <= 1 or t.stride(-1) == 1, f"{name}: last dimension must be contiguous (stride 1), "
          f"got strides {tuple(t.stride())}")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
