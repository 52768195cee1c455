"""Quantized matmuls: y = x @ W^T + b with W stored in 8 or 4 bits (or fp8), beside their references.

Weight layouts (W is [N, K] = [out_features, in_features], like nn.Linear.weight):

int8 (weight-only, symmetric):
    qweight: int8    [N, K]
    scales:  float32 [N, K // G]       G = K: one scale per output channel (our own quantization);
                                       G = 32: GGUF Q8_0 blocks, loaded as stored
    W[n, k] = qweight[n, k] * scales[n, k // G]

int4 (weight-only, group-wise with a zero point, two values a byte):
    packed:  uint8   [N, Kp // 2]      Kp = K rounded up to a multiple of G (pad columns hold 0)
    scales:  float16 [N, Kp // G]
    zeros:   float16 [N, Kp // G]      the value a 0 nibble stands for (GGUF Q4_1's "m"; the usual
                                       integer zero point z is -zeros / scales)
    W[n, k] = q[n, k] * scales[n, k // G] + zeros[n, k // G],   q in 0..15

    Nibble order inside a group (ggml's, so GGUF Q4_0/Q4_1 blocks are our bytes unchanged):

        bytes of group g:   b[0]          b[1]          ...  b[G/2 - 1]
        low nibble  ->      k = gG + 0    k = gG + 1    ...  k = gG + G/2 - 1
        high nibble ->      k = gG + G/2  k = gG + G/2+1 ...  k = gG + G - 1

    so a group unpacks with two whole-vector ops (b & 15, b >> 4) and no interleave, and the
    Triton kernel multiplies the low half and the high half of a group as two dense tiles.

w8a8 (int8 weights, int8 activations): qweight/scales as int8 per channel (G = K), weights in
    [-qmax, qmax] (qmax 127, or 63 where the CPU's int8 GEMM needs it: see int_mm_exact); x is
    quantized per token at run time (scale = max|x_row| / 127) and the product accumulates
    exactly in int32:  y[m, n] = sum_k xq[m, k] * qweight[n, k] * xscale[m] * scales[n].
    The fbgemm variant instead quantizes x per batch (one scale and zero point for the whole
    [M, K], 7-bit: reduce_range), as torch.ao's dynamic quantized Linear does.

fp8 (e4m3): qweight float8_e4m3fn [N, K], scales float32 [N, 1]; x is scaled per token into
    e4m3's range (max 448) at run time; torch._scaled_mm on CUDA GPUs of compute capability >= 8.9.

Dispatch (one function per op): int8/int4 take the Triton kernels on CUDA (or with
JOBRUNNER_TRITON=1, interpreted on CPU tensors); elsewhere they dequantize the weight to
x.dtype just in time, a slice of rows at a time, and run a float matmul, except int4 given the CPU
kernel (cpu_int4.py: the nibbles multiplied in registers, float32 calls; int4_matmul says which). On the CPUs we
measured, that beats torch's own weight-only int8/int4 CPU ops many times over (see
DESIGN.md): weight-only quantization on CPU buys memory, not speed. w8a8 is the CPU speed
mode: `torch._int_mm` where it is exact (oneDNN with AVX512-VNNI or AMX), else fbgemm's
dynamic quantized linear (see engine/quant/linear.py).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from jobrunner.kernels.common.triton_utils import use_triton
from jobrunner.kernels.matmul.cpu_int4 import Int4Library, int4_bf16_matmul_cpu, int4_matmul_cpu
from jobrunner.kernels.matmul.cpu_linear import dense_linear

FP8_MAX = 448.0                 # largest finite float8_e4m3fn
AMAX_FLOOR = 1e-8               # all-zero rows/tokens keep a finite scale
# CPU path: rows of W dequantized per slice, so the transient float copy stays small and cache-warm
CPU_DEQUANT_ELEMENTS = 1 << 20
# the CPU int4 kernel's rows per call at most where it has no panel path (Int4Library.panel_path: builds without
# AVX-512, group sizes other than 32, 64, 128): above it the sliced dequantization on oneDNN wins (2 threads, AMD
# EPYC: at 512 rows 1.1-1.2x the tile loop on three of four default-model and 1B shapes); the panel path takes
# every row count (at 512 and 2,048 rows 1.0-1.3x the slices, RESULTS.md)
CPU_INT4_MAX_ROWS = 256
# bfloat16 calls of up to this many rows run the float32 CPU kernels, widened at the edge (exactly) and rounded
# back once: the weight's bytes read once instead of a bfloat16 slice dequantized at every call (as fp8's
# FP8_BF16_KERNEL_ROWS); past it the bfloat16 slices on oneDNN
BF16_KERNEL_ROWS = 16


def widened_bf16(x: torch.Tensor, any_rows: bool = False) -> torch.Tensor | None:
    """x in float32 where it is a CPU bfloat16 call of up to BF16_KERNEL_ROWS rows (any_rows: of any size, for a
    kernel whose panel path runs at float32's GEMM rate), else None."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and (any_rows or x.numel() <= BF16_KERNEL_ROWS * x.shape[-1]):
        return x.float()
    return None


# ----------------------------------------------------------------------------- dequantize

def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, K] int8, [N, K // G] -> [N, K] dtype; computed in float32, rounded once."""
    n, k = qweight.shape
    groups = scales.shape[1]
    # int8 * float32 promotes to float32 in one pass (no separate int8 -> float copy)
    w = torch.mul(qweight.view(n, groups, k // groups), scales.float()[..., None])
    return w.view(n, k).to(dtype)


def unpack_int4(packed: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, Kp // 2] uint8 -> [N, Kp] uint8 nibble values 0..15 (the group layout above)."""
    n, half = packed.shape
    b = packed.view(n, half * 2 // group_size, group_size // 2)
    return torch.cat([b & 15, b >> 4], dim=-1).view(n, half * 2)


def pack_int4(q: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, Kp] values 0..15 (any int dtype) -> [N, Kp // 2] uint8; inverse of unpack_int4."""
    n, kp = q.shape
    g = q.to(torch.uint8).view(n, kp // group_size, 2, group_size // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).view(n, kp // 2)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    in_features: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """-> [N, in_features] dtype (pad columns dropped); float32 math (q * s + z), rounded once.

    For GGUF Q4_1 this is bit for bit what engine.gguf.dequantize computes."""
    n = packed.shape[0]
    q = unpack_int4(packed, group_size).view(n, -1, group_size)
    w = torch.mul(q, scales.float()[..., None]).add_(zeros.float()[..., None]).view(n, -1)
    if in_features is not None and in_features != w.shape[1]:
        w = w[:, :in_features]
    return w.to(dtype)


# ----------------------------------------------------------------------------- references

def int8_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K] float -> [..., N] x.dtype: the weight dequantized to x.dtype, then a float matmul."""
    return F.linear(x, dequantize_int8(qweight, scales, x.dtype), _cast(bias, x.dtype))


def int4_matmul_ref(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K] float -> [..., N] x.dtype."""
    w = dequantize_int4(packed, scales, zeros, group_size, x.shape[-1], x.dtype)
    return F.linear(x, w, _cast(bias, x.dtype))


def quantize_per_token_ref(x: torch.Tensor, qmax: float = 127.0) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] float -> (int8 [M, K], float32 scale [M, 1]); symmetric, round half to even."""
    xf = x.float()
    s = xf.abs().amax(-1, keepdim=True).clamp_(min=AMAX_FLOOR) / qmax
    return torch.round(xf / s).clamp_(-qmax, qmax).to(torch.int8), s


def w8a8_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token int8 activations times per-channel int8 weights; the integer product in
    float64 (exact: |sum| < 2^53), so this is what an exact int32 kernel must return."""
    shape = x.shape
    xq, xs = quantize_per_token_ref(x.reshape(-1, shape[-1]))
    acc = xq.double() @ qweight.double().t()
    y = (acc * xs.double() * scales.double().view(1, -1)).float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*shape[:-1], -1)


def w8a8_per_batch_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       bias: torch.Tensor | None = None, row_scaled: bool = True,
                       reduce_range: bool = True) -> torch.Tensor:
    """What w8a8_matmul_fbgemm computes (up to its float32 rounding): x quantized as uint8 with one scale
    and zero point for the whole batch, 7-bit with reduce_range (else 8-bit), asymmetric; row_scaled: each row first
    divided by its own max |x| (and the product multiplied back), so the batch's one scale fits every row."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).float()
    rows = x2.abs().amax(-1, keepdim=True).clamp_(min=AMAX_FLOOR) if row_scaled else None
    if rows is not None:
        x2 = x2 / rows
    levels = 127 if reduce_range else 255
    lo, hi = min(x2.min().item(), 0.0), max(x2.max().item(), 0.0)
    s = max((hi - lo) / levels, AMAX_FLOOR)
    zp = min(max(round(-lo / s), 0), levels)
    xq = (torch.round(x2 / s) + zp).clamp_(0, levels) - zp
    acc = xq.double() @ qweight.double().t()
    y = acc * s * scales.double().view(1, -1)
    if rows is not None:
        y = y * rows.double()
    y = y.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*shape[:-1], -1)


def quantize_fp8_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] -> (float8_e4m3fn [M, K], float32 scale [M, 1])."""
    xf = x.float()
    s = xf.abs().amax(-1, keepdim=True).clamp_(min=AMAX_FLOOR) / FP8_MAX
    return (xf / s).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


def fp8_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp8 activations (per token) times fp8 weights (per channel), float32 accumulation."""
    shape = x.shape
    xq, xs = quantize_fp8_per_token_ref(x.reshape(-1, shape[-1]))
    y = (xq.float() @ qweight.float().t()) * xs * scales.float().view(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*shape[:-1], -1)


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


# ----------------------------------------------------------------------------- CPU fast paths

def _rows_per_slice(n: int, k: int) -> int:
    return max(64, min(n, CPU_DEQUANT_ELEMENTS // max(k, 1)))


def sliced_linear(x2: torch.Tensor, n: int, k: int, dequant_rows, bias, step: int | None = None) -> torch.Tensor:
    """x2: [M, K]; dequant_rows(r0, r1) -> [r1 - r0, K] float weight rows. Computes x2 @ W^T
    one slice of rows at a time (the transient float weight stays ~4 MB, in cache), on dense_linear.
    step: the slice's rows (default _rows_per_slice's)."""
    step = step or _rows_per_slice(n, k)
    if step >= n:
        return dense_linear(x2, dequant_rows(0, n), bias)
    out = torch.empty(x2.shape[0], n, dtype=x2.dtype, device=x2.device)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        out[:, r0:r1] = dense_linear(x2, dequant_rows(r0, r1), None if bias is None else bias[r0:r1])
    return out


def _int8_matmul_cpu(x, qweight, scales, bias):
    n, k = qweight.shape
    x2 = x.reshape(-1, k)
    dt = x.dtype
    b = _cast(bias, dt)
    if scales.shape[1] == 1 and n * k <= CPU_DEQUANT_ELEMENTS:
        # per channel, small layer: convert int8 -> float, matmul, scale the [M, N] output
        # (cheaper than scaling the [N, K] weight while M < K)
        y = F.linear(x2, qweight.to(dt)).mul_(scales.view(1, n).to(dt))
        y = y if b is None else y.add_(b)
    else:
        y = sliced_linear(x2, n, k, lambda r0, r1: dequantize_int8(qweight[r0:r1], scales[r0:r1], dt), b)
    return y.view(*x.shape[:-1], n)


def _int4_matmul_cpu(x, packed, scales, zeros, group_size, bias):
    n = packed.shape[0]
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    y = sliced_linear(x2, n, k, lambda r0, r1: dequantize_int4(packed[r0:r1], scales[r0:r1], zeros[r0:r1],
                                                                group_size, k, x.dtype), _cast(bias, x.dtype))
    return y.view(*x.shape[:-1], n)


# ----------------------------------------------------------------------------- dispatch

def int8_matmul(x, qweight, scales, bias=None):
    """x: [..., K] float; qweight [N, K] int8; scales [N, K // G]. Returns [..., N] in x.dtype."""
    if use_triton(x):
        from jobrunner.kernels.matmul.quant_matmul_triton import int8_matmul_triton
        return int8_matmul_triton(x, qweight, scales, bias)
    return _int8_matmul_cpu(x, qweight, scales, bias)


def int4_matmul(x, packed, scales, zeros, group_size, bias=None, cpu_lib: Int4Library | None = None):
    """x: [..., K] float; packed [N, Kp // 2] uint8; scales, zeros [N, Kp // G]. Returns [..., N].
    cpu_lib: the loaded CPU int4 kernel (kernels/matmul/cpu_int4.py), which takes float32 calls of any size where
    it runs its panel path, else of up to CPU_INT4_MAX_ROWS rows; larger ones (prefill) then dequantize a slice at a
    time, which is faster there. Bfloat16 calls: its bf16 form where the CPU has one (any size from
    BF16_FORM_MIN_ROWS), else widened to float32 up to BF16_KERNEL_ROWS, else bfloat16 slices."""
    if use_triton(x):
        from jobrunner.kernels.matmul.quant_matmul_triton import int4_matmul_triton
        return int4_matmul_triton(x, packed, scales, zeros, group_size, bias)
    if cpu_lib is not None and cpu_lib.covers_bf16(x, packed.shape[0], group_size, scales):
        return int4_bf16_matmul_cpu(x, packed, scales, zeros, group_size, bias, cpu_lib)
    if cpu_lib is not None and cpu_lib.covers(x, scales) and (
            x.numel() <= CPU_INT4_MAX_ROWS * x.shape[-1] or cpu_lib.panel_path(packed.shape[0], group_size)):
        return int4_matmul_cpu(x, packed, scales, zeros, group_size, bias, cpu_lib)
    x32 = widened_bf16(x) if cpu_lib is not None else None
    if x32 is not None and cpu_lib.covers(x32, scales):
        return int4_matmul_cpu(x32, packed, scales, zeros, group_size, bias, cpu_lib).to(x.dtype)
    return _int4_matmul_cpu(x, packed, scales, zeros, group_size, bias)


@functools.lru_cache(maxsize=None)
def int_mm_exact(weight_qmax: int = 127, device_type: str = "cpu", full_range: bool = False) -> bool:
    """Whether torch._int_mm returns the exact int32 product for activations in [-127, 127]
    and weights in [-weight_qmax, weight_qmax]. On CPUs without VNNI (AVX2, AVX-512 without
    VNNI) oneDNN shifts the activations to uint8 and multiplies with vpmaddubsw, whose 16-bit
    pair sums saturate for full-range weights (255 * 127 * 2 > 32767) and return garbage;
    with 7-bit weights (255 * 63 * 2 < 32767) they cannot. full_range: both operands anywhere in
    [-128, 127] (a shipped checkpoint's int8 levels). Probed once with worst cases."""
    if not hasattr(torch, "_int_mm"):
        return False
    try:
        m, k, n = 32, 256, 32
        g = torch.Generator().manual_seed(0)
        lo_a, lo_b = (-128, -128) if full_range else (-127, -weight_qmax)
        a = torch.randint(lo_a, 128, (m, k), dtype=torch.int8, generator=g)
        b = torch.randint(lo_b, weight_qmax + 1, (k, n), dtype=torch.int8, generator=g)
        a[0], a[1] = 127, lo_a
        b[:, 0], b[:, 1] = weight_qmax, lo_b
        ref = a.long() @ b.long()
        got = torch._int_mm(a.to(device_type), b.to(device_type)).long().cpu()
        return torch.equal(got, ref)
    except (RuntimeError, NotImplementedError):
        return False


@functools.lru_cache(maxsize=1)
def fbgemm_full_range() -> bool:
    """Whether fbgemm's dynamic linear is exact with 8-bit activations (reduce_range off) and full-range
    weights: on CPUs with VNNI it is; without (AVX2) its uint8 x int8 pair sums saturate at 16 bits
    (255 * 127 * 2 > 32767), which 7-bit activations avoid. Probed once with the worst case."""
    import warnings
    try:
        m, k, n = 8, 64, 8
        w = torch.full((n, k), 127, dtype=torch.int8)
        w[1::2] = -127
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qw = torch._make_per_channel_quantized_tensor(w, torch.ones(n, dtype=torch.double),
                                                          torch.zeros(n, dtype=torch.long), 0)
            packed = torch.ops.quantized.linear_prepack(qw, None)
        x = torch.full((m, k), 255.0)
        x[:, 0] = 0.0                                    # the batch's range [0, 255]: zero point 0, scale 1
        got = torch.ops.quantized.linear_dynamic(x, packed, False)
        return torch.equal(got.double(), x.double() @ w.double().t())
    except (RuntimeError, NotImplementedError):
        return False


def quantize_per_token(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] float -> (int8 [M, K], float32 [M, 1]); the same rounding as quantize_per_token_ref
    with fewer passes over x (the fast path in W8A8Linear)."""
    xf = x2.float()
    s = xf.abs().amax(-1, keepdim=True).clamp_(min=AMAX_FLOOR).div_(127.0)
    return torch.round(xf / s).to(torch.int8), s   # |x / s| <= 127 by construction


def w8a8_matmul_int_mm(x, qweight, scales, bias=None):
    """Per-token int8 x [..., K] times int8 qweight [N, K] via torch._int_mm (exact int32
    accumulation; check int_mm_exact() first). Each row's result depends on that row only."""
    n, k = qweight.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    xq, xs = quantize_per_token(x2)
    if x.is_cuda and m <= 16:      # CUDA _int_mm wants more than 16 rows
        xq = F.pad(xq, (0, 0, 0, 17 - m))
    acc = torch._int_mm(xq, qweight.t())[:m]          # [M, N] int32
    y = torch.mul(acc, xs).mul_(scales.view(1, n))    # int32 * float32 -> float32: two passes over [M, N]
    if bias is not None:
        y.add_(bias.float())
    return y.to(x.dtype).view(*x.shape[:-1], n)


def w8a8_matmul_fbgemm(x, packed, out_features: int, bias=None, row_scaled: bool = True,
                       reduce_range: bool = True):
    """fbgemm's dynamic int8 linear over prepacked weights (torch.ops.quantized.linear_prepack, no bias:
    it is added here). fbgemm quantizes x with one scale for the whole batch, 7-bit (reduce_range, which
    AVX2's 16-bit pair sums need), so one token with large activations costs every other token its
    precision (+53% perplexity on the default model). row_scaled divides each row by its own max |x|
    first and multiplies its output row back (the product is linear in x): the one scale then fits
    every row, as a per-token scale would, for two elementwise passes."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k).float()
    if row_scaled:
        rows = x2.abs().amax(-1, keepdim=True).clamp_(min=AMAX_FLOOR)
        y = torch.ops.quantized.linear_dynamic(x2 / rows, packed, reduce_range).mul_(rows)
    else:
        y = torch.ops.quantized.linear_dynamic(x2, packed, reduce_range)
    if bias is not None:
        y.add_(bias.float())
    return y.to(x.dtype).view(*x.shape[:-1], out_features)


def fp8_matmul(x, qweight, scales, bias=None, rowwise: bool = True):
    """CUDA only: per-token fp8 x times per-channel fp8 qweight through torch._scaled_mm.
    rowwise: let _scaled_mm apply both scale vectors (Hopper and newer, bfloat16 out);
    else a float32 product with unit scales, scaled afterwards (Ada)."""
    n, k = qweight.shape
    x2 = x.reshape(-1, k)
    xq, xs = quantize_fp8_per_token_ref(x2)
    w_t = qweight.t()                                  # column-major [K, N], as _scaled_mm wants
    if rowwise and x.dtype == torch.bfloat16:
        y = torch._scaled_mm(xq, w_t, scale_a=xs, scale_b=scales.view(1, n).float(), out_dtype=torch.bfloat16)
        if bias is not None:
            y = y + bias.to(y.dtype)
    else:
        one = torch.ones((), device=x.device, dtype=torch.float32)
        y = torch._scaled_mm(xq, w_t, scale_a=one, scale_b=one, out_dtype=torch.float32)
        y = y.mul_(xs).mul_(scales.view(1, n).float())
        if bias is not None:
            y.add_(bias.float())
        y = y.to(x.dtype)
    return y.view(*x.shape[:-1], n)
