"""Triton kernel writing a step's new K and V into the paged cache (float or int8).

    k, v:             [T, Hk, D]                              (new tokens, any float dtype)
    k_cache, v_cache: [num_blocks, block_size, Hk, D]         (dtype of k, or int8)
    k_scale, v_scale: [num_blocks, block_size, Hk] float32    (int8 caches only; see kernels/attention/kv_int8.py)
    slot_mapping:     [T] int64, slot = block * block_size + offset; slot < 0 = skip
                      (padding tokens, e.g. in a CUDA-graph batch)

One program per token writes all its heads of K and V (Hk * D elements each): a
scatter with one slot lookup per token. For int8 the program also reduces |x| over
head_dim per head, so quantization costs no extra pass over K/V.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from jobrunner.kernels.common.triton_utils import check, check_float, check_last_contiguous, check_same_device, launch, next_pow2


@triton.jit
def _store_int8_rows(x, dst, scale_dst, mask, smask):
    """Rows of x [heads, head_dim] as int8 (symmetric, absmax / 127 per row, rounded half away
    from zero, like kernels/attention/kv_int8.py's reference) with their float32 scales."""
    xf = x.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-8)
    y = xf * (127.0 / amax)[:, None]
    q = tl.where(y >= 0, tl.floor(y + 0.5), -tl.floor(0.5 - y))
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    tl.store(dst, q.to(tl.int8), mask=mask)
    tl.store(scale_dst, amax / 127.0, mask=smask)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    stride_sb, stride_ss, stride_sh,
    n_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, INT8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    live_heads = tl.where(slot >= 0, n_heads, 0)                                # 0: padding token, skip
    mask = (h[:, None] < live_heads) & (d[None, :] < head_dim)
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
    kc = kc_ptr + blk * stride_kcb + off * stride_kcs + h[:, None] * stride_kch + d[None, :]
    vc = vc_ptr + blk * stride_vcb + off * stride_vcs + h[:, None] * stride_vch + d[None, :]
    if INT8:
        smask = h < live_heads
        sp = blk * stride_sb + off * stride_ss + h * stride_sh
        _store_int8_rows(k, kc, ks_ptr + sp, mask, smask)
        _store_int8_rows(v, vc, vs_ptr + sp, mask, smask)
    else:
        tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> None:
    """Write k, v [T, Hk, D] into the caches at slot_mapping (in place). int8 caches need k_scale, v_scale."""
    check_float("k", k)
    check_float("v", v)
    check(k.dim() == 3 and v.shape == k.shape, f"k, v: expected equal [T, Hk, D], got {tuple(k.shape)}, "
          f"{tuple(v.shape)}")
    T, Hk, D = k.shape
    check(k_cache.dim() == 4 and k_cache.shape[2:] == (Hk, D) and v_cache.shape == k_cache.shape,
          f"caches: expected [num_blocks, block_size, {Hk}, {D}], got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    check(slot_mapping.shape == (T,) and slot_mapping.dtype in (torch.int64, torch.int32),
          f"slot_mapping: expected [{T}] int64, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_contiguous(name, t)
    int8 = k_cache.dtype == torch.int8
    tensors = dict(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if int8:
        check(v_cache.dtype == torch.int8, f"v_cache: dtype {v_cache.dtype}, expected int8 like k_cache")
        check(k_scale is not None and v_scale is not None, "int8 caches need k_scale and v_scale")
        nb, bs = k_cache.shape[:2]
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            check(s.shape == (nb, bs, Hk) and s.dtype == torch.float32,
                  f"{name}: expected [{nb}, {bs}, {Hk}] float32, got {tuple(s.shape)} {s.dtype}")
        check(k_scale.stride() == v_scale.stride(), "k_scale and v_scale must have the same strides")
        tensors.update(k_scale=k_scale, v_scale=v_scale)
    else:
        check(k_scale is None and v_scale is None, "scales given for a non-int8 cache")
        check_float("k_cache", k_cache)
        check(v_cache.dtype == k_cache.dtype, f"v_cache: dtype {v_cache.dtype} != k_cache {k_cache.dtype}")
        k_scale = v_scale = k_cache  # unused placeholders
    device = check_same_device(**tensors)
    if T == 0:
        return
    BLOCK_H, BLOCK_D = next_pow2(Hk), next_pow2(D)
    check(BLOCK_H * BLOCK_D <= 32768, f"num_kv_heads * head_dim = {Hk * D} too large for one program")
    s_strides = k_scale.stride()[:3] if int8 else (0, 0, 0)
    launch(_store_kv_kernel, (T,), device,
           k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping,
           k.stride(0), k.stride(1), v.stride(0), v.stride(1),
           k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
           v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
           *s_strides, Hk, D,
           BLOCK_SIZE=k_cache.shape[1], BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, INT8=int8,
           num_warps=min(max(BLOCK_H * BLOCK_D // 256, 1), 8))
