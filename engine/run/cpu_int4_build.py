"""Where the CPU int4 matmul (kernels/matmul/cpu_int4.py and .c) is compiled, kept and loaded, and which
int4 linears run it: the process side of a kernel that kernels/ keeps as plain functions.

The library sits beside the decode attention's, under <cache>/kernels/<cpu>/ (engine/run/cpu_decode.py: the
same compiler, the same build to a temporary name then a rename), its name a hash of the source and the
flags. After a CPU model is built (and quantized), attach_int4_kernel hands the loaded library to every
Int4Linear in it: ours (`--quantization int4`, GGUF Q4_0/Q4_1) and the shipped W4A16 / GPTQ / AWQ ones
alike; each then runs the kernel for float32 activations of up to CPU_INT4_MAX_ROWS rows and its old path
(dequantize a slice, F.linear) otherwise. A model without int4 linears builds nothing. Where no compiler
works, one warning says so and every int4 linear keeps the old path.

JOBRUNNER_CPU_INT4: auto (the -march=native build, the default), portable (the plain C build, no
-march: its loop runs on any CPU) or off (the old path only); read when a model is built.
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path

from torch import nn

from jobrunner.engine.quant.linear import Int4Linear
from jobrunner.engine.run.cpu_decode import build_library, env_mode, library_path
from jobrunner.kernels.ops import Int4Library, int4_compile_command, int4_library_name

MODES = ("auto", "portable", "off")
log = logging.getLogger("jobrunner")


def int4_mode() -> str:
    return env_mode("JOBRUNNER_CPU_INT4", MODES)


def int4_library_path(variant: str) -> Path:
    return library_path().parent / int4_library_name(variant)


def ensure_int4_library(variant: str = "native") -> Path:
    """The library's path, built first if absent (RuntimeError with the compiler's message when that fails)."""
    path = int4_library_path(variant)
    if not path.exists():
        build_library(path, lambda cc, out: int4_compile_command(cc, out, variant))
    return path


@functools.lru_cache(maxsize=None)
def _loaded(variant: str, cache: str) -> Int4Library | None:
    """One load per build and cache directory in a process; None (warned once) where it cannot build."""
    try:
        return Int4Library(ensure_int4_library(variant))
    except Exception as e:   # noqa: BLE001 - no compiler, a compile error, a library this OS can't load
        log.warning("the CPU int4 matmul is not available (%s); int4 linears dequantize a slice of their "
                    "weight at every call instead (slower, same results)", e)
        return None


def int4_library() -> Int4Library | None:
    """The library JOBRUNNER_CPU_INT4 asks for, loaded, or None (off, or it would not build)."""
    mode = int4_mode()
    if mode == "off":
        return None
    return _loaded("portable" if mode == "portable" else "native", str(library_path().parent))


def attach_int4_kernel(model: nn.Module) -> int:
    """Hands the int4 library to each of model's CPU Int4Linear modules; returns how many now run it."""
    linears = [m for m in model.modules() if isinstance(m, Int4Linear) and m.packed.device.type == "cpu"]
    lib = int4_library() if linears else None
    for m in linears:
        m.cpu_kernel = lib
        if lib is not None:     # the kernel reads rows in place (a GPTQ checkpoint's scales arrive transposed)
            for name in ("packed", "scales", "zeros"):
                t = getattr(m, name)
                if t is not None and not t.is_contiguous():
                    setattr(m, name, t.contiguous())
    return len(linears) if lib is not None else 0
