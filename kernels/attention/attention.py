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

import torch

from jobrunner.kernels.attention.metadata import AttentionMetadata
from jobrunner.kernels.attention.reference import _decode_ref, _prefill_ref, paged_attention_ref, store_kv_ref
from jobrunner.kernels.attention.cpu_attention import INVARIANT_SPLIT, decode_attention_cpu, prefill_attention_in_place
from jobrunner.kernels.attention.cpu_prefill import prefill_attention_cpu
from jobrunner.kernels.common.triton_utils import use_triton


def paged_attention_cpu(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, *, sliding: bool = True,
                        softcap: float | None = None) -> torch.Tensor:
    """The torch path for a float cache: decode rows through kernels/attention/cpu_attention.py (blocks read in place)
    when the step's meta.cpu_decode hands out the loaded kernel, else gathered (_decode_ref); prefill rows
    through the same kernel where it covers the layer (_prefill_in_place), else kernels/attention/cpu_prefill.py
    where that does, else gathered (_prefill_ref).
    meta.batch_invariant: every row, decode or prefill, through the in-place kernel (_invariant_cpu)."""
    if not meta._prepared:
        meta.prepare()
    q = q.contiguous()          # the in-place kernels read rows densely (a view of a fused projection is not)
    window = meta.sliding_window if sliding else None
    if meta.batch_invariant:
        return _invariant_cpu(q, k_cache, v_cache, meta, scale, window, softcap)
    if (meta.num_prefills and len(meta.query_lens) <= SHORT_STEP_ROWS
            and max(meta.query_lens[meta.num_decodes:]) <= SHORT_CHUNK):
        out = _short_chunks_cpu(q, k_cache, v_cache, meta, scale, window, softcap)
        if out is not None:
            return out
    nd = meta.num_decodes
    out = torch.empty_like(q)
    if nd:
        out[:nd] = _decodes_cpu(q[:nd], k_cache, v_cache, meta, scale, window, softcap)
    if meta.num_prefills:
        if softcap is None and not _window_cuts(meta, window):
            if not _prefill_in_place(q, k_cache, v_cache, meta, scale, out):
                prefill_attention_cpu(q[nd:], k_cache, v_cache, meta.prefill_plan(), scale, out=out[nd:])
        else:
            out[nd:] = _prefill_ref(q[nd:], k_cache, v_cache, meta, scale, None, None, window, softcap)
    return out


# A step of a few rows whose prompt chunks are all this short (speculative verify chunks: a row's last token and
# its drafts; a prompt's few tokens after a prefix-cache hit) runs every token as a decode row over its own keys,
# read in place, where the chunk path gathers each row's whole cached context for a handful of queries: 1.13x a
# verify-heavy engine's time at 8 rows (2-core EPYC). In larger steps the gathered path's batched matmuls won
# (ngram at 100 rows: 0.51x against 0.73x), hence the row bound.
SHORT_CHUNK = 17
SHORT_STEP_ROWS = 16


def _invariant_cpu(q, k_cache, v_cache, meta, scale, window, softcap) -> torch.Tensor:
    """Batch-invariant attention: each token a row of its own over its position's keys, in splits of
    INVARIANT_SPLIT keys, so its bits depend on its keys alone: not on the batch, the threads, how its
    prompt was chunked or whether its prefix came from the cache (a prefill token and a decode at the
    same position reduce alike). No fallback: a gathered result would not be the same bits."""
    lib = meta.cpu_decode.library() if meta.cpu_decode is not None else None
    if lib is None or not lib.covers(q, k_cache):
        raise RuntimeError("batch-invariant attention needs the in-place CPU kernel (kernels/attention/cpu_attention.c) "
                           f"for a {k_cache.dtype} cache; it is not loaded (a C compiler, JOBRUNNER_CPU_DECODE=auto)")
    tables, seq_lens = meta.token_rows()
    return decode_attention_cpu(q, k_cache, v_cache, tables, seq_lens, scale, window, softcap, lib,
                                split=INVARIANT_SPLIT)


def _short_chunks_cpu(q, k_cache, v_cache, meta, scale, window, softcap) -> torch.Tensor | None:
    """Every token of the step a decode row of the in-place kernel (SHORT_CHUNK); None where the kernel is not
    loaded or fails (then set aside for good, as for decodes)."""
    cpu_decode = meta.cpu_decode
    lib = cpu_decode.library() if cpu_decode is not None else None
    if lib is None or not lib.covers(q, k_cache):
        return None
    try:
        return decode_attention_cpu(q, k_cache, v_cache, *meta.token_rows(), scale, window, softcap, lib)
    except Exception as e:  # noqa: BLE001 - a library this process can't run: the chunk path, said once
        cpu_decode.set_aside(e)
        return None


def _prefill_in_place(q, k_cache, v_cache, meta, scale, out) -> bool:
    """The prefill rows of q into out (both dense) through the in-place kernel, where the engine hands it out and
    it covers the layer (AVX-512 builds); False: cpu_prefill.py serves. A kernel that fails is set aside, as for
    decodes."""
    cpu_decode = meta.cpu_decode
    lib = cpu_decode.library() if cpu_decode is not None else None
    if lib is None or not lib.covers_prefill(q, k_cache):
        return False
    nd = meta.num_decodes
    try:
        return prefill_attention_in_place(q, k_cache, v_cache, meta.block_tables[nd:], meta.query_start_loc[nd:],
                                          meta.seq_lens_t[nd:], scale, lib, out)
    except Exception as e:  # noqa: BLE001 - a library this process can't run: the torch path, said once
        cpu_decode.set_aside(e)
        return False


def _window_cuts(meta: AttentionMetadata, window: int | None) -> bool:
    """Whether a sliding window hides any key from a prefill row (a window at least every sequence's
    length hides none)."""
    return bool(window) and max(meta.seq_lens[meta.num_decodes:]) > window


def _decodes_cpu(q, k_cache, v_cache, meta, scale, window, softcap) -> torch.Tensor:
    """The decode rows q: [nd, Hq, D]: through the in-place kernel when the engine hands one out, else gathered.
    A kernel that fails is set aside for good (the engine logs why) and this step gathers."""
    cpu_decode = meta.cpu_decode
    lib = cpu_decode.library() if cpu_decode is not None else None
    if lib is not None and lib.covers(q, k_cache):
        nd = meta.num_decodes
        try:
            return decode_attention_cpu(q, k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens_t[:nd], scale,
                                        window, softcap, lib)
        except Exception as e:  # noqa: BLE001 - a library this process can't run: fall back, say so once
            cpu_decode.set_aside(e)
    return _decode_ref(q, k_cache, v_cache, meta, scale, None, None, window, softcap)


def store_kv(k, v, k_cache, v_cache, slot_mapping):
    """Dispatch: Triton on CUDA (or with JOBRUNNER_TRITON=1), the reference elsewhere.
    (int8 caches: kernels.kv_int8.store_kv_int8.)"""
    if use_triton(k):
        from jobrunner.kernels.attention.kv_cache_triton import store_kv_triton
        store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        store_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, meta, scale, k_scale=None, v_scale=None, *, sliding=True, softcap=None):
    """Dispatch: Triton on CUDA (or with JOBRUNNER_TRITON=1), the reference elsewhere; meta.batch_invariant:
    each path's batch-invariant form (Triton: kernels/attention/attention_triton_invariant.py).
    k_scale/v_scale: only for int8 caches (layout in kernels/attention/kv_int8.py); sliding, softcap: the layer's
    switches (module docstring)."""
    if use_triton(q) and meta.batch_invariant:
        from jobrunner.kernels.attention.attention_triton_invariant import paged_attention_triton_invariant
        return paged_attention_triton_invariant(q, k_cache, v_cache, meta, scale, k_scale, v_scale,
                                                sliding=sliding, softcap=softcap)
    if use_triton(q):
        from jobrunner.kernels.attention.attention_triton import paged_attention_triton
        return paged_attention_triton(q, k_cache, v_cache, meta, scale, k_scale, v_scale,
                                      sliding=sliding, softcap=softcap)
    if k_cache.dtype == torch.int8:
        from jobrunner.kernels.attention.kv_int8 import paged_attention_int8_ref
        return paged_attention_int8_ref(q, k_cache, v_cache, k_scale, v_scale, meta, scale,
                                        sliding=sliding, softcap=softcap)
    return paged_attention_cpu(q, k_cache, v_cache, meta, scale, sliding=sliding, softcap=softcap)
