"""Where the CPU quantized matmuls (kernels/matmul/cpu_int4.py and cpu_int8.py, each with its .c) are compiled,
kept and loaded, and which linears run them: the process side of kernels that kernels/ keeps as plain functions.

Each library sits beside the decode attention's, under <cache>/kernels/<cpu>/ (engine/run/cpu_decode.py: the
same compiler, the same build to a temporary name then a rename), its name a hash of the source and the flags.
After a CPU model is built (and quantized), attach_cpu_kernels hands each kernel to the linears it serves:
the int4 one to every Int4Linear (ours, GGUF Q4_0/Q4_1, the shipped W4A16 / GPTQ / AWQ ones), the int8 one
to every weight-only Int8Linear (`--quantization int8`, GGUF Q8_0, a shipped int8 checkpoint's, and the
lm_head of int4 mode), the int8 library's fp8 form to every fp8 linear of a shipped float-quantized
checkpoint (Fp8WeightLinear: per channel or block scales; with e4m3 activations, bfloat16 dot products where
the CPU has them: kernels/matmul/cpu_fp8_dot.c), and the
w4a8 one to every W4A8Linear (`--quantization w4a8`: it repacks the nibbles into its layout once). Each
linear then runs its kernel for the float32 calls the kernel takes (decode-sized ones) and its old path
(dequantize a slice, F.linear) otherwise. A model without such linears builds nothing; where no compiler
works, one warning says so and those linears keep the old path.

The float32 panel kernel (kernels/matmul/cpu_f32.c) is not handed to linears here: packed_weights.pack_linears
packs each float32 linear into its panels when panel_kernel() has it.

JOBRUNNER_CPU_INT4, JOBRUNNER_CPU_INT8, JOBRUNNER_CPU_FP8, JOBRUNNER_CPU_W4A8 and JOBRUNNER_CPU_F32: auto (the -march=native build, the default),
portable (the plain C build, no -march: its loop runs on any CPU; f32 has none, so oneDNN) or off (the old
path only); read when a model is built.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from jobrunner.engine.quant.linear import Int4Linear, Int8Linear, W4A8Linear
from jobrunner.engine.run.cpu_decode import build_library, env_mode, library_path
from jobrunner.engine.shipped.shipped_linear import Fp8WeightLinear
from jobrunner.kernels.ops import (F32Library, Int4Library, Int8Library, PackedLinear, W4A8Library, f32_compile_command,
                                   f32_library_name, int4_compile_command, int4_library_name, int8_compile_command,
                                   int8_library_name, w4a8_compile_command, w4a8_library_name)

MODES = ("auto", "portable", "off")
log = logging.getLogger("jobrunner")


@dataclass(frozen=True)
class CpuMatmulKernel:
    """One C matmul kernel and the linears it serves."""
    name: str                                    # "int4": in messages
    env: str                                     # its switch
    library_name: Callable[[str], str]           # variant -> file name
    compile_command: Callable                    # (cc, output, variant) -> argv
    load: Callable[[Path], object]               # path -> the loaded library
    linear: type                                 # the module class it serves
    weight: str                                  # that module's weight buffer (its device decides)
    float32: tuple[str, ...] = ()                # buffers the kernel reads as float32 (an exact upcast)
    takes_layout: bool = False                   # the linear repacks its buffers for the kernel: m.use_kernel(lib)
    without: str = ""                            # what its linears do where it is missing (the warning's end)


INT4 = CpuMatmulKernel("int4", "JOBRUNNER_CPU_INT4", int4_library_name, int4_compile_command, Int4Library,
                       Int4Linear, "packed")
INT8 = CpuMatmulKernel("int8", "JOBRUNNER_CPU_INT8", int8_library_name, int8_compile_command, Int8Library,
                       Int8Linear, "qweight", float32=("scales", "zeros"))
FP8 = CpuMatmulKernel("fp8", "JOBRUNNER_CPU_FP8", int8_library_name, int8_compile_command, Int8Library,
                      Fp8WeightLinear, "qweight", float32=("scales",))     # the int8 library, its fp8 form
W4A8 = CpuMatmulKernel("w4a8", "JOBRUNNER_CPU_W4A8", w4a8_library_name, w4a8_compile_command, W4A8Library,
                       W4A8Linear, "packed", takes_layout=True)
KERNELS = (INT4, INT8, FP8, W4A8)
# the float32 panel form of the packed linears: handed to packed_weights.pack_linears, which packs for it
F32 = CpuMatmulKernel("f32", "JOBRUNNER_CPU_F32", f32_library_name, f32_compile_command, F32Library, PackedLinear,
                      "weight", without="float32 linears keep oneDNN's packed weights (slower at decode sizes)")


def panel_kernel() -> F32Library | None:
    """The float32 panel kernel where its switch allows it and the build runs it (AVX-512), else None."""
    lib = kernel_library(F32)
    return lib if lib is not None and lib.isa != "none" else None


def kernel_mode(kernel: CpuMatmulKernel) -> str:
    return env_mode(kernel.env, MODES)


def kernel_library_path(kernel: CpuMatmulKernel, variant: str) -> Path:
    return library_path().parent / kernel.library_name(variant)


def ensure_kernel_library(kernel: CpuMatmulKernel, variant: str = "native") -> Path:
    """The library's path, built first if absent (RuntimeError with the compiler's message when that fails)."""
    path = kernel_library_path(kernel, variant)
    if not path.exists():
        build_library(path, lambda cc, out: kernel.compile_command(cc, out, variant))
    return path


@functools.lru_cache(maxsize=None)
def _loaded(kernel: CpuMatmulKernel, variant: str, cache: str):
    """One load per kernel, build and cache directory in a process; None (warned once) where it cannot build."""
    try:
        return kernel.load(ensure_kernel_library(kernel, variant))
    except Exception as e:   # noqa: BLE001 - no compiler, a compile error, a library this OS can't load
        log.warning("the CPU %s matmul is not available (%s); %s", kernel.name, e, kernel.without or
                    f"{kernel.name} linears convert a slice of their weight to float at every call instead (slower, "
                    "same results)")
        return None


def kernel_library(kernel: CpuMatmulKernel):
    """The library the kernel's switch asks for, loaded, or None (off, or it would not build)."""
    mode = kernel_mode(kernel)
    if mode == "off":
        return None
    return _loaded(kernel, "portable" if mode == "portable" else "native", str(library_path().parent))


def attach_cpu_kernels(model: nn.Module) -> dict[str, int]:
    """Hands each kernel's library to the model's CPU linears it serves; returns, by kernel, how many now run it."""
    return {kernel.name: _attach(kernel, model) for kernel in KERNELS}


def _attach(kernel: CpuMatmulKernel, model: nn.Module) -> int:
    linears = [m for m in model.modules()       # the exact class: a W4A8Linear is an Int4Linear of another kernel
               if type(m) is kernel.linear and getattr(m, kernel.weight).device.type == "cpu"]
    lib = kernel_library(kernel) if linears else None
    for m in linears:
        if lib is not None and kernel.takes_layout:
            m.use_kernel(lib)
            continue
        m.cpu_kernel = lib
        if lib is None:
            continue
        for name, t in m.named_buffers(recurse=False):    # the kernel reads rows in place (a GPTQ
            if name in kernel.float32 and t.is_floating_point() and t.dtype != torch.float32:
                t = t.float()                             # checkpoint's scales arrive transposed)
            if not t.is_contiguous():
                t = t.contiguous()
            if t is not getattr(m, name):
                setattr(m, name, t)
    return len(linears) if lib is not None else 0
