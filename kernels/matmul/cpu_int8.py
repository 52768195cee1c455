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
Activations float32 only, and at most CPU_INT8_MAX_ROWS rows a call without the panel path (others: the old
path); the activations are not quantized, so a result differs from the dequantized reference (int8_matmul_ref) by rounding only:
RTOL/ATOL below.

The same library multiplies fp8 (e4m3) weights (fp8_matmul_cpu: a shipped float-quantized checkpoint's
Fp8WeightLinear, per channel or per block scales): the .c's one difference is how 16 weights widen (through
float16, exactly). The reference there is dequantize_fp8 + F.linear (shipped_quant.py), within RTOL/ATOL too.
Beside it, for shipped_quant.fp8_weight_matmul: the scheme's activation fake-quantization (fake_quantize_fp8_cpu)
and float32 slices of the weight for calls past FP8_KERNEL_ROWS (fp8_dequantize_cpu), both bit for bit the
torch functions' values.

Where the scheme quantizes the activations to e4m3 too (FP8_DYNAMIC, FP8_BLOCK, static) and the CPU has
AVX512_BF16, the same library's bf16 form (cpu_fp8_dot.c, built in with cpu_int8.c: fp8_dot_cpu) multiplies
e4m3 by e4m3 in bfloat16 dot products: every e4m3 value is a bfloat16 and their products are exact in float32,
so it differs from the reference by float32 rounding only (RTOL/ATOL) at twice a float32 FMA's multiply-adds.
Int8Library.fp8_dot says whether a library has it (the portable build and portable=True never do).
"""
from __future__ import annotations

import ctypes
import hashlib
from pathlib import Path

import torch

from jobrunner.kernels.matmul.cpu_int4 import PANEL_COLUMNS, VARIANTS, compile_command, library_name, run_over_rows

SOURCE = Path(__file__).with_name("cpu_int8.c")
DOT_SOURCE, HEADER = SOURCE.with_name("cpu_fp8_dot.c"), SOURCE.with_name("cpu_e4m3.h")     # built in with it
RTOL, ATOL = 1e-4, 1e-4          # against the dequantized reference in float32, relative to the max |out|
# the kernel's rows per call at most where it has no panel path (Int8Library.panel_path): past it, dequantized
# slices on oneDNN (quant_matmul.sliced_linear) win over the tile loop: 1.0-1.2x at 128 rows, 1.1-1.4x at 256,
# 1.3-1.7x at 512 and 1.6-4.5x at 2,048 on the default model's and a 1B model's shapes; 2 threads, AMD EPYC.
# The panel path takes every row count (1.0-1.4x the slices at 512 and 2,048 rows, RESULTS.md)
CPU_INT8_MAX_ROWS = 128
# the fp8 form's rows per call at most without the panel path; more: a float32 slice of the weight dequantized
# by the library, then oneDNN (benchmarks/cpu_int8_bench.py --part fp8; RESULTS.md's fp8 section)
FP8_KERNEL_ROWS = 256
# bfloat16 rows: widened to float32 at the kernel's edge up to this many (2.5-4x bfloat16 slices + F.linear at 1
# row, 1.3x at 16, 0.6-1.0x at 64: a /tmp script beside RESULTS.md's fp8 figures)
FP8_BF16_KERNEL_ROWS = 16
# bfloat16 calls on symmetric int8 weights from this many rows take the bf16 dot form (int8_dot_bf16_cpu); against
# the int8 kernel widened to float32 (AMD EPYC Zen 4, 2 threads; 576 x 49152 and a 1B model's shapes): 0.6-1.3x at
# 1-4 rows, 0.97-1.26x at 8, 1.21-1.32x at 16, 1.36-1.47x at 64
INT8_DOT_MIN_ROWS = 16

def int8_compile_command(cc: list[str], output: Path, variant: str = "native") -> list[str]:
    """One library of both sources: cpu_int8.c's forms and cpu_fp8_dot.c's (the bf16 fp8 form)."""
    argv = compile_command(SOURCE, cc, output, variant)
    at = argv.index(str(SOURCE)) + 1
    return argv[:at] + [str(DOT_SOURCE)] + argv[at:]


def int8_library_name(variant: str = "native") -> str:
    """cpu_int4.library_name's hash, over every file the library is built from: a stale build is never loaded."""
    name = library_name(SOURCE, variant)
    digest = hashlib.sha256(name.encode() + b"".join(p.read_bytes() for p in (DOT_SOURCE, HEADER))).hexdigest()[:12]
    return f"{SOURCE.stem}-{variant}-{digest}.so"


class Int8Library:
    """The compiled kernel, loaded. isa: "avx512" or "portable" (the loop this build runs per channel and for
    groups of a multiple of 16); portable=True makes a native build run its portable loop too (tests compare).
    fp8_dot: whether fp8 calls with e4m3 activations may take the bf16 form (fp8_dot_cpu); fp8_dot=False keeps
    them on the float32 fp8 form."""

    def __init__(self, path: Path, portable: bool = False, fp8_dot: bool = True):
        lib = ctypes.CDLL(str(path))
        ptr, i32 = ctypes.c_void_p, ctypes.c_int
        fn = lib.int8_matmul
        fn.argtypes = [ptr, ctypes.c_int64, ptr, ptr, ptr, ptr, ptr] + [i32] * 6
        fn.restype = i32
        lib.int8_kernel_isa.restype = i32
        self.fp8 = lib.fp8_matmul
        self.fp8.argtypes = [ptr, ctypes.c_int64, ptr, ptr, ptr, ptr] + [i32] * 7
        self.fp8.restype = i32
        self.fake_quantize = lib.fp8_fake_quantize
        self.fake_quantize.argtypes = [ptr, ctypes.c_int64, ptr, i32, i32, i32, ptr, i32]
        self.fake_quantize.restype = i32
        self.dequantize = lib.fp8_dequantize
        self.dequantize.argtypes = [ptr, ptr, ptr] + [i32] * 7
        self.dequantize.restype = i32
        self.dot, self.dot_quantize, self.dot_widen = lib.fp8_dot_matmul, lib.fp8_dot_quantize, lib.fp8_dot_widen
        self.dot.argtypes = [ptr, ctypes.c_int64, ptr, i32, ptr, ptr, i32, i32, ptr, ptr] + [i32] * 4
        self.dot_bf16 = lib.fp8_dot_matmul_bf16
        self.dot_bf16.argtypes = [ptr, ctypes.c_int64, ptr, i32, ptr, i32, i32, ptr, ptr] + [i32] * 4
        self.dot_bf16.restype = i32
        self.dot_quantize.argtypes = [ptr, ctypes.c_int64, ptr, ptr, i32, i32, i32, ptr, i32]
        self.dot_widen.argtypes = [ptr, ptr, i32]
        for f in (self.dot, self.dot_quantize, self.dot_widen, lib.fp8_dot_isa):
            f.restype = i32
        self.function, self.path, self.portable = fn, path, portable
        self.isa = "avx512" if lib.int8_kernel_isa() and not portable else "portable"
        # the bf16 fp8 form (cpu_fp8_dot.c): where the build has AVX512_BF16, unless told not to (tests compare)
        self.fp8_dot = bool(lib.fp8_dot_isa()) and not portable and fp8_dot

    def panel_path(self, n: int, group: int, affine: bool) -> bool:
        """Whether calls of 16 rows and more run the panel path (cpu_panel.h), at oneDNN float32's rate at prefill
        sizes, so the kernel is worth any number of rows: AVX-512, 32 columns or more, and per channel scales or
        groups of a multiple of 16 (affine: groups or zeros, dequantized in the panel)."""
        return self.isa == "avx512" and n >= PANEL_COLUMNS and (not affine or group % 16 == 0)

    def fp8_panel_path(self, n: int, k: int, block: tuple[int, int] | None) -> bool:
        """panel_path for an fp8 weight [n, k]: block scales dequantize in the panel where a row has two groups or
        more (cpu_int8.c's affine), per channel ones at the end."""
        return self.panel_path(n, block[1] if block else k, block is not None and -(-k // block[1]) > 1)

    def panel_path_for(self, k: int, scales: torch.Tensor, zeros: torch.Tensor | None) -> bool:
        """panel_path for an int8 weight of K columns with these scales [N, groups] and zeros."""
        groups = scales.shape[-1]
        return self.panel_path(scales.shape[0], k // groups, groups > 1 or zeros is not None)

    def takes(self, x: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None) -> bool:
        """Whether the kernel serves this call (else the caller's torch path does)."""
        k = x.shape[-1]
        return (x.device.type == "cpu" and x.dtype == torch.float32 and scales.dtype == torch.float32
                and (zeros is None or zeros.dtype == torch.float32)
                and (x.numel() <= CPU_INT8_MAX_ROWS * k or self.panel_path_for(k, scales, zeros)))

    def takes_bf16_dot(self, x: torch.Tensor, zeros: torch.Tensor | None) -> bool:
        """Whether a bfloat16 call on a symmetric int8 weight runs the bf16 dot form (int8_dot_bf16_cpu): AVX512_BF16
        and INT8_DOT_MIN_ROWS rows or more."""
        return (self.fp8_dot and zeros is None and x.device.type == "cpu" and x.dtype == torch.bfloat16
                and x.numel() >= INT8_DOT_MIN_ROWS * x.shape[-1])

    def serves_fp8(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> bool:
        """Whether the library's fp8 functions serve this call (shipped_quant.fp8_weight_matmul: which of them)."""
        return (x.device.type == "cpu" and qweight.device.type == "cpu" and scales.dtype == torch.float32
                and qweight.is_contiguous() and scales.is_contiguous())


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


def fp8_matmul_cpu(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] | None,
                   bias: torch.Tensor | None, lib: Int8Library) -> torch.Tensor:
    """x: [..., K] float32; qweight [N, K] float8_e4m3fn; scales float32 [N, 1] (block None: per channel) or
    [ceil(N / bn), ceil(K / bk)] (block (bn, bk)) -> [..., N] float32."""
    k = x.shape[-1]
    n = qweight.shape[0]
    bn, bk = _fp8_weight_checked("fp8_matmul_cpu", x, qweight, scales, block)
    return run_over_rows("fp8", x, n, bias, lambda x2, stride, b, out: lib.fp8(
        x2.data_ptr(), stride, qweight.data_ptr(), scales.data_ptr(), b, out.data_ptr(), x2.shape[0], n, k, bk,
        bn, torch.get_num_threads(), int(lib.portable)))


def fp8_dot_bf16_cpu(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] | None,
                     bias: torch.Tensor | None, lib: Int8Library) -> torch.Tensor:
    """x [..., K] bfloat16 of a weight-only fp8 linear, taken as it is, times the e4m3 weight in bfloat16 dot
    products (cpu_fp8_dot.c: exact products, summed in float32) -> [..., N] bfloat16, rounded once."""
    _has_dot_form("fp8_dot_bf16_cpu", lib)
    bn, bk = _fp8_weight_checked("fp8_dot_bf16_cpu", x, qweight, scales, block, torch.bfloat16)
    return _dot_bf16(x, qweight, False, scales, bk, bn, bias, lib)


def int8_dot_bf16_cpu(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                      lib: Int8Library) -> torch.Tensor:
    """x [..., K] bfloat16 times a symmetric int8 weight (qweight [N, K] int8, scales [N, K // G] float32: per
    channel or groups of G) through the bf16 dot form (cpu_fp8_dot.c: an int8 value is exactly a bfloat16, so
    the products are exact and summed in float32) -> [..., N] bfloat16, rounded once."""
    _has_dot_form("int8_dot_bf16_cpu", lib)
    n, k = qweight.shape
    if x.dtype != torch.bfloat16 or qweight.dtype != torch.int8 or scales.dtype != torch.float32 \
            or x.shape[-1] != k or scales.dim() != 2 or scales.shape[0] != n or k % scales.shape[1]:
        raise TypeError(f"int8_dot_bf16_cpu: x {x.dtype} [..., {x.shape[-1]}] (bfloat16), qweight {qweight.dtype} "
                        f"{tuple(qweight.shape)} (int8), scales {scales.dtype} {tuple(scales.shape)} (float32 [N, G])")
    if not (qweight.is_contiguous() and scales.is_contiguous()):
        raise ValueError("int8_dot_bf16_cpu: qweight and scales contiguous")
    return _dot_bf16(x, qweight, True, scales, k // scales.shape[1], 1, bias, lib)


def _has_dot_form(where: str, lib: Int8Library) -> None:
    if not lib.fp8_dot:
        raise RuntimeError(f"{where}: {lib.path.name} has no bf16 form here (no AVX512_BF16, or turned off)")


def _dot_bf16(x: torch.Tensor, qweight: torch.Tensor, int8: bool, scales: torch.Tensor, group: int, block_rows: int,
              bias: torch.Tensor | None, lib: Int8Library) -> torch.Tensor:
    """fp8_dot_matmul_bf16 over checked arguments: x [..., K] bfloat16 as it is, qweight [N, K] e4m3 or int8 (int8),
    scales over blocks of block_rows x group -> [..., N] bfloat16."""
    n, k = qweight.shape
    return run_over_rows("dot_bf16", x, n, bias, lambda x2, stride, b, out: lib.dot_bf16(
        x2.data_ptr(), stride, qweight.data_ptr(), int(int8), scales.data_ptr(), group, block_rows, b,
        out.data_ptr(), x2.shape[0], n, k, torch.get_num_threads())).to(torch.bfloat16)


def _fp8_weight_checked(where: str, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       block: tuple[int, int] | None, dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """(bn, bk) of an fp8 call whose arguments the library takes (x of `dtype`); TypeError / ValueError otherwise."""
    k = x.shape[-1]
    n = qweight.shape[0]
    if x.dtype != dtype or qweight.dtype != torch.float8_e4m3fn or scales.dtype != torch.float32:
        raise TypeError(f"{where}: x {x.dtype} ({dtype}), qweight {qweight.dtype} (float8_e4m3fn), "
                        f"scales {scales.dtype} (float32)")
    bn, bk = (1, k) if block is None else block
    if qweight.shape[1] != k or scales.shape != (-(-n // bn), -(-k // bk)):
        raise ValueError(f"{where}: x [..., {k}], qweight {tuple(qweight.shape)}, scales "
                         f"{tuple(scales.shape)}, block {block}: want qweight [N, K], scales [N, 1] or the "
                         f"block grid")
    if not (qweight.is_contiguous() and scales.is_contiguous()):
        raise ValueError(f"{where}: qweight and scales contiguous")
    return bn, bk


def fp8_dot_quantize_cpu(x2: torch.Tensor, static_scale: torch.Tensor | None, group: int | None,
                         lib: Int8Library) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 [M, K] float32 (unit column stride) -> (its e4m3 values as bfloat16 [M, K], their float32 scales
    [M, K // G]): per token, per group of `group` columns, or static_scale (per tensor, then [M, 1]).
    xq.float() * xs is fake_quantize_fp8's result bit for bit."""
    m, k = x2.shape
    g = k if static_scale is not None or group is None else group
    if x2.dtype != torch.float32 or x2.stride(1) != 1 or k % g:
        raise ValueError(f"fp8_dot_quantize_cpu: x2 {x2.dtype} [{m}, {k}] column stride {x2.stride(1)}, groups "
                         f"of {g}: want float32, stride 1, K a multiple of the group")
    s = None if static_scale is None else static_scale.to(torch.float32).reshape(1).contiguous()
    xq, xs = torch.empty(m, k, dtype=torch.bfloat16), torch.empty(m, k // g, dtype=torch.float32)
    rc = lib.dot_quantize(x2.data_ptr(), x2.stride(0) if m > 1 else k, xq.data_ptr(), xs.data_ptr(), m, k, g,
                          None if s is None else s.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"fp8_dot_quantize_cpu: the kernel refused [{m}, {k}] in groups of {g} ({rc})")
    return xq, xs


def fp8_dot_cpu(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] | None,
                bias: torch.Tensor | None, static_scale: torch.Tensor | None, act_group: int | None,
                lib: Int8Library) -> torch.Tensor:
    """x [..., K] float32, its activations quantized to e4m3 (fp8_dot_quantize_cpu: per token, per group of
    act_group columns, or static_scale), times the e4m3 weight (fp8_matmul_cpu's layouts) in bfloat16 dot
    products (cpu_fp8_dot.c) -> [..., N] float32: fp8_weight_matmul_ref with that act within RTOL/ATOL."""
    if not lib.fp8_dot:
        raise RuntimeError(f"fp8_dot_cpu: {lib.path.name} has no bf16 form here (no AVX512_BF16, or turned off)")
    n, k = qweight.shape[0], x.shape[-1]
    bn, bk = _fp8_weight_checked("fp8_dot_cpu", x, qweight, scales, block)
    s = None if static_scale is None else static_scale.to(torch.float32).reshape(1).contiguous()
    group = k if s is not None or act_group is None else act_group
    if k % group:
        raise ValueError(f"fp8_dot_cpu: activation groups of {act_group} do not divide K = {k}")
    return run_over_rows("fp8_dot", x, n, bias, lambda x2, stride, b, out: lib.dot(
        x2.data_ptr(), stride, None if s is None else s.data_ptr(), group, qweight.data_ptr(), scales.data_ptr(),
        bk, bn, b, out.data_ptr(), x2.shape[0], n, k, torch.get_num_threads()))


def fp8_dot_widen_cpu(q: torch.Tensor, lib: Int8Library) -> torch.Tensor:
    """e4m3 bytes (any shape, contiguous) -> bfloat16 through the bf16 form's own widening (tests read it)."""
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    if not q.is_contiguous() or lib.dot_widen(q.data_ptr(), out.data_ptr(), q.numel()) != 0:
        raise RuntimeError("fp8_dot_widen_cpu: no bf16 form in this build, or q not contiguous")
    return out


def fake_quantize_fp8_cpu(x2: torch.Tensor, static_scale: torch.Tensor | None, group: int | None,
                          lib: Int8Library) -> torch.Tensor:
    """shipped_quant.fake_quantize_fp8 in the library, bit for bit: x2 [M, K] float32 (unit column stride) ->
    a fresh [M, K] float32; per token, per group of `group` columns, or the static per-tensor scale."""
    m, k = x2.shape
    if x2.dtype != torch.float32 or x2.stride(1) != 1:
        raise TypeError(f"fake_quantize_fp8_cpu: x2 {x2.dtype} with column stride {x2.stride(1)}: want float32, 1")
    s = None if static_scale is None else static_scale.to(torch.float32).reshape(1).contiguous()
    out = torch.empty(m, k, dtype=torch.float32)
    rc = lib.fake_quantize(x2.data_ptr(), x2.stride(0) if m > 1 else k, out.data_ptr(), m, k, group or k,
                           None if s is None else s.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"fake_quantize_fp8_cpu: the kernel refused [{m}, {k}] in groups of {group} ({rc})")
    return out


def fp8_dequantize_cpu(qweight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] | None, rows: slice,
                       lib: Int8Library, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `rows` of W = q * scale as float32, bit for bit shipped_quant.dequantize_fp8's (float32 scales);
    written into the front of scratch (float32, contiguous) where given, else into a fresh tensor."""
    n, k = qweight.shape
    bn, bk = (1, k) if block is None else block
    r0, r1, _ = rows.indices(n)
    if qweight.dtype != torch.float8_e4m3fn or scales.dtype != torch.float32 or \
            scales.shape != (-(-n // bn), -(-k // bk)) or not (qweight.is_contiguous() and scales.is_contiguous()):
        raise ValueError(f"fp8_dequantize_cpu: qweight {qweight.dtype} {tuple(qweight.shape)}, scales "
                         f"{scales.dtype} {tuple(scales.shape)}, block {block}")
    size = max(r1 - r0, 0) * k
    if scratch is not None and scratch.numel() >= size and scratch.dtype == torch.float32 and scratch.is_contiguous():
        out = scratch.view(-1)[:size].view(-1, k)
    else:
        out = torch.empty(max(r1 - r0, 0), k, dtype=torch.float32)
    rc = lib.dequantize(qweight.data_ptr(), scales.data_ptr(), out.data_ptr(), r0, max(r0, r1), k, bk, bn,
                        torch.get_num_threads(), int(lib.portable))
    if rc != 0:
        raise ValueError(f"fp8_dequantize_cpu: the kernel refused rows {r0}:{r1} ({rc})")
    return out
