"""8-bit KV cache: int8 values with one float32 scale per token and KV head.

Layout, per layer (same slot addressing as the float cache, slot = block * block_size + offset):

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]  int8
    k_scale, v_scale: [num_blocks, block_size, num_kv_heads]            float32

    value(block, offset, head, d) ~= cache[block, offset, head, d] * scale[block, offset, head]

Quantization is symmetric per (token, head) vector: amax = max |x| over head_dim
(floored at 1e-8 so all-zero vectors stay finite), scale = amax / 127,
q = round_half_away_from_zero(x * (127 / amax)) clamped to [-127, 127]. The Triton
kernel computes the same float32 formula; its result may differ by one step where
x * 127 / amax lands within an ulp of a .5 tie.

Half the bytes of a bfloat16 cache (plus 4 bytes per token-head for the scale, 3 % at
head_dim 128): twice the tokens in the same memory, and half the memory traffic for
decode attention, which is bandwidth bound.
"""
from __future__ import annotations

import torch

AMAX_FLOOR = 1e-8


def quantize_int8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] float -> (int8 [..., D], float32 scale [...])."""
    xf = x.float()
    amax = xf.abs().amax(-1).clamp(min=AMAX_FLOOR)
    y = xf * (127.0 / amax)[..., None]
    q = (torch.sign(y) * torch.floor(y.abs() + 0.5)).clamp(-127, 127).to(torch.int8)
    return q, amax / 127.0


def store_kv_int8_ref(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping) -> None:
    """k, v: [T, Hk, D] float, quantized and written at slot_mapping [T] (int64) of the int8 caches."""
    kq, ks = quantize_int8_ref(k)
    vq, vs = quantize_int8_ref(v)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, kq)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, vq)
    k_scale.view(-1, k_scale.shape[2]).index_copy_(0, slot_mapping, ks)
    v_scale.view(-1, v_scale.shape[2]).index_copy_(0, slot_mapping, vs)


def dequantize_kv_int8_ref(cache: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[NB, BS, Hk, D] int8 and [NB, BS, Hk] -> [NB, BS, Hk, D] in dtype (the whole cache: a reference, slow)."""
    return (cache.float() * scale[..., None]).to(dtype)


def paged_attention_int8_ref(q, k_cache, v_cache, k_scale, v_scale, meta, scale: float, *, sliding: bool = True,
                             softcap: float | None = None) -> torch.Tensor:
    """Attention over an int8 cache: the float reference, dequantizing only the blocks it gathers."""
    from jobrunner.kernels.attention.reference import paged_attention_ref
    return paged_attention_ref(q, k_cache, v_cache, meta, scale, k_scale, v_scale, sliding=sliding, softcap=softcap)


def store_kv_int8(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping) -> None:
    """Dispatch: Triton on CUDA (or with JOBRUNNER_TRITON=1), the reference elsewhere."""
    from jobrunner.kernels.common.triton_utils import use_triton
    if use_triton(k):
        from jobrunner.kernels.attention.kv_cache_triton import store_kv_triton
        store_kv_triton(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    else:
        store_kv_int8_ref(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)
