"""Triton segmented gather matmul (kernels/lora/sgmv.py has the contract and the reference).

Grid: (segments x row blocks of the longest segment, column blocks of N). A program loads its
segment's (start, length, slot), returns at once past the segment's end (short decode segments
beside long prefill ones), and accumulates x[rows] @ w[slot].T over K in float32, then adds it
to out[rows]: each (row, column) belongs to one program, so no atomics.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from jobrunner.kernels.common.triton_utils import check, check_float, check_last_contiguous, check_same_device, launch, next_pow2


@triton.jit
def _sgmv_kernel(x_ptr, w_ptr, out_ptr, seg_ptr, num_segs, N, K, stride_x, stride_ws, stride_wn, stride_o,
                 ROW_BLOCKS, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    seg = pid // ROW_BLOCKS
    start = tl.load(seg_ptr + seg).to(tl.int64)
    length = tl.load(seg_ptr + num_segs + seg)
    slot = tl.load(seg_ptr + 2 * num_segs + seg).to(tl.int64)
    first = (pid % ROW_BLOCKS) * BM
    if first >= length:
        return
    rows = first + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    row_ok = rows < length
    col_ok = cols < N
    x_rows = x_ptr + (start + rows.to(tl.int64))[:, None] * stride_x
    w_cols = w_ptr + slot * stride_ws + cols.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < K
        a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_cols + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)    # [BK, BN] = w[slot].T
        if IEEE:        # float32: IEEE products, not TF32 (the reference's precision)
            acc += tl.dot(a, b.to(a.dtype), input_precision="ieee")
        else:
            acc += tl.dot(a, b.to(a.dtype))
    o_ptrs = out_ptr + (start + rows.to(tl.int64))[:, None] * stride_o + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    prev = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, (prev + acc).to(out_ptr.dtype.element_ty), mask=mask)


def sgmv_triton(x: torch.Tensor, w: torch.Tensor, segments, out: torch.Tensor) -> torch.Tensor:
    """out[start:start+n] += x[start:start+n] @ w[slot].T for each segment; returns out. segments: a
    kernels.lora.Segments (not imported: the dispatch there imports this module)."""
    for name, t in (("x", x), ("w", w), ("out", out)):
        check_float(name, t)
        check_last_contiguous(name, t)
    check_same_device(x=x, w=w, out=out)
    check(x.dim() == 2 and w.dim() == 3 and out.dim() == 2, "x [T, K], w [S, N, K], out [T, N]")
    check(w.shape[2] == x.shape[1] and out.shape == (x.shape[0], w.shape[1]),
          f"shapes: x {tuple(x.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)}")
    check(w.dtype == x.dtype, f"w is {w.dtype}, x is {x.dtype}")
    m = segments.max_rows
    if m == 0 or out.numel() == 0:
        return out
    n, k = w.shape[1], w.shape[2]
    BM = 16 if m <= 16 else 64
    BN = min(64, max(16, next_pow2(n)))
    BK = min(64, max(16, next_pow2(k)))
    row_blocks = triton.cdiv(m, BM)
    grid = (len(segments.spans) * row_blocks, triton.cdiv(n, BN))
    launch(_sgmv_kernel, grid, x.device, x, w, out, segments.tensors(), len(segments.spans), n, k,
           x.stride(0), w.stride(0), w.stride(1), out.stride(0), row_blocks, BM=BM, BN=BN, BK=BK,
           IEEE=x.dtype == torch.float32)
    return out
