"""Weight-only int8 matmul on CPU over the int8 weights as Int8Linear stores them: no float copy of the weight.

The old CPU path (quant_matmul._int8_matmul_cpu) converts the weight to float at every call (a slice of rows at a
time, then F.linear): at decode it writes and reads 8x the int8 bytes as float32 each step, which made
`--quantization int8` slower than float32 and int4 mode's int8 lm_head (49152 x 576 on the default model) its
slowest op. Here a small C kernel (cpu_int8.c beside this file: its comment has the loop and the work split)
widens 16 weights at a time in registers and multiplies them into up to 8 float32 activation rows at once;
threads split the output columns. Every layout Int8Linear holds is taken: one scale per channel (ours, and the
lm_head of int4 mode), groups (GGUF Q8_0's 32, a shipped checkpoint's), with or without zeros (a shipped
asymmetric checkpoint's).

Built, kept and loaded like the int4 kernel (cpu_int4.py: the same flags and the two builds, "native" and
"portable"); engine/run/cpu_kernel_build.py builds it at first use and hands it to the int8 linears.
Activations float32 only and at most CPU_INT8_MAX_ROWS rows a call (others: the old path); the activations are
not quantized, so a result differs from the dequantized reference (int8_matmul_ref) by rounding only:
RTOL/ATOL below.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from jobrunner.kernels.matmul.cpu_int4 import VARIANTS, compile_command, library_name, run_over_rows

SOURCE = Path(__file__).with_name("cpu_int8.c")
RTOL, ATOL = 1e-4, 1e-4          # against the dequantized reference in float32, relative to the max |out|
# the kernel's rows per call at most: it beat the old path 1.1-2x at 512 rows on the default model's shapes and
# lost at 1,024-2,048 to oneDNN over a float slice of the weight (2 threads, AMD EPYC, RESULTS.md's int8 section)
CPU_INT8_MAX_ROWS = 512

def int8_compile_command(cc: list[str], output: Path, variant: str = "native") -> list[str]:
    return compile_command(SOURCE, cc, output, variant)


def int8_library_name(variant: str = "native") -> str:
    return library_name(SOURCE, variant)


class Int8Library:
    """The compiled kernel, loaded. isa: "avx512" or "portable" (the loop this build runs per channel and for
    groups of a multiple of 16); portable=True makes a native build run its portable loop too (tests compare)."""

    def __init__(self, path: Path, portable: bool = False):
        lib = ctypes.CDLL(str(path))
        ptr, i32 = ctypes.c_void_p, ctypes.c_int
        fn = lib.int8_matmul
        fn.argtypes = [ptr, ctypes.c_int64, ptr, ptr, ptr, ptr, ptr] + [i32] * 6
        fn.restype = i32
        lib.int8_kernel_isa.restype = i32
        self.function, self.path, self.portable = fn, path, portable
        self.isa = "avx512" if lib.int8_kernel_isa() and not portable else "portable"

    def takes(self, x: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None) -> bool:
        """Whether the kernel serves this call (else the caller's torch path does)."""
        return (x.device.type == "cpu" and x.dtype == torch.float32 and scales.dtype == torch.float32
                and (zeros is None or zeros.dtype == torch.float32) and x.numel() <= CPU_INT8_MAX_ROWS * x.shape[-1])


def int8_matmul_cpu(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    bias: torch.Tensor | None, lib: Int8Library) -> torch.Tensor:
    """x: [..., K] float32; qweight [N, K] int8; scales, zeros [N, K // G] float32 (zeros None: W = q s)
    -> [..., N] float32."""
    k = x.shape[-1]
    n = qweight.shape[0]
    if x.dtype != torch.float32 or qweight.dtype != torch.int8 or scales.dtype != torch.float32:
        raise TypeError(f"int8_matmul_cpu: x {x.dtype} (float32), qweight {qweight.dtype} (int8), "
                        f"scales {scales.dtype} (float32)")
    if zeros is not None and (zeros.dtype != scales.dtype or zeros.shape != scales.shape):
        raise TypeError(f"int8_matmul_cpu: zeros {zeros.dtype} {tuple(zeros.shape)} must match the scales")
    groups = scales.shape[1] if scales.dim() == 2 else 0
    if qweight.shape[1] != k or scales.dim() != 2 or scales.shape[0] != n or groups < 1 or k % groups:
        raise ValueError(f"int8_matmul_cpu: x [..., {k}], qweight {tuple(qweight.shape)}, scales "
                         f"{tuple(scales.shape)}: want qweight [N, K], scales [N, K // G]")
    if not (qweight.is_contiguous() and scales.is_contiguous() and (zeros is None or zeros.is_contiguous())):
        raise ValueError("int8_matmul_cpu: qweight, scales and zeros contiguous")
    return run_over_rows("int8", x, n, bias, lambda x2, stride, b, out: lib.function(
        x2.data_ptr(), stride, qweight.data_ptr(), scales.data_ptr(), None if zeros is None else zeros.data_ptr(),
        b, out.data_ptr(), x2.shape[0], n, k, k // groups, torch.get_num_threads(), int(lib.portable)))
