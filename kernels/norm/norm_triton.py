"""Triton RMSNorm, optionally fused with the residual add before it.

Matches `kernels.norm.rms_norm_ref` step for step, including its roundings:

    s   = x + residual                 (rounded to x.dtype, returned as the new residual)
    n   = s * rsqrt(mean(s^2) + eps)   (float32, then rounded to x.dtype)
    out = weight * n                   (in promote(weight.dtype, x.dtype))

One program per row: a whole row (hidden <= 64K) sits in registers, so the add, the
sum of squares and the scaling read x and residual once and write twice, instead of
the five passes over memory of the unfused torch code.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from jobrunner.kernels.common.triton_utils import check, check_float, check_last_contiguous, check_same_device, launch, next_pow2


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x0, stride_x1, stride_r0, stride_r1, stride_o, stride_ro,
    n_inner, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    # Row `row` of the flattened [N, H] output is x[row // n_inner, row % n_inner, :] of
    # the [N0, n_inner, H] input view: strided per-head rows (q/k norm on a slice of a
    # fused qkv output) are read in place, without a gathering copy.
    row = tl.program_id(0).to(tl.int64)
    i0 = row // n_inner
    i1 = row % n_inner
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + i0 * stride_x0 + i1 * stride_x1 + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + i0 * stride_r0 + i1 * stride_r1 + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / n_cols
    rstd = 1.0 / tl.sqrt(var + eps)
    n = (h * rstd).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * n.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., H]; weight: [H]. Returns (out, x + residual) like rms_norm_ref.

    Inputs are never modified. Rows may be strided (e.g. a view into a wider buffer) as
    long as the hidden dimension is contiguous and the leading dims flatten to one.
    """
    check_float("x", x)
    check_float("weight", weight)
    check(x.dim() >= 1 and x.shape[-1] > 0, f"x: expected [..., hidden], got {tuple(x.shape)}")
    H = x.shape[-1]
    check(weight.shape == (H,), f"weight: expected shape ({H},), got {tuple(weight.shape)}")
    check(H <= 65536, f"hidden size {H} too large for the one-row-per-program kernel")
    check_last_contiguous("x", x)
    check(weight.is_contiguous(), "weight must be contiguous")
    tensors = {"x": x, "weight": weight}
    if residual is not None:
        check(residual.shape == x.shape, f"residual: shape {tuple(residual.shape)} != x {tuple(x.shape)}")
        check(residual.dtype == x.dtype, f"residual: dtype {residual.dtype} != x {x.dtype}")
        check_last_contiguous("residual", residual)
        tensors["residual"] = residual
    device = check_same_device(**tensors)

    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=device)
    res_out = torch.empty(x.shape, dtype=x.dtype, device=device) if residual is not None else x
    if out.numel() == 0:
        return out, res_out
    x3 = _rows3(x)
    r3 = _rows3(residual) if residual is not None else x3
    o2 = out.view(-1, H)
    ro2 = res_out.view(-1, H) if residual is not None else o2
    BLOCK = next_pow2(H)
    num_warps = min(max(BLOCK // 256, 1), 16)
    launch(_rms_norm_kernel, (o2.shape[0],), device,
           x3, r3, weight, o2, ro2,
           x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1), o2.stride(0), ro2.stride(0),
           x3.shape[1], H, float(eps),
           HAS_RESIDUAL=residual is not None, BLOCK=BLOCK, num_warps=num_warps)
    return out, res_out


def _rows3(t: torch.Tensor) -> torch.Tensor:
    """[..., H] -> a [N0, N1, H] view (no copy) when the leading dims allow it; a copy otherwise."""
    H = t.shape[-1]
    if t.dim() == 1:
        return t.view(1, 1, H)
    if t.dim() == 2:
        return t.unsqueeze(1)
    try:
        return t.view(-1, t.shape[-2], H)
    except RuntimeError:
        return t.reshape(-1, 1, H).contiguous()
