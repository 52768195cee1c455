"""Group-wise int4 matmul on CPU over the packed 4-bit weights: no float copy of the weight, ever.

The old CPU path (quant_matmul._int4_matmul_cpu) dequantizes the weight a slice of rows at a time at every
call and runs F.linear on the float slice: at decode it writes and reads 8x the int4 bytes as float32 each
step. Here a small C kernel (cpu_int4.c beside this file: its comment has the loops and the work split) widens
the nibbles in registers and dequantizes them there (q * s + z): at decode it multiplies them into up to 8
activation rows at once; from 24 rows (prefill) it dequantizes a 128 x 32 panel into L1 and runs an outer
product over it as a float GEMM does, at oneDNN's float32 rate. Threads split the output columns. It takes
our int4 layout (quant_matmul.py's module doc), so
it serves every int4 linear: our `--quantization int4`, GGUF Q4_0/Q4_1 loaded as int4, and the shipped
W4A16 / GPTQ / AWQ linears (engine/shipped/build.py turns them into that layout; act order arrives with
its columns already permuted, the activations once per call: engine/shipped/shipped_linear.PermutedInput).

Built like the decode attention's kernel (kernels/attention/cpu_attention.py): plain C, OpenMP, compiled
with the system's C compiler at first use and loaded through ctypes; where the library is kept and when it
is built belong to engine/run/cpu_kernel_build.py. Two builds: "native" (-march=native: the AVX-512 loop
where the CPU has it) and "portable" (no -march: the plain C loop on any CPU; also what a native build
runs for a group size that is not a multiple of 32).

Activations float32: arithmetic float32, so a result differs from the dequantized reference (int4_matmul_ref)
by the order of the sum only: RTOL/ATOL below. Bfloat16 activations: the same library's bf16 form
(cpu_int4_bf16.c, built in with cpu_int4.c: int4_bf16_matmul_cpu) where the CPU has AVX512_BF16, exact
products of bfloat16 and nibble summed by vdpbf16ps at twice float32's FMA rate (1.3-1.9x the float32 kernel
from 16 rows, 1.1-1.6x at 8: RESULTS.md); elsewhere bfloat16 calls are widened to float32 at the edge.
"""
from __future__ import annotations

import ctypes
import hashlib
import re
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_int4.c")
BF16_SOURCE = SOURCE.with_name("cpu_int4_bf16.c")      # built in with it: the bf16 form
# -ffast-math is not used (see kernels/attention/cpu_attention.py: it would set flush-to-zero process-wide)
BASE_FLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared")
VARIANTS = {"native": ("-march=native",), "portable": ()}
LIBS = ("-lm",)
SCALE_DTYPES = (torch.float16, torch.float32)
PANEL_GROUPS, PANEL_COLUMNS = (32, 64, 128), 32     # cpu_int4.c's panel path: G dividing KB, N >= PW
# the bf16 form's rows per call at least, against the widened float32 kernel (AMD EPYC Zen 4, 2 threads, the
# default model's and a 1B model's shapes): at 1 row 0.8-1.0x, at 4 rows 0.8-1.3x (groups of 32) and 1.2-1.4x
# (groups of 128), at 8 rows 1.13-1.40x and 1.34-1.59x, at 16 1.3-1.7x
BF16_FORM_MIN_ROWS = 8
RTOL, ATOL = 1e-4, 1e-4          # against int4_matmul_ref in float32, relative to the row's max |out|


def flags(variant: str) -> tuple[str, ...]:
    return BASE_FLAGS + VARIANTS[variant]


def compile_command(source: Path, cc: list[str], output: Path, variant: str) -> list[str]:
    """The compiler's argv that builds a kernel of this family (int4, int8) at output (the caller runs it)."""
    return [*cc, *flags(variant), str(source), "-o", str(output), *LIBS]


def library_name(source: Path, variant: str) -> str:
    """A kernel library's file name, a hash of its source, the local headers it includes and the flags: a stale
    build is never loaded."""
    text = source.read_bytes()
    headers = b"".join(source.with_name(h.decode()).read_bytes() for h in re.findall(rb'#include "([^"]+)"', text))
    digest = hashlib.sha256(text + headers + " ".join(flags(variant) + LIBS).encode()).hexdigest()[:12]
    return f"{source.stem}-{variant}-{digest}.so"


def int4_compile_command(cc: list[str], output: Path, variant: str = "native") -> list[str]:
    """One library of both sources: cpu_int4.c's loops and cpu_int4_bf16.c's bf16 form."""
    argv = compile_command(SOURCE, cc, output, variant)
    at = argv.index(str(SOURCE)) + 1
    return argv[:at] + [str(BF16_SOURCE)] + argv[at:]


def int4_library_name(variant: str = "native") -> str:
    """library_name's hash over both sources and the headers they include: a stale build is never loaded."""
    name = library_name(SOURCE, variant)
    digest = hashlib.sha256(name.encode() + library_name(BF16_SOURCE, variant).encode()).hexdigest()[:12]
    return f"{SOURCE.stem}-{variant}-{digest}.so"


class Int4Library:
    """The compiled kernel, loaded. isa: "avx512" or "portable" (the loop this build runs for G % 32 == 0);
    portable=True makes a native build run its portable loop too (tests compare the two)."""

    def __init__(self, path: Path, portable: bool = False, bf16_form: bool = True):
        lib = ctypes.CDLL(str(path))
        ptr, i32 = ctypes.c_void_p, ctypes.c_int
        fn = lib.int4_matmul
        fn.argtypes = [ptr, ctypes.c_int64, ptr, ptr, ptr, i32, ptr, ptr] + [i32] * 7
        fn.restype = i32
        self.bf16_function = lib.int4_bf16_matmul
        self.bf16_function.argtypes = [ptr, ctypes.c_int64, ptr, ptr, ptr, i32, ptr, ptr] + [i32] * 7
        self.bf16_function.restype = i32
        lib.int4_kernel_isa.restype = lib.int4_bf16_isa.restype = i32
        self.function, self.path, self.portable = fn, path, portable
        self.isa = "avx512" if lib.int4_kernel_isa() and not portable else "portable"
        # the bf16 form (cpu_int4_bf16.c): where the build has AVX512_BF16, unless told not to (tests compare)
        self.bf16 = bool(lib.int4_bf16_isa()) and not portable and bf16_form

    def panel_path(self, n: int, group_size: int) -> bool:
        """Whether calls past PANEL_MIN_ROWS rows run the panel path (cpu_int4.c), as fast as oneDNN's float32 at
        prefill sizes, rather than the tile loop."""
        return self.isa == "avx512" and group_size in PANEL_GROUPS and n >= PANEL_COLUMNS

    def covers(self, x: torch.Tensor, scales: torch.Tensor) -> bool:
        """Whether the kernel takes this call (else the caller's torch path serves)."""
        return x.device.type == "cpu" and x.dtype == torch.float32 and scales.dtype in SCALE_DTYPES

    def covers_bf16(self, x: torch.Tensor, n: int, group_size: int, scales: torch.Tensor) -> bool:
        """Whether the bf16 form takes this bfloat16 call: AVX512_BF16, groups of 32, 64 or 128, whole panels of
        columns, BF16_FORM_MIN_ROWS rows or more."""
        return (self.bf16 and x.device.type == "cpu" and x.dtype == torch.bfloat16 and scales.dtype in SCALE_DTYPES
                and group_size in PANEL_GROUPS and n % PANEL_COLUMNS == 0
                and x.numel() >= BF16_FORM_MIN_ROWS * x.shape[-1])


def int4_matmul_cpu(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    group_size: int, bias: torch.Tensor | None, lib: Int4Library) -> torch.Tensor:
    """x: [..., K] float32; packed [N, Kp // 2] uint8; scales, zeros [N, Kp // G] float16 or float32 (zeros
    None: symmetric, W = (q - 8) * s) -> [..., N] float32."""
    n, kp = check_int4_arguments("int4_matmul_cpu", x, torch.float32, packed, scales, zeros, group_size)
    return run_over_rows("int4", x, n, bias, lambda x2, stride, b, out: lib.function(
        x2.data_ptr(), stride, packed.data_ptr(), scales.data_ptr(), None if zeros is None else zeros.data_ptr(),
        int(scales.dtype == torch.float32), b, out.data_ptr(), x2.shape[0], n, x.shape[-1], kp, group_size,
        torch.get_num_threads(), int(lib.portable)))


def int4_bf16_matmul_cpu(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                         group_size: int, bias: torch.Tensor | None, lib: Int4Library) -> torch.Tensor:
    """int4_matmul_cpu for x [..., K] bfloat16 through the bf16 form (lib.covers_bf16 says where it runs):
    summed in float32, rounded to bfloat16 once by the kernel -> [..., N] bfloat16."""
    n, kp = check_int4_arguments("int4_bf16_matmul_cpu", x, torch.bfloat16, packed, scales, zeros, group_size)
    return run_over_rows("int4_bf16", x, n, bias, lambda x2, stride, b, out: lib.bf16_function(
        x2.data_ptr(), stride, packed.data_ptr(), scales.data_ptr(), None if zeros is None else zeros.data_ptr(),
        int(scales.dtype == torch.float32), b, out.data_ptr(), 1, x2.shape[0], n, x.shape[-1], kp, group_size,
        torch.get_num_threads()), out_dtype=torch.bfloat16)


def check_int4_arguments(name: str, x: torch.Tensor, dtype: torch.dtype, packed: torch.Tensor,
                         scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int) -> tuple[int, int]:
    """(N, Kp) of a call to an int4 kernel; TypeError or ValueError naming what is wrong."""
    k = x.shape[-1]
    n, half = packed.shape
    kp = half * 2
    if x.dtype != dtype or packed.dtype != torch.uint8 or scales.dtype not in SCALE_DTYPES:
        raise TypeError(f"{name}: x {x.dtype} ({dtype}), packed {packed.dtype} (uint8), "
                        f"scales {scales.dtype} (float16 or float32)")
    if zeros is not None and (zeros.dtype != scales.dtype or zeros.shape != scales.shape):
        raise TypeError(f"{name}: zeros {zeros.dtype} {tuple(zeros.shape)} must match the scales")
    if group_size < 2 or group_size % 2 or kp % group_size or not kp - group_size < k <= kp \
            or scales.shape != (n, kp // group_size):
        raise ValueError(f"{name}: x [..., {k}], packed {tuple(packed.shape)}, scales "
                         f"{tuple(scales.shape)}, group {group_size}: want Kp = K rounded up to the group")
    if not (packed.is_contiguous() and scales.is_contiguous() and (zeros is None or zeros.is_contiguous())):
        raise ValueError(f"{name}: packed, scales and zeros contiguous")
    return n, kp


def run_over_rows(kind: str, x: torch.Tensor, n: int, bias: torch.Tensor | None, call,
                  out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A kernel of this family (int4, int8) over x [..., K]: its rows as an [M, K] view of unit column stride,
    the bias as float32, a fresh [M, N] output of out_dtype; call(x2, row stride, bias pointer or None, out)
    returns the kernel's code (0: done). -> [..., N]"""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    b = None if bias is None else bias.to(torch.float32).contiguous()
    out = torch.empty(x2.shape[0], n, dtype=out_dtype)
    stride = x2.stride(0) if x2.shape[0] > 1 else k
    if torch.autograd.profiler._is_profiler_enabled:     # named for the profiler, which can't see into it
        with torch.profiler.record_function(f"cpu_{kind}.matmul"):    # (entered always, it cost ~6 us a call)
            rc = call(x2, stride, None if b is None else b.data_ptr(), out)
    else:
        rc = call(x2, stride, None if b is None else b.data_ptr(), out)
    if rc != 0:
        raise ValueError(f"{kind}_matmul_cpu: the kernel refused its arguments ({rc})")
    return out.view(*x.shape[:-1], n)
