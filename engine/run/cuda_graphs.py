"""CUDA graphs for pure-decode steps: one captured forward per batch-size bucket.

A decode step launches hundreds of small kernels; replaying a graph launches them all at
once, so the GPU no longer waits on Python between them. A step of n decodes replays the
graph of the smallest bucket >= n; the rows past n are padding.

Invariants:
  * Graphs read only the static input buffers below: a replay first copies the step's
    inputs into them (one pinned staging buffer, asynchronous copies).
  * A padding row is a sequence of one token at the padding slot: the runner's KV cache
    has one block more than the pool hands out (block `pad_block`), which padding rows
    write and read. It is valid for every attention path and never corrupts real blocks.
  * Kernels take sequence lengths from device memory, so one graph serves every context
    length; the decode split-K factor is fixed per bucket at capture.

Elsewhere than CUDA (`capture=False`) the same buffers and padding run eagerly: tests
check the bucketing and padding on CPU.
"""
from __future__ import annotations

import torch

from jobrunner.kernels.ops import AttentionMetadata


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 to 256, every 32 to 512, every 64 beyond: a step pads at most
    15 rows, or an eighth of a big batch (decode of an 8B model turns compute bound near 200)."""
    ladder = [1, 2, 4, 8, *range(16, 257, 16), *range(288, 513, 32), *range(576, max_batch + 1, 64)]
    sizes = [s for s in ladder if s < max_batch]
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(self, model, kv_caches, block_size: int, pad_block: int, max_batch: int,
                 max_blocks_per_seq: int, device: torch.device, sliding_window: int | None,
                 capture: bool):
        self.model, self.kv_caches = model, kv_caches
        self.block_size, self.pad_block = block_size, pad_block
        self.device, self.sliding_window, self.capture = device, sliding_window, capture
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.max_blocks = max_blocks_per_seq
        n, dev = self.max_batch, device
        # Static inputs: [ids, positions, slots, seq_lens] as rows of one int64 buffer (one copy a step).
        self.vectors = torch.zeros((4, n), dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=dev)
        self.stage_tables = torch.zeros(n * max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.query_start = torch.arange(n + 1, dtype=torch.int32, device=dev)
        pin = device.type == "cuda"
        self.host_vectors = torch.zeros((4, n), dtype=torch.int64, pin_memory=pin)
        self.host_tables = torch.zeros(n * max_blocks_per_seq, dtype=torch.int32, pin_memory=pin)
        self.copied = torch.cuda.Event() if pin else None   # staging buffers are free again once set
        self.graphs: dict[int, tuple] = {}                   # bucket -> (graph, its output hidden states)
        self.pool = None
        self.replays = 0                                     # decode steps served by this path

    def bucket(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def _meta(self, bs: int) -> AttentionMetadata:
        meta = AttentionMetadata(
            block_size=self.block_size, num_decodes=bs, query_lens=[1] * bs, seq_lens=[1] * bs,
            slot_mapping=self.vectors[2, :bs], block_tables=self.tables[:bs], query_start_loc=self.query_start[:bs + 1],
            seq_lens_t=self.seq_lens[:bs], sliding_window=self.sliding_window)
        if self.capture:
            from jobrunner.kernels.ops import choose_num_splits
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            meta.decode_splits = choose_num_splits(bs, self.model.shards.kv_heads, self.max_blocks * self.block_size,
                                                   sms)      # this rank's KV heads
        return meta

    def _forward(self, bs: int, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(self.vectors[0, :bs], self.vectors[1, :bs], self.kv_caches, meta)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Captures every bucket, largest first (later graphs reuse the first one's memory pool)."""
        self._fill([], [], [], [], [], self.max_batch)
        if not self.capture:
            return
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for bs in reversed(self.buckets):
                meta = self._meta(bs)
                self._forward(bs, meta)                     # compiles the Triton kernels outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    hidden = self._forward(bs, meta)
                self.pool = graph.pool()
                self.graphs[bs] = (graph, hidden)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
            tables: list[list[int]], id_patch: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One decode step of len(input_ids) sequences -> hidden states [n, hidden] (a view into
        the graph's output: read it before the next replay). id_patch: (rows, ids) already on the
        device that replace those rows' input ids (tokens the previous step sampled)."""
        n = len(input_ids)
        bs = self.bucket(n)
        self._fill(input_ids, positions, slots, seq_lens, tables, bs)
        if id_patch is not None:
            self.vectors[0].index_copy_(0, *id_patch)
        self.replays += 1
        if not self.capture:
            meta = self._meta(bs)
            if self.device.type == "cpu":
                meta.prepare()
            return self._forward(bs, meta)[:n]
        graph, hidden = self.graphs[bs]
        graph.replay()
        return hidden[:n]

    def _fill(self, input_ids, positions, slots, seq_lens, tables, bs: int) -> None:
        """Copies a step's inputs into the static buffers; rows n..bs become padding rows."""
        n = len(input_ids)
        width = max((len(t) for t in tables), default=0) or 1
        if self.copied is not None:
            self.copied.synchronize()                       # the previous step's copies have left the staging buffers
        vec = self.host_vectors.numpy()
        vec[0, :n], vec[1, :n], vec[2, :n], vec[3, :n] = input_ids, positions, slots, seq_lens
        vec[0, n:bs], vec[1, n:bs], vec[2, n:bs], vec[3, n:bs] = 0, 0, self.pad_block * self.block_size, 1
        tab = self.host_tables.numpy()[:bs * width].reshape(bs, width)
        tab[:] = self.pad_block
        for i, t in enumerate(tables):
            tab[i, :len(t)] = t
        nb = self.device.type == "cuda"
        self.vectors.copy_(self.host_vectors, non_blocking=nb)                  # whole rows: contiguous, 32 KB
        self.stage_tables[:bs * width].copy_(self.host_tables[:bs * width], non_blocking=nb)
        self.tables[:bs, :width].copy_(self.stage_tables[:bs * width].view(bs, width))
        self.seq_lens[:bs].copy_(self.vectors[3, :bs])
        if self.copied is not None:
            self.copied.record()
