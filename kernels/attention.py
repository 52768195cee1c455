"""Attention over a paged KV cache, and writing new K/V into it.

Cache layout, per layer (block_size slots a block, slot = block_id * block_size + offset):

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]

A step's tokens are flattened: the decodes first (one token per sequence), then the
prefill chunks, each sequence's tokens contiguous and in position order. Each new token
attends causally to its sequence's cached tokens and to the chunk's earlier tokens; the
step's K/V are written to the cache before any attention reads it.

Per layer, two switches (Gemma 2/3): `sliding` says whether the layer sees only the last
meta.sliding_window keys (Mistral: every layer; Gemma: the layers whose type is
sliding_attention) or all of them; `softcap` bounds the scaled scores to softcap * tanh(s / softcap).
"""
from __future__ import annotations

import time

import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.attention_ref import _decode_ref, _prefill_ref, paged_attention_ref, store_kv_ref
from kernels.cpu_prefill import prefill_attention_cpu
from kernels.triton_utils import use_triton


def _run_package(out, q, k_cache, v_cache, mask, scale, softcap, runner, key, cpu_decode) -> bool:
    """The decode rows through the in-place package; False (and the package set aside) when it fails: a
    package from an older build of this code, say. The gather path then serves."""
    from kernels.cpu_attention import decode_attention_cpu
    try:
        out[:] = decode_attention_cpu(q, k_cache, v_cache, mask, scale, softcap, runner)
        return True
    except Exception as e:  # noqa: BLE001 - any failure of a compiled package: fall back, say so once
        cpu_decode.set_aside(key, e)
        return False


def paged_attention_cpu(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, *, sliding: bool = True,
                        softcap: float | None = None) -> torch.Tensor:
    """The torch path for a float cache: decode rows through kernels/cpu_attention.py (blocks read in place)
    when the step's meta.cpu_decode hands out a loaded package, else gathered (_decode_ref); prefill rows
    through kernels/cpu_prefill.py where it covers the layer, else gathered (_prefill_ref)."""
    if not meta._prepared:
        meta.prepare()
    window = meta.sliding_window if sliding else None
    nd = meta.num_decodes
    out = torch.empty_like(q)
    if nd:
        out[:nd] = _decodes_cpu(q[:nd], k_cache, v_cache, meta, scale, window, softcap)
    if meta.num_prefills:
        if softcap is None and not _window_cuts(meta, window):
            prefill_attention_cpu(q[nd:], k_cache, v_cache, meta.prefill_plan(), scale, out=out[nd:])
        else:
            out[nd:] = _prefill_ref(q[nd:], k_cache, v_cache, meta, scale, None, None, window, softcap)
    return out


def _window_cuts(meta: AttentionMetadata, window: int | None) -> bool:
    """Whether a sliding window hides any key from a prefill row (a window at least every sequence's
    length hides none)."""
    return bool(window) and max(meta.seq_lens[meta.num_decodes:]) > window


def _decodes_cpu(q, k_cache, v_cache, meta, scale, window, softcap) -> torch.Tensor:
    """The decode rows q: [nd, Hq, D]: through the in-place package when one is loaded, else gathered."""
    cpu_decode = meta.cpu_decode
    if cpu_decode is None:
        return _decode_ref(q, k_cache, v_cache, meta, scale, None, None, window, softcap)
    from kernels.cpu_attention import decode_key
    key = decode_key(q, k_cache, softcap)
    runner = cpu_decode.runner(key)
    mask = meta.decode_mask(k_cache.shape[0], window) if runner is not None else None
    out = torch.empty_like(q)
    if mask is not None and _run_package(out, q, k_cache, v_cache, mask, scale, softcap, runner, key, cpu_decode):
        return out
    t0 = time.perf_counter()
    out = _decode_ref(q, k_cache, v_cache, meta, scale, None, None, window, softcap)
    cpu_decode.note_gather(key, time.perf_counter() - t0)
    return out


def store_kv(k, v, k_cache, v_cache, slot_mapping):
    """Dispatch: Triton on CUDA (or with JOBRUNNER_TRITON=1), the reference elsewhere.
    (int8 caches: kernels.kv_int8.store_kv_int8.)"""
    if use_triton(k):
        from kernels.triton_kv_cache import store_kv_triton
        store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        store_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, meta, scale, k_scale=None, v_scale=None, *, sliding=True, softcap=None):
    """Dispatch: Triton on CUDA (or with JOBRUNNER_TRITON=1), the reference elsewhere.
    k_scale/v_scale: only for int8 caches (layout in kernels/kv_int8.py); sliding, softcap: the layer's
    switches (module docstring)."""
    if use_triton(q):
        from kernels.triton_attention import paged_attention_triton
        return paged_attention_triton(q, k_cache, v_cache, meta, scale, k_scale, v_scale,
                                      sliding=sliding, softcap=softcap)
    if k_cache.dtype == torch.int8:
        from kernels.kv_int8 import paged_attention_int8_ref
        return paged_attention_int8_ref(q, k_cache, v_cache, k_scale, v_scale, meta, scale,
                                        sliding=sliding, softcap=softcap)
    return paged_attention_cpu(q, k_cache, v_cache, meta, scale, sliding=sliding, softcap=softcap)
