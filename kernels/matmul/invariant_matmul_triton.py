"""Triton float matmul whose sum order per row does not depend on the number of rows:

    y[M, N] = x[M, K] @ W[N, K]^T (+ bias)         float16, bfloat16, float32 (float32 accumulation)

cuBLAS (and an autotuned Triton matmul) pick their tiles, their split over K and their kernel by M, so a
row's sum over K runs in another order, and comes out in other bits, when the batch grows. Here the
tiles are fixed for a dtype and a weight, whatever M (`invariant_config`: no autotuning by M, no
split-K): each program computes a [BLOCK_M, BLOCK_N] tile of y, walking K from 0 in BLOCK_K steps,
one tl.dot a step into a float32 accumulator, and adds the bias last. A row's K-sum is then the same
sequence of the same dots whichever tile row it lands in and whatever else fills the tile (the dot's
order inside a tile follows the tile's shape, not its contents). The price: a lone decode row still
runs a BLOCK_M-row tile (the rows past M masked), and small batches get no split-K parallelism.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from jobrunner.kernels.common.triton_utils import check, check_float, check_last_contiguous, check_same_device, launch


# M is not specialized on (divisible by 16 or not): one compiled kernel for every batch size.
@triton.jit(do_not_specialize=["M"])
def _invariant_matmul_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):                                               # K in one fixed order
        kk = k0 + rk
        k_ok = kk < K
        x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + kk[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)                       # [BM, BK]
        w = tl.load(w_ptr + rn.to(tl.int64)[None, :] * stride_wn + kk[:, None],
                    mask=n_ok[None, :] & k_ok[:, None], other=0.0)                       # [BK, BN]
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def invariant_config(dtype: torch.dtype) -> dict:
    """The tiles and launch options for a dtype: the same for every M (that is the point). float32 takes
    IEEE products (no TF32) and smaller tiles (the FMA path's registers)."""
    if dtype == torch.float32:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, IEEE=True, num_warps=4, num_stages=2)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, IEEE=False, num_warps=4, num_stages=3)


def invariant_matmul_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                            config: dict | None = None) -> torch.Tensor:
    """x: [..., K]; weight: [N, K] (x's dtype); bias: [N] or None -> [..., N] in x's dtype.
    config: invariant_config(x.dtype) unless given (tests pass others to show that tiles chosen by M
    change a row's bits)."""
    check_float("x", x)
    check(weight.dim() == 2 and weight.dtype == x.dtype and x.shape[-1] == weight.shape[1],
          f"weight: expected [N, {x.shape[-1]}] {x.dtype}, got {tuple(weight.shape)} {weight.dtype}")
    N, K = weight.shape
    check(bias is None or (bias.shape == (N,) and bias.is_contiguous()),
          f"bias: expected a contiguous [{N}], got {None if bias is None else tuple(bias.shape)}")
    check(weight.stride(1) == 1, "weight: rows must be contiguous")
    x2 = x.reshape(-1, K)
    check_last_contiguous("x", x2)
    device = check_same_device(x=x2, weight=weight, **({} if bias is None else {"bias": bias}))
    M = x2.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=device)
    if M and N:
        cfg = dict(config or invariant_config(x.dtype))
        grid = (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]))
        launch(_invariant_matmul_kernel, grid, device,
               x2, weight, bias if bias is not None else weight, y, M, N, K,
               x2.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=bias is not None, **cfg)
    return y.view(*x.shape[:-1], N)
