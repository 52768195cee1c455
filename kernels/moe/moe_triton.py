"""Triton fused MoE: two grouped GEMMs over the slots sorted by expert (layouts: kernels/moe/moe.py).

    align_to_blocks:  slots -> runs per expert, padded to BLOCK_M; block b -> its expert (torch, below)
    GEMM 1 (GATED):   h[s] = silu(x[s // k] @ W1_e) * (x[s // k] @ W3_e)    [T*k, I]   (w13[e] = [W1_e | W3_e])
    GEMM 2:           o[s] = topk_weight[s] * (h[s] @ W2_e)                  [T*k, H]
    y = o.view(T, k, H).sum(1)

Each program computes a [BLOCK_M, BLOCK_N] tile of one expert's run: the block's rows share
the expert, so its weight tile is read once for up to BLOCK_M tokens, and a block of padding
only (-1) returns at once. GEMM 1 keeps a gate and an up accumulator for the same N columns
and writes silu(gate) * up directly: the [T*k, 2I] product never reaches memory and there is
no separate activation launch (decode steps are bandwidth bound, so that write and read
were a fifth of the layer's traffic). Quantized weights (int8 or float8, per output channel)
are converted to x.dtype in registers and the scale is applied to the float32 accumulator:
sum_k x[k] * q[k, n] * s[n] = s[n] * sum_k x[k] * q[k, n]. Weight tiles are [BLOCK_K, BLOCK_N]
rows of the input-major weights, contiguous along N. Float32 inputs use IEEE products.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from jobrunner.kernels.common.triton_utils import check, check_float, check_same_device, launch


def align_to_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots sorted by expert, each expert's run padded to a multiple of block_m, so one block of
    block_m rows belongs to one expert. No host sync (CUDA-graph safe): sizes are upper bounds.

    -> sorted_slots [max_blocks * block_m] int32: slot index t*k + j, or T*k (padding);
       block_expert [max_blocks] int32: the expert of each block, -1 past the last used block.

        expert:        0 0 0 | 2 2 | ...          (expert 1 had no tokens: no block)
        sorted_slots:  a b c - | d e - - | ...    (block_m = 4, '-' = padding)
    """
    flat = topk_ids.reshape(-1)
    slots = flat.numel()
    max_blocks = -(-slots // block_m) + num_experts          # sum ceil(c_e / b) < slots / b + E
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(slots, device=flat.device) - (counts.cumsum(0) - counts)[expert]
    sorted_slots = torch.full((max_blocks * block_m,), slots, dtype=torch.int32, device=flat.device)
    sorted_slots[padded_end[expert] - padded[expert] + rank] = order.to(torch.int32)
    block_expert = torch.searchsorted(padded_end // block_m, torch.arange(max_blocks, device=flat.device),
                                      right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_slots, block_expert


@triton.jit
def _moe_gemm_kernel(
    a_ptr, b_ptr, scale_ptr, w_ptr, c_ptr, sorted_ptr, block_expert_ptr,
    num_slots, N, K,
    stride_am, stride_be, stride_bk, stride_bn, stride_se, stride_cm,
    A_DIV: tl.constexpr,          # a row = slot // A_DIV (k for GEMM 1, whose a is x; 1 for GEMM 2)
    GATED: tl.constexpr,          # b holds [gate | up] columns: out column n = silu(gate n) * up n (N = I)
    HAS_SCALE: tl.constexpr, MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))      # [BM]
    m_ok = slots < num_slots
    a_rows = (slots // A_DIV).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    adt = a_ptr.dtype.element_ty
    b_base = b_ptr + expert * stride_be
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + kk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)                                                  # [BM, BK]
        b_mask = n_ok[None, :] & k_ok[:, None]
        b_rows = b_base + kk.to(tl.int64)[:, None] * stride_bk                   # [BK, 1]
        b = tl.load(b_rows + rn[None, :] * stride_bn, mask=b_mask, other=0.0).to(adt)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        if GATED:
            u = tl.load(b_rows + (rn + N)[None, :] * stride_bn, mask=b_mask, other=0.0).to(adt)
            if IEEE:
                acc_up += tl.dot(a, u, input_precision="ieee")
            else:
                acc_up += tl.dot(a, u)
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + expert * stride_se + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up *= tl.load(scale_ptr + expert * stride_se + N + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        acc *= tl.load(w_ptr + slots, mask=m_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + slots.to(tl.int64)[:, None] * stride_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _block_m(slots: int, num_experts: int) -> int:
    """Rows per block: small when each expert sees few slots (decode), so padding stays small."""
    per_expert = slots / num_experts
    return 16 if per_expert <= 16 else (32 if per_expert <= 64 else 64)


def _check(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale) -> None:
    check_float("x", x)
    check(x.dim() == 2 and x.stride(1) == 1, f"x: expected [T, H] with contiguous rows, got {tuple(x.shape)}")
    e, h, two_i = w13.shape
    check(two_i % 2 == 0 and h == x.shape[1], f"w13: expected [E, {x.shape[1]}, 2I], got {tuple(w13.shape)}")
    check(tuple(w2.shape) == (e, two_i // 2, h), f"w2: expected {(e, two_i // 2, h)}, got {tuple(w2.shape)}")
    check(w13.is_contiguous() and w2.is_contiguous(), "w13, w2: must be contiguous")
    check(topk_ids.shape == topk_weights.shape and topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0],
          f"topk_ids, topk_weights: expected [T, k], got {tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    check((w13_scale is None) == (w2_scale is None), "w13_scale and w2_scale: give both or neither")
    if w13_scale is None:
        check(w13.dtype == x.dtype and w2.dtype == x.dtype, f"float weights must be x.dtype {x.dtype}")
    else:
        check(tuple(w13_scale.shape) == (e, two_i) and tuple(w2_scale.shape) == (e, h),
              f"scales: expected {(e, two_i)} and {(e, h)}, got {tuple(w13_scale.shape)}, {tuple(w2_scale.shape)}")
        check(w13_scale.is_contiguous() and w2_scale.is_contiguous(), "scales: must be contiguous")
    check_same_device(x=x, w13=w13, w2=w2, topk_ids=topk_ids)


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                     w2_scale: torch.Tensor | None = None, foreign: bool = False) -> torch.Tensor:
    """[T, H] -> [T, H] in x.dtype (see the module doc; foreign: ids E are other ranks' experts, whose
    slots' blocks are skipped and whose rows of the output stay zero)."""
    _check(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    t, k = topk_ids.shape
    num_experts, h, two_i = w13.shape
    inter = two_i // 2
    slots = t * k
    if t == 0:
        return torch.empty_like(x)
    block_m = _block_m(slots, num_experts)
    sorted_slots, block_expert = align_to_blocks(topk_ids, num_experts + foreign, block_m)
    if foreign:
        block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    weights = topk_weights.reshape(-1).float().contiguous()
    ieee = x.dtype == torch.float32
    block_n, block_k = (32, 32) if ieee else (64, 64)
    has_scale = w13_scale is not None
    scales13 = w13_scale if has_scale else weights      # (an unused pointer when not quantized)
    scales2 = w2_scale if has_scale else weights
    hidden = torch.empty((slots, inter), dtype=x.dtype, device=x.device)
    out = (torch.zeros if foreign else torch.empty)((slots, h), dtype=x.dtype, device=x.device)
    blocks = block_expert.numel()
    launch(_moe_gemm_kernel, (blocks, triton.cdiv(inter, block_n)), x.device,
           x, w13, scales13, weights, hidden, sorted_slots, block_expert,
           slots, inter, h, x.stride(0), *w13.stride(), scales13.stride(0), hidden.stride(0),
           A_DIV=k, GATED=True, HAS_SCALE=has_scale, MUL_WEIGHT=False, IEEE=ieee,
           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    launch(_moe_gemm_kernel, (blocks, triton.cdiv(h, block_n)), x.device,
           hidden, w2, scales2, weights, out, sorted_slots, block_expert,
           slots, h, inter, hidden.stride(0), *w2.stride(), scales2.stride(0), out.stride(0),
           A_DIV=1, GATED=False, HAS_SCALE=has_scale, MUL_WEIGHT=True, IEEE=ieee,
           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out.view(t, k, h).sum(dim=1)
