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
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kernels.device import to_device
from kernels.triton_utils import use_triton


@dataclass
class AttentionMetadata:
    block_size: int
    num_decodes: int                 # sequences (= tokens) at the front with one query token
    query_lens: list[int]            # per sequence
    seq_lens: list[int]              # per sequence: context length including this step's tokens
    slot_mapping: torch.Tensor       # [num_tokens] int64: cache slot of each new token
    block_tables: torch.Tensor       # [num_seqs, max_blocks] int32 (padded with 0)
    query_start_loc: torch.Tensor    # [num_seqs + 1] int32
    seq_lens_t: torch.Tensor         # [num_seqs] int32
    sliding_window: int | None = None # the window of the layers that slide (paged_attention's `sliding`)
    decode_splits: int | None = None # Triton split-K factor for decodes; None: chosen per step (fix it for CUDA graphs)
    # Torch path, built once per step by prepare() (the decode part on first use: the in-place CPU kernel
    # needs none of it) and shared by all layers:
    _prepared: bool = False
    _decode: tuple | None = None
    _prefill: tuple | None = None
    _window_masks: dict | None = None  # (part, window) -> mask, made on first use by a sliding layer
    _decode_masks: dict | None = None  # (pool blocks, window) -> kernels.cpu_attention.DecodeMask or None

    @classmethod
    def build(cls, block_size, num_decodes, query_lens, seq_lens, slot_mapping, block_tables,
              device, sliding_window=None) -> "AttentionMetadata":
        device = torch.device(device)
        width = max((len(t) for t in block_tables), default=1) or 1
        tables = np.zeros((len(block_tables), width), dtype=np.int32)
        for i, t in enumerate(block_tables):
            tables[i, :len(t)] = t
        starts = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=starts[1:])
        meta = cls(
            block_size=block_size, num_decodes=num_decodes, query_lens=list(query_lens),
            seq_lens=list(seq_lens),
            slot_mapping=to_device(slot_mapping, device, np.int64),
            block_tables=to_device(tables, device), query_start_loc=to_device(starts, device),
            seq_lens_t=to_device(seq_lens, device, np.int32), sliding_window=sliding_window,
        )
        if device.type == "cpu":
            meta.prepare()
        return meta

    def prepare(self) -> None:
        """Gather indices and masks for the torch path: one padded batch for prefills now, one for decodes
        when decode_part() first asks."""
        nd = self.num_decodes
        self._window_masks = {}
        self._prepared = True
        if len(self.query_lens) > nd:
            self._prefill = self._gather(nd, len(self.query_lens), self.block_tables.device)

    def decode_part(self) -> tuple:
        """The decode rows' gather indices and masks (built on first use, then shared by all layers)."""
        if self._decode is None:
            self._decode = self._gather(0, self.num_decodes, self.block_tables.device)
        return self._decode

    def mask(self, part: str, window: int | None) -> torch.Tensor:
        """The causal mask of `part` ("decode" or "prefill"), narrowed to the last `window` keys when
        one is given: [B, 1, qmax, keys], True where a query sees a key."""
        _, causal, _, q_valid, q_pos = self.decode_part() if part == "decode" else self._prefill
        if not window:
            return causal
        key = (part, window)
        if key not in self._window_masks:
            j = torch.arange(causal.shape[-1], device=causal.device)
            windowed = causal & (j[None, None, None, :] > (q_pos - window)[:, None, :, None])
            windowed[:, 0, :, 0] |= ~q_valid                                          # padding rows: never NaN
            self._window_masks[key] = windowed
        return self._window_masks[key]

    def decode_mask(self, num_blocks: int, window: int | None):
        """The decode rows' block mask for the in-place CPU kernel (kernels/cpu_attention.py), made on first
        use and shared by every layer; None when the kernel can't address this step's blocks."""
        from kernels.cpu_attention import DecodeMask
        if self._decode_masks is None:
            self._decode_masks = {}
        key = (num_blocks, window)
        if key not in self._decode_masks:
            nd = self.num_decodes
            self._decode_masks[key] = DecodeMask.build(self.block_tables[:nd], self.seq_lens_t[:nd], self.block_size,
                                                       num_blocks, window)
        return self._decode_masks[key]

    def _gather(self, lo: int, hi: int, dev):
        """Whole blocks are gathered (contiguous 16-slot runs: ~4x faster than slot by slot on CPU);
        the mask hides the slots past each sequence's length (a sliding window: `mask`)."""
        bs = self.block_size
        seq_lens = self.seq_lens_t[lo:hi].long()
        qlens = torch.tensor(self.query_lens[lo:hi], device=dev)
        nblk, qmax = -(-int(seq_lens.max()) // bs), int(qlens.max())
        tables = self.block_tables[lo:hi, :nblk].long()
        if tables.shape[1] < nblk:
            tables = F.pad(tables, (0, nblk - tables.shape[1]))
        j = torch.arange(nblk * bs, device=dev)
        i = torch.arange(qmax, device=dev)
        q_pos = (seq_lens - qlens)[:, None] + i[None, :]                             # [B, qmax]
        q_valid = i[None, :] < qlens[:, None]
        mask = j[None, None, :] <= q_pos[:, :, None]                                 # causal, and < seq_len
        mask[:, :, 0] |= ~q_valid                                                    # padding rows see one key, never NaN
        q_start = self.query_start_loc[lo:hi].long() - int(self.query_start_loc[lo])
        q_index = (q_start[:, None] + i[None, :]).clamp(max=int(qlens.sum()) - 1)   # [B, qmax]
        return tables.reshape(-1), mask[:, None], q_index, q_valid, q_pos


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int = 132,
                      min_tokens_per_split: int = 256, max_splits: int = 32) -> int:
    """Split-K factor for decode: enough programs to fill the GPU about twice over, but no
    split shorter than min_tokens_per_split keys (below that the merge costs more than
    the parallelism buys). Large batches get 1: the plain kernel, no merge."""
    programs = max(1, num_seqs * num_kv_heads)
    want = -(-2 * num_sms // programs)
    cap = max(1, max_seq_len // min_tokens_per_split)
    return int(max(1, min(want, cap, max_splits)))


def store_kv_ref(k, v, k_cache, v_cache, slot_mapping) -> None:
    """k, v: [T, Hk, D] written at slot_mapping [T] of the flattened caches."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def paged_attention_ref(q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                        k_scale=None, v_scale=None, *, sliding: bool = True,
                        softcap: float | None = None) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]. With k_scale/v_scale the caches are int8 (kernels/kv_int8.py).
    sliding: this layer keeps to meta.sliding_window (when set); softcap: scores -> softcap * tanh(s / softcap)."""
    if not meta._prepared:
        meta.prepare()
    out = torch.empty_like(q)
    nd = meta.num_decodes
    window = meta.sliding_window if sliding else None
    if nd:
        out[:nd] = _decode_ref(q[:nd], k_cache, v_cache, meta, scale, k_scale, v_scale, window, softcap)
    if meta._prefill is not None:
        out[nd:] = _prefill_ref(q[nd:], k_cache, v_cache, meta, scale, k_scale, v_scale, window, softcap)
    return out


def _decode_ref(q, k_cache, v_cache, meta, scale, k_scale, v_scale, window, softcap):
    """The decode rows q: [nd, Hq, D]: their blocks gathered, padded to the longest, one query row each."""
    nd, blocks = q.shape[0], meta.decode_part()[0]
    k, v = _blocks(k_cache, k_scale, blocks, nd, q.dtype), _blocks(v_cache, v_scale, blocks, nd, q.dtype)
    return _sdpa(q[:, None], k, v, meta.mask("decode", window), scale, softcap)[:, 0]


def _prefill_ref(q, k_cache, v_cache, meta, scale, k_scale, v_scale, window, softcap):
    """The prefill rows q: [T - nd, Hq, D] as a padded batch of chunks over their gathered blocks."""
    blocks, _, q_index, q_valid, _ = meta._prefill
    n = q_index.shape[0]
    qp = q[q_index]                                                                  # [B, qmax, Hq, D]
    k, v = _blocks(k_cache, k_scale, blocks, n, q.dtype), _blocks(v_cache, v_scale, blocks, n, q.dtype)
    return _sdpa(qp, k, v, meta.mask("prefill", window), scale, softcap)[q_valid]


def _run_package(out, q, k_cache, v_cache, mask, scale, softcap, runner, key) -> bool:
    """The decode rows through the in-place package; False (and the package set aside for this process)
    when it fails: a package from an older build of this code, say. The gather path then serves."""
    from kernels import cpu_attention as ca
    nd = mask.part_num.shape[0]
    try:
        out[:nd] = ca.decode_attention_cpu(q[:nd], k_cache, v_cache, mask, scale, softcap, runner)
        return True
    except Exception as e:  # noqa: BLE001 - any failure of a compiled package: fall back, say so once
        ca.KERNELS.set_aside(key, e)
        return False


def paged_attention_cpu(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, *, sliding: bool = True,
                        softcap: float | None = None) -> torch.Tensor:
    """The torch path for a float cache: decode rows through kernels/cpu_attention.py (blocks read in place)
    once its package is loaded, else gathered (_decode_ref); prefill rows always gathered (_prefill_ref)."""
    from kernels import cpu_attention as ca
    mode = ca.mode()
    nd = meta.num_decodes
    if mode == "gather" or not nd:
        return paged_attention_ref(q, k_cache, v_cache, meta, scale, sliding=sliding, softcap=softcap)
    if not meta._prepared:
        meta.prepare()
    window = meta.sliding_window if sliding else None
    key = ca.key_for(q, k_cache, softcap)
    runner = ca.KERNELS.runner(key, mode)
    mask = meta.decode_mask(k_cache.shape[0], window) if runner is not None else None
    out = torch.empty_like(q)
    if mask is not None and not _run_package(out, q, k_cache, v_cache, mask, scale, softcap, runner, key):
        mask = None
    if mask is None:
        t0 = time.perf_counter()
        out[:nd] = _decode_ref(q[:nd], k_cache, v_cache, meta, scale, None, None, window, softcap)
        if mode == "auto":
            ca.KERNELS.note_gather(key, time.perf_counter() - t0)
    if meta._prefill is not None:
        out[nd:] = _prefill_ref(q[nd:], k_cache, v_cache, meta, scale, None, None, window, softcap)
    return out


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
