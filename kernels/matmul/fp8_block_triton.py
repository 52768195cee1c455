"""Triton FP8 block-scaled GEMM (compressed-tensors' FP8_BLOCK, DeepSeek-V3 style; layouts: kernels/matmul/shipped_quant.py).

    W[n, k] = q[n, k] * ws[n // bn, k // bk]          q float8_e4m3fn [N, K], ws float32 [ceil(N/bn), ceil(K/bk)]
    x quantized per token, per group of bk columns, as compressed-tensors' forward does (in x's dtype):
        xs[m, g] = max|x[m, g*bk : (g+1)*bk]| / 448    (0 -> eps of x's dtype)
        xq[m, k] = clamp(x[m, k] / xs[m, k // bk], -448, 448) -> float8_e4m3fn
    y[m, n] = sum over k-blocks kb of (xq[m, kb] . q[n, kb]) * xs[m, kb] * ws[n // bn, kb]   (+ bias) -> x.dtype

Two launches:

  _act_quant_kernel   one program per ROWS tokens x one group of bk columns: the group's max, the scale
                      and the levels, written as fp8 [M, K] and float32 scales [M, Kb]. The scale is
                      rounded to x's dtype and x / scale is rounded to x's dtype before the fp8 cast,
                      so the levels are those of kernels.shipped_quant.fake_quantize_fp8, bit for bit.
                      (A group that ends past K, when K is not a multiple of bk, is the columns left.)
  _fp8_block_gemm_kernel
                      one program per [BLOCK_M, BLOCK_N] tile of y. Per K step of BLOCK_K columns
                      (BLOCK_K divides bk, so a step lies in one k-block) it loads fp8 tiles of xq and
                      q, takes their float32 dot (fp8 products are exact in float32), and adds it times
                      xs[rows, kb] * ws[cols // bn, kb]. Weight scales are gathered per column, so bn
                      need not be a multiple of BLOCK_N (nor a power of two).

Where float8 is not native:
  * CUDA before sm_89 (no fp8 conversions nor fp8 dot): the levels are encoded with integer ops
    (round to nearest even, as the hardware cast), and both operands are decoded from their bytes to
    float16 in registers (every e4m3 value is a float16 value; decoded / 256, the 2^16 folded back
    into the accumulator exactly) for a float16 dot, which accumulates in float32 too.
  * Triton's interpreter (CPU tensors): it loads fp8 and dots it correctly, but its float -> fp8 cast
    truncates and drops carries, and its float32 -> bfloat16 cast truncates; the levels are encoded
    with the integer ops above and bfloat16 values are rounded (to nearest even) with integer ops.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from jobrunner.kernels.common.triton_utils import FLOAT_DTYPES, check, check_float, check_last_contiguous, check_same_device, launch, next_pow2

FP8_MAX = tl.constexpr(448.0)     # largest finite float8_e4m3fn (a constexpr: kernels read it)


# ----------------------------------------------------------------------------- bit-level helpers

@triton.jit
def _round_bf16(v):
    """float32 -> the nearest bfloat16 value (ties to even), still float32 (finite v)."""
    b = v.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_bits(v):
    """float32 with |v| <= 448 -> its float8_e4m3fn byte, rounded to nearest even (uint8)."""
    b = v.to(tl.uint32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    # normal (|v| >= 2^-6): keep 3 mantissa bits, ties to even (a carry moves into the exponent);
    # the exponent rebiased from 127 to 7: (E << 3 | m) - (120 << 3)
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960
    # subnormal: multiples of 2^-9; |v| * 512 rounded to an integer (ties to even) by adding 2^23
    small = (a.to(tl.float32, bitcast=True) * 512.0 + 8388608.0).to(tl.uint32, bitcast=True) - 0x4B000000
    return (tl.where(a < 0x3C800000, small, normal) | sign).to(tl.uint8)


@triton.jit
def _e4m3_to_fp16_over_256(c):
    """float8_e4m3fn bytes (uint8) -> their values / 256 as float16, exactly (e4m3's bits shifted into
    float16's place; the exponent bias differs by 8)."""
    c16 = c.to(tl.uint16)
    return (((c16 & 0x80) << 8) | ((c16 & 0x7F) << 7)).to(tl.float16, bitcast=True)


# ----------------------------------------------------------------------------- kernels

@triton.jit
def _act_quant_kernel(
    x_ptr, q_ptr, s_ptr,
    M, K, stride_xm, stride_qm, stride_sm, eps,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    SOFT_FP8: tl.constexpr,       # encode the levels with integer ops (q_ptr: uint8)
    SOFT_BF16: tl.constexpr,      # x is bfloat16 and its roundings are done with integer ops
):
    pid_m = tl.program_id(0)
    g = tl.program_id(1)
    rm = pid_m * ROWS + tl.arange(0, ROWS)
    rc = tl.arange(0, BLOCK)
    cols = g * GROUP + rc
    ok = (rm < M)[:, None] & ((rc < GROUP) & (cols < K))[None, :]
    rm64 = rm.to(tl.int64)
    xdt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + rm64[:, None] * stride_xm + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    s = tl.div_rn(tl.max(tl.abs(x), axis=1), FP8_MAX)                            # [ROWS]
    if SOFT_BF16:
        s = _round_bf16(s)
    else:
        s = s.to(xdt).to(tl.float32)
    s = tl.where(s == 0.0, eps, s)
    v = tl.div_rn(x, s[:, None])
    if SOFT_BF16:
        v = _round_bf16(v)
    else:
        v = v.to(xdt).to(tl.float32)
    v = tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX)
    if SOFT_FP8:
        q = _e4m3_bits(v)
    else:
        q = v.to(tl.float8e4nv)
    tl.store(q_ptr + rm64[:, None] * stride_qm + cols[None, :], q, mask=ok)
    tl.store(s_ptr + rm64 * stride_sm + g, s, mask=rm < M)


@triton.jit
def _fp8_block_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_am, stride_asm, stride_wn, stride_wsn, stride_wsk, stride_ym,
    BN_Q: tl.constexpr, BK_Q: tl.constexpr,       # the weight's scale block [bn, bk]
    HAS_BIAS: tl.constexpr,
    FP16_DOT: tl.constexpr,       # a_ptr, w_ptr are the fp8 bytes (uint8): decode to float16, dot in float16
    SOFT_BF16: tl.constexpr,      # y (and bias) rounded to bfloat16 with integer ops
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    a_rows = a_ptr + rm64[:, None] * stride_am                                     # [BM, 1]
    w_cols = w_ptr + rn64[None, :] * stride_wn                                     # [1, BN]
    as_rows = as_ptr + rm64 * stride_asm                                           # [BM]
    ws_cols = ws_ptr + (rn // BN_Q).to(tl.int64) * stride_wsn                      # [BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        a = tl.load(a_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0) # [BM, BK]
        w = tl.load(w_cols + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0) # [BK, BN]
        kb = k0 // BK_Q
        xs = tl.load(as_rows + kb, mask=m_ok, other=0.0)
        wsc = tl.load(ws_cols + kb * stride_wsk, mask=n_ok, other=0.0).to(tl.float32)
        if FP16_DOT:
            part = tl.dot(_e4m3_to_fp16_over_256(a), _e4m3_to_fp16_over_256(w))
        else:
            part = tl.dot(a, w)
        acc += part * xs[:, None] * wsc[None, :]
    if FP16_DOT:
        acc *= 65536.0                                                             # (1/256)^2 folded back, exactly
    if HAS_BIAS:
        bias = tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        if SOFT_BF16:
            bias = _round_bf16(bias)
        else:
            bias = bias.to(y_ptr.dtype.element_ty).to(tl.float32)                 # the reference adds it in x's dtype
        acc += bias[None, :]
    if SOFT_BF16:
        acc = _round_bf16(acc)
    tl.store(y_ptr + rm64[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


# ----------------------------------------------------------------------------- launchers

def _block_k(bk: int) -> int:
    """The K step: the largest of 128, 64, 32 that divides bk (a step never straddles two k-blocks)."""
    return next(b for b in (128, 64, 32) if bk % b == 0)


def _tiles(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the GEMM. fp8 tiles (1-byte operands, float32 accumulator)
    after vLLM's untuned default (64 x 128 x 128, 4 warps), smaller rows for decode's few tokens and
    narrower columns there so a decode step has more programs. Untimed: no GPU was available."""
    if m <= 16:
        return 16, 64, 4
    if m <= 32:
        return 32, 128, 4
    if m <= 64:
        return 64, 128, 4
    return 128, 128, 8


def native_fp8(device: torch.device) -> bool:
    """Whether fp8 conversions and fp8 dots are native: CUDA sm_89 or later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _check(x2, qweight, scales, block, bias):
    check_float("x2", x2)
    check(qweight.dtype == torch.float8_e4m3fn and qweight.dim() == 2,
          f"qweight: float8_e4m3fn [N, K], got {qweight.dtype} {tuple(qweight.shape)}")
    n, k = qweight.shape
    check(x2.dim() == 2 and x2.shape[1] == k, f"x2: expected [M, {k}], got {tuple(x2.shape)}")
    check_last_contiguous("x2", x2)
    check(qweight.stride(1) == 1 or k <= 1, "qweight needs contiguous rows")
    check(len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block),
          f"block: expected (bn, bk) positive ints, got {block}")
    bn, bk = block
    check(bk % 32 == 0, f"block: bk={bk} must be a multiple of 32 (the kernel's K step, BLOCK_K, divides it)")
    grid = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    check(scales.dtype in FLOAT_DTYPES and tuple(scales.shape) == grid,
          f"scales: expected float {grid} (ceil(N/bn), ceil(K/bk)), got {scales.dtype} {tuple(scales.shape)}")
    if bias is not None:
        check_float("bias", bias)
        check(tuple(bias.shape) == (n,) and bias.is_contiguous(), f"bias: expected contiguous ({n},), "
              f"got {tuple(bias.shape)}")
    return check_same_device(x2=x2, qweight=qweight, scales=scales, **({"bias": bias} if bias is not None else {}))


def quantize_act_fp8_triton(x2: torch.Tensor, group: int,
                            soft: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 [M, K] float -> (levels [M, K] float8_e4m3fn, scales [M, ceil(K / group)] float32), per token and
    group of `group` columns (the module doc). soft: encode with integer ops (default: where not native)."""
    check_float("x2", x2)
    check(x2.dim() == 2, f"x2: expected [M, K], got {tuple(x2.shape)}")
    check_last_contiguous("x2", x2)
    check(group > 0, f"group {group} must be positive")
    m, k = x2.shape
    groups = triton.cdiv(k, group)
    soft = not native_fp8(x2.device) if soft is None else soft
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x2.device)
    s = torch.empty(m, groups, dtype=torch.float32, device=x2.device)
    if m and k:
        rows = min(16, next_pow2(m))
        launch(_act_quant_kernel, (triton.cdiv(m, rows), groups), x2.device,
               x2, q.view(torch.uint8) if soft else q, s, m, k, x2.stride(0), q.stride(0), s.stride(0),
               torch.finfo(x2.dtype).eps,
               GROUP=group, BLOCK=next_pow2(group), ROWS=rows, SOFT_FP8=soft,
               SOFT_BF16=x2.dtype == torch.bfloat16 and x2.device.type != "cuda", num_warps=4)
    return q, s


def fp8_block_matmul_triton(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int],
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    """x2 [M, K] float16/bfloat16/float32 (not quantized: this quantizes it, per token and group of bk);
    qweight [N, K] float8_e4m3fn; scales [ceil(N/bn), ceil(K/bk)] float32; block (bn, bk), bk a multiple
    of 32. Returns a new [M, N] tensor in x2.dtype."""
    return _fp8_block_matmul(x2, qweight, scales, block, bias)


def _fp8_block_matmul(x2, qweight, scales, block, bias=None, soft: bool | None = None):
    """fp8_block_matmul_triton; soft forces (True) or forbids (False) the integer encoding and float16
    dot of GPUs before sm_89 (tests run both paths; the interpreter only encodes softly when False)."""
    block = tuple(int(b) for b in block)
    if x2.dim() == 2 and x2.shape[1] > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    device = _check(x2, qweight, scales, block, bias)
    bn, bk = block
    n, k = qweight.shape
    m = x2.shape[0]
    native = native_fp8(device)
    fp16_dot = (not native and device.type == "cuda") if soft is None else soft
    y = torch.empty(m, n, dtype=x2.dtype, device=device)
    if not (m and n):
        return y
    if k == 0:
        return y.zero_() if bias is None else y.copy_(bias.to(x2.dtype).expand(m, n))
    xq, xs = quantize_act_fp8_triton(x2, bk, soft=fp16_dot or not native)
    bm, block_n, warps = _tiles(m)
    launch(_fp8_block_gemm_kernel, (triton.cdiv(m, bm), triton.cdiv(n, block_n)), device,
           xq.view(torch.uint8) if fp16_dot else xq, xs,
           qweight.view(torch.uint8) if fp16_dot else qweight, scales,
           bias if bias is not None else xs, y, m, n, k,
           xq.stride(0), xs.stride(0), qweight.stride(0), scales.stride(0), scales.stride(1), y.stride(0),
           BN_Q=bn, BK_Q=bk, HAS_BIAS=bias is not None, FP16_DOT=fp16_dot,
           SOFT_BF16=x2.dtype == torch.bfloat16 and device.type != "cuda",
           BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=_block_k(bk), num_warps=warps, num_stages=3)
    return y
