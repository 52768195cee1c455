"""A step's attention metadata over the paged KV cache (kernels/attention.py has the layout): built once
a step by the model runner and shared by every layer; the torch path's gather indices and masks are
made here on first use."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kernels.device import to_device


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
    cpu_decode: object | None = None # a kernels.cpu_attention.CpuDecode (the engine's): decodes in place on CPU
    # Torch path, built once per step by prepare() (the decode part on first use: the in-place CPU kernel
    # needs none of it) and shared by all layers:
    _prepared: bool = False
    _decode: tuple | None = None
    _prefill: tuple | None = None
    _prefill_plan: object | None = None  # kernels.cpu_prefill.PrefillPlan, made on first use
    _window_masks: dict | None = None  # (part, window) -> mask, made on first use by a sliding layer
    _decode_masks: dict | None = None  # (pool blocks, window) -> kernels.cpu_attention.DecodeMask or None

    @classmethod
    def build(cls, block_size, num_decodes, query_lens, seq_lens, slot_mapping, block_tables,
              device, sliding_window=None, cpu_decode=None) -> "AttentionMetadata":
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
            cpu_decode=cpu_decode,
        )
        if device.type == "cpu":
            meta.prepare()
        return meta

    def prepare(self) -> None:
        """The torch path's per-step state starts empty: each part's gather indices and masks are built when
        decode_part() / prefill_part() first asks, the CPU prefill plan when prefill_plan() does."""
        self._window_masks = {}
        self._prepared = True

    @property
    def num_prefills(self) -> int:
        return len(self.query_lens) - self.num_decodes

    def prefill_part(self) -> tuple:
        """The prefill rows' gather indices and masks, as one padded batch (built on first use, then shared)."""
        if self._prefill is None:
            self._prefill = self._gather(self.num_decodes, len(self.query_lens), self.block_tables.device)
        return self._prefill

    def prefill_plan(self):
        """The prefill rows as kernels/cpu_prefill.py's plan (built on first use, then shared by all layers)."""
        if self._prefill_plan is None:
            from kernels.cpu_prefill import PrefillPlan
            nd, n = self.num_decodes, len(self.query_lens)
            first_slot = int(self.query_start_loc[nd])
            self._prefill_plan = PrefillPlan.build(self.block_size, self.query_lens[nd:], self.seq_lens[nd:],
                                                   self.block_tables[nd:n].tolist(),
                                                   self.slot_mapping[first_slot:])
        return self._prefill_plan

    def decode_part(self) -> tuple:
        """The decode rows' gather indices and masks (built on first use, then shared by all layers)."""
        if self._decode is None:
            self._decode = self._gather(0, self.num_decodes, self.block_tables.device)
        return self._decode

    def mask(self, part: str, window: int | None) -> torch.Tensor:
        """The causal mask of `part` ("decode" or "prefill"), narrowed to the last `window` keys when
        one is given: [B, 1, qmax, keys], True where a query sees a key."""
        _, causal, _, q_valid, q_pos = self.decode_part() if part == "decode" else self.prefill_part()
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
