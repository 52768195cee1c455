"""A step's attention metadata over the paged KV cache (kernels/attention/attention.py has the layout): built once
a step by the model runner and shared by every layer; the torch path's gather indices and masks are
made here on first use."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from jobrunner.kernels.common.device import to_device


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
    batch_invariant: bool = False    # CPU: every row through the in-place kernel in fixed splits (token_rows())
    # Torch path, built once per step by prepare() (the decode part on first use: the in-place CPU kernel
    # needs none of it) and shared by all layers:
    _prepared: bool = False
    _decode: tuple | None = None
    _decode_groups: list | None = None  # [(rows or None: all, gather tuple)]: decode_groups()
    _prefill: tuple | None = None
    _prefill_plan: object | None = None  # kernels.cpu_prefill.PrefillPlan, made on first use
    _window_masks: dict | None = None  # (part, decode group, window) -> mask, made on first use by a sliding layer
    _token_rows: tuple | None = None   # token_rows(), made on first use

    @classmethod
    def build(cls, block_size, num_decodes, query_lens, seq_lens, slot_mapping, block_tables,
              device, sliding_window=None, cpu_decode=None, batch_invariant=False) -> "AttentionMetadata":
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
            cpu_decode=cpu_decode, batch_invariant=batch_invariant,
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
        """The prefill rows as kernels/attention/cpu_prefill.py's plan (built on first use, then shared by all layers)."""
        if self._prefill_plan is None:
            from jobrunner.kernels.attention.cpu_prefill import PrefillPlan
            nd, n = self.num_decodes, len(self.query_lens)
            first_slot = int(self.query_start_loc[nd])
            self._prefill_plan = PrefillPlan.build(self.block_size, self.query_lens[nd:], self.seq_lens[nd:],
                                                   self.block_tables[nd:n].tolist(),
                                                   self.slot_mapping[first_slot:])
        return self._prefill_plan

    def token_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token as a decode row of its own: (tables [T, W] int32, its sequence's block table;
        seq_lens [T] int32, the keys it sees: its position + 1). Built on first use, then shared by all layers."""
        if self._token_rows is None:
            qlens = np.asarray(self.query_lens, dtype=np.int64)
            chunk = np.repeat(np.arange(len(qlens)), qlens)                           # [T] the token's chunk
            first = np.asarray(self.seq_lens, dtype=np.int64) - qlens                 # keys before each chunk
            offset = np.arange(len(chunk)) - np.repeat(np.cumsum(qlens) - qlens, qlens)
            seq_lens = (first[chunk] + offset + 1).astype(np.int32)
            dev = self.block_tables.device
            self._token_rows = (self.block_tables.index_select(0, torch.from_numpy(chunk).to(dev)),
                                to_device(seq_lens, dev))
        return self._token_rows

    def decode_part(self) -> tuple:
        """The decode rows' gather indices and masks (built on first use, then shared by all layers)."""
        if self._decode is None:
            self._decode = self._gather(0, self.num_decodes, self.block_tables.device)
        return self._decode

    def decode_groups(self) -> list[tuple[torch.Tensor | None, tuple]]:
        """The decode rows in groups of like length, each gathered and padded only to its own longest (one
        long row must not pad every short one to its length): [(rows, gather tuple)], rows None when one
        group holds them all in order. Built on first use, then shared by all layers."""
        if self._decode_groups is None:
            groups = length_groups(self.seq_lens[:self.num_decodes], self.block_size)
            if len(groups) == 1:
                self._decode_groups = [(None, self.decode_part())]
            else:
                dev = self.block_tables.device
                rows = [torch.tensor(g, device=dev) for g in groups]
                self._decode_groups = [(r, self._gather(0, self.num_decodes, dev, r)) for r in rows]
        return self._decode_groups

    def mask(self, part: str, window: int | None, group: int | None = None) -> torch.Tensor:
        """The causal mask of `part` ("decode" or "prefill"; for decode, of decode_groups()[group] when
        group is given), narrowed to the last `window` keys when one is given: [B, 1, qmax, keys], True
        where a query sees a key."""
        if part == "prefill":
            gathered = self.prefill_part()
        else:
            gathered = self.decode_part() if group is None else self.decode_groups()[group][1]
        _, causal, _, q_valid, q_pos = gathered
        if not window:
            return causal
        key = (part, group, window)
        if key not in self._window_masks:
            j = torch.arange(causal.shape[-1], device=causal.device)
            windowed = causal & (j[None, None, None, :] > (q_pos - window)[:, None, :, None])
            windowed[:, 0, :, 0] |= ~q_valid                                          # padding rows: never NaN
            self._window_masks[key] = windowed
        return self._window_masks[key]

    def _gather(self, lo: int, hi: int, dev, rows: torch.Tensor | None = None):
        """Whole blocks are gathered (contiguous 16-slot runs: ~4x faster than slot by slot on CPU);
        the mask hides the slots past each sequence's length (a sliding window: `mask`). rows: the
        sequences of lo..hi to take (indices from lo), all of them when None."""
        bs = self.block_size
        pick = (lambda x: x[lo:hi]) if rows is None else (lambda x: x[lo:hi][rows])
        seq_lens = pick(self.seq_lens_t).long()
        qlens = pick(torch.tensor(self.query_lens, device=dev))
        nblk, qmax = -(-int(seq_lens.max()) // bs), int(qlens.max())
        tables = pick(self.block_tables)[:, :nblk].long()
        if tables.shape[1] < nblk:
            tables = F.pad(tables, (0, nblk - tables.shape[1]))
        j = torch.arange(nblk * bs, device=dev)
        i = torch.arange(qmax, device=dev)
        q_pos = (seq_lens - qlens)[:, None] + i[None, :]                             # [B, qmax]
        q_valid = i[None, :] < qlens[:, None]
        mask = j[None, None, :] <= q_pos[:, :, None]                                 # causal, and < seq_len
        mask[:, :, 0] |= ~q_valid                                                    # padding rows see one key, never NaN
        q_start = pick(self.query_start_loc[:-1]).long() - int(self.query_start_loc[lo])
        q_index = (q_start[:, None] + i[None, :]).clamp(max=int(qlens.sum()) - 1)   # [B, qmax]
        return tables.reshape(-1), mask[:, None], q_index, q_valid, q_pos


GROUP_OVERHEAD_BLOCKS = 32   # one more gather + SDPA call costs about as much as 32 padded block-rows (CPU)


def length_groups(seq_lens: list[int], block_size: int) -> list[list[int]]:
    """The rows (indices into seq_lens) in groups of like length, shortest first: each group at most twice
    as many blocks long as its shortest row, then neighbours merged where one call costs less than
    the padding it adds (a step of like lengths stays one group, in order)."""
    blocks = [-(-n // block_size) for n in seq_lens]
    order = sorted(range(len(blocks)), key=blocks.__getitem__)
    groups: list[list[int]] = []
    for i in order:
        if groups and blocks[i] <= 2 * blocks[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    merged = [groups[0]]
    for g in groups[1:]:
        prev = merged[-1]
        if len(prev) * (blocks[g[-1]] - blocks[prev[-1]]) < GROUP_OVERHEAD_BLOCKS:
            prev.extend(g)
        else:
            merged.append(g)
    return [list(range(len(blocks)))] if len(merged) == 1 else merged


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int = 132,
                      min_tokens_per_split: int = 256, max_splits: int = 32) -> int:
    """Split-K factor for decode: enough programs to fill the GPU about twice over, but no
    split shorter than min_tokens_per_split keys (below that the merge costs more than
    the parallelism buys). Large batches get 1: the plain kernel, no merge."""
    programs = max(1, num_seqs * num_kv_heads)
    want = -(-2 * num_sms // programs)
    cap = max(1, max_seq_len // min_tokens_per_split)
    return int(max(1, min(want, cap, max_splits)))
