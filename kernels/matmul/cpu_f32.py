"""A float32 matmul on CPU over a weight packed once into panels of 32 columns (cpu_f32.c beside this file).

oneDNN's float32 over its own packed weight (cpu_linear.py) reads the weight well below the memory's rate at
decode sizes. This kernel streams each thread's panels once a call (threads split N) while blocks of up to 12
rows keep their sums in registers over a panel's k: on a 2-core AVX-512 EPYC 1.3-1.7x oneDNN's speed at one
row, 1.0-1.4x at 4 to 16, 0.93-1.04x from 256 (RESULTS.md: `python -m benchmarks.cpu_f32_bench`). The weight
is packed once at load and replaces oneDNN's copy (PackedLinear's panel form), so the model costs no more
memory.

Sum order: each out[m, n] is one float32 FMA chain over k in order, so a row's bits do not depend on the rows
beside it or the threads (batch-invariant at one row too, without oneDNN's two-row workaround), and differ
from F.linear's by rounding only (cpu_linear.packed_error's bound, checked at packing).

Built like the int4 and int8 kernels (cpu_int4.py's compile_command and library_name; engine/run/
cpu_kernel_build.py keeps and loads it). AVX-512 only: a build without it reports isa "none" and the linears
keep oneDNN.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from jobrunner.kernels.matmul.cpu_int4 import PANEL_COLUMNS, compile_command, library_name, run_over_rows

SOURCE = Path(__file__).with_name("cpu_f32.c")


def f32_compile_command(cc: list[str], output: Path, variant: str = "native") -> list[str]:
    return compile_command(SOURCE, cc, output, variant)


def f32_library_name(variant: str = "native") -> str:
    return library_name(SOURCE, variant)


class F32Library:
    """The compiled kernel, loaded. isa: "avx512" where the build runs the kernel, else "none"."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        ptr, i32 = ctypes.c_void_p, ctypes.c_int
        self.function = lib.f32_matmul
        self.function.argtypes = [ptr, ctypes.c_int64, ptr, ptr, ptr, i32, i32, i32, i32]
        self.function.restype = i32
        lib.f32_kernel_isa.restype = i32
        self.path = path
        self.isa = "avx512" if lib.f32_kernel_isa() else "none"


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float -> [ceil(N / 32), K, 32] float32 panels (columns past N zero), 64-byte aligned as
    the kernel's aligned loads need (torch's CPU allocator aligns to 64)."""
    n, k = weight.shape
    count, whole = -(-n // PANEL_COLUMNS), n // PANEL_COLUMNS
    w = weight.detach()
    panels = torch.empty(count, k, PANEL_COLUMNS, dtype=torch.float32)     # the one allocation (load's peak)
    panels[:whole].copy_(w[:whole * PANEL_COLUMNS].view(whole, PANEL_COLUMNS, k).transpose(1, 2))
    if whole < count:
        panels[whole].zero_()
        panels[whole, :, :n - whole * PANEL_COLUMNS].copy_(w[whole * PANEL_COLUMNS:].T)
    if panels.data_ptr() % 64:
        raise ValueError("pack_panels: torch's allocator returned memory not aligned to 64 bytes")
    return panels


def pad_bias(bias: torch.Tensor | None, panels: torch.Tensor) -> torch.Tensor | None:
    """bias [N] -> float32 [count * 32], zero past N (the kernel adds a whole panel's 32 at once)."""
    if bias is None:
        return None
    padded = torch.zeros(panels.shape[0] * PANEL_COLUMNS, dtype=torch.float32)
    padded[:bias.shape[0]] = bias.detach()
    return padded


def f32_matmul_cpu(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int,
                   lib: F32Library) -> torch.Tensor:
    """x [..., K] float32 @ the panels' weight [n, K].T (+ bias: pad_bias's) -> [..., n] float32."""
    count, k, width = panels.shape
    if x.dtype != torch.float32 or panels.dtype != torch.float32 or width != PANEL_COLUMNS:
        raise TypeError(f"f32_matmul_cpu: x {x.dtype}, panels {panels.dtype} {tuple(panels.shape)}: float32, "
                        f"[count, K, {PANEL_COLUMNS}]")
    if x.shape[-1] != k or not (count - 1) * PANEL_COLUMNS < n <= count * PANEL_COLUMNS or not panels.is_contiguous():
        raise ValueError(f"f32_matmul_cpu: x [..., {x.shape[-1]}] over panels {tuple(panels.shape)} for {n} "
                         "columns: want K equal and contiguous panels covering n")
    if bias is not None and (bias.dtype != torch.float32 or bias.numel() != count * PANEL_COLUMNS):
        raise ValueError(f"f32_matmul_cpu: bias {bias.dtype} of {bias.numel()}: want pad_bias's")
    if x.numel() == 0:
        return x.new_empty(*x.shape[:-1], n)
    return run_over_rows("f32", x, n, None, lambda x2, stride, _, out: lib.function(
        x2.data_ptr(), stride, panels.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
        x2.shape[0], n, k, torch.get_num_threads()))
