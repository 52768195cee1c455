"""Runs one scheduled step on the model: builds the flattened batch, runs the forward,
computes logits only where a token is sampled or scored, and samples.

    runner.execute(SchedulerOutput) -> RunnerOutput
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.cuda_graphs import DecodeGraphs
from engine.model import CausalLM
from engine.request import TokenLogprob
from engine.sampler import SampleRow, draw_uniform, sample
from engine.scheduler import SchedulerOutput
from kernels import AttentionMetadata
from kernels.attention import to_device

LOGITS_ROWS_PER_PASS = 256   # bounds the [rows, vocab] logits tensor when scoring long texts


@dataclass
class RunnerOutput:
    sampled: dict[int, list[int]] = field(default_factory=dict)                 # seq_id -> tokens (one per sample)
    sample_logprobs: dict[int, list[TokenLogprob | None]] = field(default_factory=dict)
    token_logprobs: dict[int, list[float]] = field(default_factory=dict)        # seq_id -> scored tokens' logprobs
    candidate_first: dict[int, list[float]] = field(default_factory=dict)       # seq_id -> logprob of each candidate's first token
    num_tokens: int = 0
    # host seconds: building inputs, enqueueing the forward, logits + sampling (the wait for the GPU lands here)
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    graphed: bool = False                 # the forward replayed a CUDA graph (or its padded stand-in)


@dataclass
class _StepInputs:
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)           # cache slot of each token
    query_lens: list[int] = field(default_factory=list)      # per chunk
    seq_lens: list[int] = field(default_factory=list)        # per chunk: context length after the step
    tables: list[list[int]] = field(default_factory=list)    # per chunk: its sequence's block table
    sample_rows: list[tuple] = field(default_factory=list)   # (token row, chunk)
    score_rows: list[tuple] = field(default_factory=list)    # (token row, target token, seq_id)


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, kv_dtype: torch.dtype, device):
        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        cfg = model.config
        # One block more than the pool hands out: the padding rows of graph batches write there.
        self.pad_block = num_blocks
        shape = (num_blocks + 1, block_size, cfg.num_kv_heads, cfg.head_dim)
        # [num_blocks, block_size, num_kv_heads, head_dim] per layer, for K and for V; an int8 cache
        # adds float32 scales [num_blocks, block_size, num_kv_heads] (layout in kernels/kv_int8.py)
        zeros = lambda shp, dt: torch.zeros(shp, dtype=dt, device=self.device)
        if kv_dtype == torch.int8:
            self.kv_caches = [(zeros(shape, kv_dtype), zeros(shape, kv_dtype), zeros(shape[:3], torch.float32),
                               zeros(shape[:3], torch.float32)) for _ in range(cfg.num_layers)]
        else:
            self.kv_caches = [(zeros(shape, kv_dtype), zeros(shape, kv_dtype)) for _ in range(cfg.num_layers)]
        self.sliding_window = cfg.sliding_window
        self.graphs: DecodeGraphs | None = None

    def enable_graphs(self, max_batch: int, max_model_len: int, capture: bool = True) -> float:
        """Pure-decode steps of up to max_batch sequences replay CUDA graphs, captured now; returns the
        seconds capture took. capture=False runs the same padded static-buffer path eagerly (tests, CPU)."""
        t0 = time.perf_counter()
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size, self.pad_block, max_batch,
                                   -(-max_model_len // self.block_size), self.device, self.sliding_window, capture)
        self.graphs.capture_all()
        return time.perf_counter() - t0

    @staticmethod
    def kv_bytes_per_block(cfg, block_size: int, kv_dtype: torch.dtype) -> int:
        per_token_head = cfg.head_dim * kv_dtype.itemsize + (4 if kv_dtype == torch.int8 else 0)
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * per_token_head

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        out = RunnerOutput(num_tokens=sched.num_tokens)
        if sched.block_copies:
            self._copy_blocks(sched.block_copies)
        if not sched.chunks:
            return out
        t0 = time.perf_counter()
        x = self._flatten(sched.chunks)
        dev, nd = self.device, sched.num_decodes
        if self.graphs is not None and nd == len(sched.chunks) and not x.score_rows and nd <= self.graphs.max_batch:
            t1 = time.perf_counter()
            out.graphed = True
            hidden = self.graphs.run(x.input_ids, x.positions, x.slots, x.seq_lens, x.tables)
        else:
            meta = AttentionMetadata.build(self.block_size, nd, x.query_lens, x.seq_lens, x.slots, x.tables, dev,
                                           self.sliding_window)
            ids, pos = (to_device(np.asarray(v, dtype=np.int64), dev) for v in (x.input_ids, x.positions))
            t1 = time.perf_counter()
            hidden = self.model(ids, pos, self.kv_caches, meta)
        t2 = time.perf_counter()
        if x.sample_rows:
            self._sample(hidden, x.sample_rows, out)
        if x.score_rows:
            self._score(hidden, x.score_rows, out)
        out.prepare_s, out.forward_s, out.sample_s = t1 - t0, t2 - t1, time.perf_counter() - t2
        return out

    def _flatten(self, chunks) -> "_StepInputs":
        """The step's chunks as one flat token batch (decodes first), with the rows to sample or score."""
        bs = self.block_size
        x = _StepInputs()
        for chunk in chunks:
            seq, start, end = chunk.seq, chunk.start, chunk.end
            base = len(x.input_ids)
            table = seq.block_table
            if end - start == 1:
                x.input_ids.append(seq.token_ids[start])
                x.positions.append(start)
                x.slots.append(table[start // bs] * bs + start % bs)
            else:
                x.input_ids.extend(seq.token_ids[start:end])
                pos = np.arange(start, end)
                x.positions.extend(pos.tolist())
                x.slots.extend((np.asarray(table)[pos // bs] * bs + pos % bs).tolist())
            x.query_lens.append(end - start)
            x.seq_lens.append(end)
            x.tables.append(table)
            if seq.logprobs_from:
                last = seq.num_tokens - 1 if seq.scoring else seq.num_prompt_tokens - 1
                for p in range(max(start, seq.logprobs_from - 1), min(end, last)):
                    x.score_rows.append((base + p - start, seq.token_ids[p + 1], seq.seq_id))
            if chunk.completes and not seq.scoring:
                x.sample_rows.append((base + end - start - 1, chunk))
        return x

    def _sample(self, hidden, sample_rows, out: RunnerOutput) -> None:
        idx = to_device(np.asarray([r for r, _ in sample_rows], dtype=np.int64), hidden.device)
        logits = self.model.compute_logits(hidden.index_select(0, idx))
        seqs = [chunk.seq for _, chunk in sample_rows]
        if all(s.fork_samples == 1 and s.candidate_first_tokens is None and not s.sampling.temperature > 0
               and s.sampling.logprobs is None for s in seqs):      # all greedy, one token each: the hot path
            for seq, tok in zip(seqs, logits.argmax(dim=-1).tolist()):
                out.sampled[seq.seq_id] = [tok]
                out.sample_logprobs[seq.seq_id] = [None]
            return
        rows, owners = [], []
        for i, (_, chunk) in enumerate(sample_rows):
            seq = chunk.seq
            if seq.candidate_first_tokens is not None:
                lp = torch.log_softmax(logits[i], dim=-1)
                out.candidate_first[seq.seq_id] = lp[seq.candidate_first_tokens].tolist()
                continue
            for k in range(seq.fork_samples):      # sample k of a parent's first draw becomes child k
                u = draw_uniform(seq.seed, seq.sample_index + k, seq.num_tokens) if seq.sampling.temperature > 0 else 0.0
                rows.append(SampleRow(i, seq.sampling, u))
                owners.append(seq.seq_id)
        tokens, logprobs = sample(logits, rows)
        for seq_id, tok, lp in zip(owners, tokens, logprobs):
            out.sampled.setdefault(seq_id, []).append(tok)
            out.sample_logprobs.setdefault(seq_id, []).append(lp)

    def _score(self, hidden, score_rows, out: RunnerOutput) -> None:
        for lo in range(0, len(score_rows), LOGITS_ROWS_PER_PASS):
            part = score_rows[lo:lo + LOGITS_ROWS_PER_PASS]
            idx = torch.tensor([r for r, _, _ in part], device=hidden.device)
            logits = self.model.compute_logits(hidden.index_select(0, idx))
            targets = torch.tensor([t for _, t, _ in part], device=hidden.device)
            lp = (logits.gather(1, targets[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)).tolist()
            for (_, _, seq_id), value in zip(part, lp):
                out.token_logprobs.setdefault(seq_id, []).append(value)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for layer in self.kv_caches:
            for t in layer:
                t.index_copy_(0, dst, t.index_select(0, src))
