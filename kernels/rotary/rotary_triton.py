"""Triton rotary embedding, HF rotate-half layout (dim i pairs with dim i + D/2).

    q: [T, Hq, D], k: [T, Hk, D], cos/sin: [T, D]
    out[..., :D/2] = x1 * cos[:D/2] - x2 * sin[:D/2]
    out[..., D/2:] = x2 * cos[D/2:] + x1 * sin[D/2:]        (x1, x2 = the two halves)

Same as `kernels.rotary.apply_rotary_ref`, computed in float32 and rounded once (the
reference rounds each product, so the two differ by at most an ulp or so).

One launch for q and k: grid (T, head blocks of q + head blocks of k); cos and sin rows
are read by each of a token's programs (usually one or two). q and k may be strided
views (e.g. slices of a fused qkv projection) as long as head_dim is contiguous.
`inplace=True` writes the result back into q and k (saves an allocation and a write
stream); the default returns new tensors, as the reference does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from jobrunner.kernels.common.triton_utils import check, check_float, check_last_contiguous, check_same_device, launch, next_pow2


@triton.jit
def _rotate_heads(x_ptr, out_ptr, t, heads, dims, c1, c2, s1, s2, stride_xt, stride_xh, stride_ot, stride_oh,
                  n_heads, half):
    mask = (heads[:, None] < n_heads) & (dims[None, :] < half)
    xp = x_ptr + t * stride_xt + heads[:, None] * stride_xh + dims[None, :]
    x1 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xp + half, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * c1[None, :] - x2 * s1[None, :]
    o2 = x2 * c2[None, :] + x1 * s2[None, :]
    op = out_ptr + t * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(op, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(op + half, o2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_ct, stride_st,
    n_q_heads, n_k_heads, half, q_head_blocks,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # grid (T, q head blocks + k head blocks): q and k in one launch.
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < half
    c1 = tl.load(cos_ptr + t * stride_ct + dims, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + half + dims, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_st + dims, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_st + half + dims, mask=dmask, other=0.0).to(tl.float32)
    if hb < q_head_blocks:
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        _rotate_heads(q_ptr, qo_ptr, t, heads, dims, c1, c2, s1, s2, stride_qt, stride_qh, stride_qot, stride_qoh,
                      n_q_heads, half)
    else:
        heads = (hb - q_head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        _rotate_heads(k_ptr, ko_ptr, t, heads, dims, c1, c2, s1, s2, stride_kt, stride_kh, stride_kot, stride_koh,
                      n_k_heads, half)


def apply_rotary_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hk, D], cos/sin: [T, D] -> (q_rot, k_rot), dtypes of q and k."""
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_float(name, t)
        check_last_contiguous(name, t)
    check(q.dim() == 3 and k.dim() == 3, f"q, k: expected [T, H, D], got {tuple(q.shape)}, {tuple(k.shape)}")
    T, _, D = q.shape
    check(k.shape[0] == T and k.shape[2] == D, f"k: shape {tuple(k.shape)} does not match q {tuple(q.shape)}")
    check(D % 2 == 0, f"head_dim must be even, got {D}")
    check(cos.shape == (T, D) and sin.shape == (T, D),
          f"cos/sin: expected ({T}, {D}), got {tuple(cos.shape)}, {tuple(sin.shape)}")
    device = check_same_device(q=q, k=k, cos=cos, sin=sin)
    q_out = q if inplace else torch.empty(q.shape, dtype=q.dtype, device=device)
    k_out = k if inplace else torch.empty(k.shape, dtype=k.dtype, device=device)
    if T == 0:
        return q_out, k_out
    BLOCK_D = next_pow2(D // 2)
    BLOCK_H = min(next_pow2(max(q.shape[1], k.shape[1], 1)), max(1, 4096 // BLOCK_D))
    q_blocks, k_blocks = triton.cdiv(q.shape[1], BLOCK_H), triton.cdiv(k.shape[1], BLOCK_H)
    if q_blocks + k_blocks == 0:
        return q_out, k_out
    launch(_rotary_kernel, (T, q_blocks + k_blocks), device,
           q, k, q_out, k_out, cos, sin,
           q.stride(0), q.stride(1), k.stride(0), k.stride(1),
           q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos.stride(0), sin.stride(0),
           q.shape[1], k.shape[1], D // 2, q_blocks, BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, num_warps=4)
    return q_out, k_out
