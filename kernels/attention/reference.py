"""The pure-torch reference of paged attention (kernels/attention/attention.py has the layout): each sequence's
blocks gathered out of the pool, padded, and SDPA over them. The CPU path of int8 caches
(kernels/attention/kv_int8.py), of decodes when the in-place CPU kernel is not loaded, and of prefill chunks that
kernels/attention/cpu_prefill.py does not cover (a sliding window that cuts, soft-capping)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from jobrunner.kernels.attention.metadata import AttentionMetadata


def store_kv_ref(k, v, k_cache, v_cache, slot_mapping) -> None:
    """k, v: [T, Hk, D] written at slot_mapping [T] of the flattened caches."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def paged_attention_ref(q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                        k_scale=None, v_scale=None, *, sliding: bool = True,
                        softcap: float | None = None) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]. With k_scale/v_scale the caches are int8 (kernels/attention/kv_int8.py).
    sliding: this layer keeps to meta.sliding_window (when set); softcap: scores -> softcap * tanh(s / softcap)."""
    if not meta._prepared:
        meta.prepare()
    out = torch.empty_like(q)
    nd = meta.num_decodes
    window = meta.sliding_window if sliding else None
    if nd:
        out[:nd] = _decode_ref(q[:nd], k_cache, v_cache, meta, scale, k_scale, v_scale, window, softcap)
    if meta.num_prefills:
        out[nd:] = _prefill_ref(q[nd:], k_cache, v_cache, meta, scale, k_scale, v_scale, window, softcap)
    return out


def _decode_ref(q, k_cache, v_cache, meta, scale, k_scale, v_scale, window, softcap):
    """The decode rows q: [nd, Hq, D], one query row each: per group of like length (meta.decode_groups()),
    their blocks gathered and padded to the group's longest."""
    def attend(g, rows, blocks):
        qg = q if rows is None else q[rows]
        n = qg.shape[0]
        k, v = _blocks(k_cache, k_scale, blocks, n, q.dtype), _blocks(v_cache, v_scale, blocks, n, q.dtype)
        return _sdpa(qg[:, None], k, v, meta.mask("decode", window, g), scale, softcap)[:, 0]
    groups = meta.decode_groups()
    if len(groups) == 1:
        return attend(0, None, groups[0][1][0])
    out = torch.empty_like(q)
    for g, (rows, gathered) in enumerate(groups):
        out[rows] = attend(g, rows, gathered[0])
    return out


def _prefill_ref(q, k_cache, v_cache, meta, scale, k_scale, v_scale, window, softcap):
    """The prefill rows q: [T - nd, Hq, D] as a padded batch of chunks over their gathered blocks."""
    blocks, _, q_index, q_valid, _ = meta.prefill_part()
    n = q_index.shape[0]
    qp = q[q_index]                                                                  # [B, qmax, Hq, D]
    k, v = _blocks(k_cache, k_scale, blocks, n, q.dtype), _blocks(v_cache, v_scale, blocks, n, q.dtype)
    return _sdpa(qp, k, v, meta.mask("prefill", window), scale, softcap)[q_valid]


def _blocks(cache, cache_scale, blocks, batch: int, dtype):
    """The listed blocks of a [num_blocks, block_size, Hk, D] cache as [batch, n * block_size, Hk, D]."""
    x = cache.index_select(0, blocks)
    if cache_scale is not None:
        x = (x.float() * cache_scale.index_select(0, blocks)[..., None]).to(dtype)
    return x.view(batch, -1, *cache.shape[2:])


def _sdpa(q, k, v, mask, scale, softcap=None):
    """q: [B, Lq, Hq, D], k/v: [B, Lk, Hk, D], mask: [B, 1, Lq, Lk] -> [B, Lq, Hq, D]."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if softcap is None:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return o.transpose(1, 2)
    # SDPA has no soft-capping: the scores by hand, as HF's eager Gemma 2 computes them
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale                                 # [B, Hq, Lq, Lk]
    s = torch.tanh(s / softcap) * softcap
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, v).transpose(1, 2)
