"""Triton dequantize-and-multiply kernels for int8 and int4 weights (layouts: kernels/matmul/quant_matmul.py).

    y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias)

Each program computes a [BLOCK_M, BLOCK_N] tile of y. Per K step it loads an int8 (or
packed int4) tile of W, dequantizes it in registers to x.dtype exactly as the torch
reference does (float32 q * s (+ z), rounded once to x.dtype), and feeds tl.dot, which
accumulates in float32. Only the 1- or 0.5-byte weights cross memory, which is what
decode steps (small M, bandwidth bound) are bound by.

int4: one K step is one group of G columns; its G/2 bytes hold the low half of the group
in the low nibbles and the high half in the high nibbles, so the step is two dots:

    x[:, gG : gG+G/2]    @ (b & 15) * s + z        (low nibbles)
    x[:, gG+G/2 : gG+G]  @ (b >> 4) * s + z        (high nibbles)

tl.dot needs tiles of at least 16, so G >= 32. Float32 inputs use IEEE products (no TF32),
so float32 results match the reference to float32 rounding.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from jobrunner.kernels.common.triton_utils import check, check_float, check_last_contiguous, check_same_device, launch


@triton.jit
def _int8_matmul_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_ym,
    GROUP: tl.constexpr,          # 0: one scale per output channel; else the group size (BLOCK_K divides it)
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    xdt = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GROUP == 0:
        s = tl.load(s_ptr + rn.to(tl.int64) * stride_sn, mask=n_ok, other=0.0).to(tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + kk[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)                       # [BM, BK]
        w = tl.load(w_ptr + rn.to(tl.int64)[None, :] * stride_wn + kk[:, None],
                    mask=n_ok[None, :] & k_ok[:, None], other=0)                          # [BK, BN] int8
        if GROUP != 0:
            s = tl.load(s_ptr + rn.to(tl.int64) * stride_sn + k0 // GROUP, mask=n_ok, other=0.0).to(tl.float32)
        wf = (w.to(tl.float32) * s[None, :]).to(xdt)
        if IEEE:
            acc += tl.dot(x, wf, input_precision="ieee")
        else:
            acc += tl.dot(x, wf)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _int4_matmul_kernel(
    x_ptr, p_ptr, s_ptr, z_ptr, b_ptr, y_ptr,
    M, N, K, num_groups,
    stride_xm, stride_pn, stride_sn, stride_zn, stride_ym,
    HALF: tl.constexpr,           # group size / 2
    SUB: tl.constexpr,            # bytes of a group taken per dot (divides HALF; bounds registers)
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rh = tl.arange(0, SUB)
    m_ok = rm < M
    n_ok = rn < N
    rn64 = rn.to(tl.int64)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    xdt = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # one flat loop over (group, slice of SUB bytes): no unrolled inner loop, so big groups
    # don't multiply the registers software pipelining needs
    for t in range(num_groups * (HALF // SUB)):
        g = t // (HALF // SUB)
        j = tl.multiple_of((t % (HALF // SUB)) * SUB, SUB) + rh                            # bytes in the group
        s = tl.load(s_ptr + rn64 * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        z = tl.load(z_ptr + rn64 * stride_zn + g, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        b = tl.load(p_ptr + rn64[None, :] * stride_pn + (g * HALF + j)[:, None],
                    mask=n_ok[None, :], other=0)                                          # [SUB, BN] uint8
        w_lo = ((b & 15).to(tl.float32) * s + z).to(xdt)
        w_hi = ((b >> 4).to(tl.float32) * s + z).to(xdt)
        k_lo = g * 2 * HALF + j
        k_hi = k_lo + HALF
        x_lo = tl.load(x_rows + k_lo[None, :], mask=m_ok[:, None] & (k_lo < K)[None, :], other=0.0)
        x_hi = tl.load(x_rows + k_hi[None, :], mask=m_ok[:, None] & (k_hi < K)[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(x_lo, w_lo, input_precision="ieee")
            acc += tl.dot(x_hi, w_hi, input_precision="ieee")
        else:
            acc += tl.dot(x_lo, w_lo)
            acc += tl.dot(x_hi, w_hi)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _tiles(m: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps); int4 takes BLOCK_K as its bytes per dot. Checked by
    compiling for sm_90 (python -m benchmarks.quant_report --compile-check): no register spills
    for int8 and int4 g32 (GGUF's group); int4 g64/g128 spill up to 16 bytes. Untimed: no GPU
    was available; float32 (IEEE, no tensor cores) gets smaller tiles."""
    if dtype == torch.float32:
        return 16, 32, 32, 4
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    return bm, 64, 32, 4


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _check_common(x, bias, n, k):
    check_float("x", x)
    check(x.dim() >= 1 and x.shape[-1] == k, f"x: expected [..., {k}], got {tuple(x.shape)}")
    check_last_contiguous("x", x)
    if bias is not None:
        check(bias.shape == (n,), f"bias: expected ({n},), got {tuple(bias.shape)}")
        check(bias.is_contiguous(), "bias must be contiguous")


def int8_matmul_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K] float16/bfloat16/float32; qweight [N, K] int8; scales [N, K // G] float.
    Returns a new [..., N] tensor in x.dtype."""
    check(qweight.dtype == torch.int8 and qweight.dim() == 2, f"qweight: int8 [N, K], got {qweight.dtype} "
          f"{tuple(qweight.shape)}")
    n, k = qweight.shape
    _check_common(x, bias, n, k)
    check(scales.dim() == 2 and scales.shape[0] == n and k % scales.shape[1] == 0,
          f"scales: expected [{n}, K // G], got {tuple(scales.shape)}")
    check(qweight.stride(1) == 1 and scales.stride(1) == 1, "qweight and scales need contiguous rows")
    device = check_same_device(x=x, qweight=qweight, scales=scales, **({"bias": bias} if bias is not None else {}))
    groups = scales.shape[1]
    group = 0 if groups == 1 else k // groups
    if group:
        check(group >= 16 and group & (group - 1) == 0, f"group size {group}: a power of two >= 16 is needed")
    x2 = _rows(x, k)
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=device)
    if m and n:
        bm, bn, bk, warps = _tiles(m, x.dtype)
        bk = min(group, bk) if group else bk
        launch(_int8_matmul_kernel, (triton.cdiv(m, bm), triton.cdiv(n, bn)), device,
               x2, qweight, scales, bias if bias is not None else scales, y, m, n, k,
               x2.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
               GROUP=group, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
               BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return y.view(*x.shape[:-1], n)


def int4_matmul_triton(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                       group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K]; packed [N, Kp // 2] uint8 (Kp = K rounded up to group_size); scales, zeros
    [N, Kp // group_size]. Returns a new [..., N] tensor in x.dtype."""
    check(packed.dtype == torch.uint8 and packed.dim() == 2, f"packed: uint8 [N, Kp / 2], got {packed.dtype} "
          f"{tuple(packed.shape)}")
    check(group_size >= 32 and group_size & (group_size - 1) == 0,
          f"group size {group_size}: a power of two >= 32 is needed")
    n, half_k = packed.shape
    k = x.shape[-1]
    groups = half_k * 2 // group_size
    check(half_k * 2 == groups * group_size and groups * group_size >= k > (groups - 1) * group_size,
          f"packed: {half_k} bytes a row do not hold K={k} in groups of {group_size}")
    _check_common(x, bias, n, k)
    for name, t in (("scales", scales), ("zeros", zeros)):
        check(t.shape == (n, groups), f"{name}: expected ({n}, {groups}), got {tuple(t.shape)}")
        check(t.stride(1) == 1, f"{name} needs contiguous rows")
    check(packed.stride(1) == 1, "packed needs contiguous rows")
    device = check_same_device(x=x, packed=packed, scales=scales, zeros=zeros,
                               **({"bias": bias} if bias is not None else {}))
    x2 = _rows(x, k)
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=device)
    if m and n:
        bm, bn, sub, warps = _tiles(m, x.dtype)
        launch(_int4_matmul_kernel, (triton.cdiv(m, bm), triton.cdiv(n, bn)), device,
               x2, packed, scales, zeros, bias if bias is not None else scales, y, m, n, k, groups,
               x2.stride(0), packed.stride(0), scales.stride(0), zeros.stride(0), y.stride(0),
               HALF=group_size // 2, SUB=min(sub, group_size // 2), HAS_BIAS=bias is not None,
               IEEE=x.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
    return y.view(*x.shape[:-1], n)
