"""Runs one scheduled step on the model: builds the flattened batch, runs the forward,
computes logits only where a token is sampled or scored, and samples.

    step = runner.launch(SchedulerOutput)    # enqueued on the device, no host sync
    runner.sample_masked(step, bitmask)      # only when step.awaits_mask: constrained rows sample later
    out = runner.collect(step)               # waits; -> RunnerOutput

Between the two the host is free to schedule and launch the next step: steps run in
order on the device's one stream, so a launch may read KV blocks and sampled tokens
that earlier launches have not yet produced.

Tensor parallelism (engine/parallel): rank 0's runner sends each step's ForwardPlan down its
channel before running it; the other ranks' runners `follow()` the plans with the same forward
and the same logits calls (collectives), and sample nothing.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from jobrunner.engine.run.cpu_decode import DecodeKernels
from jobrunner.engine.run.cuda_graphs import DecodeGraphs
from jobrunner.engine.run.image_embeds import ImageEmbeds
from jobrunner.engine.run.step_results import HostCopy, LaunchedStep, RunnerOutput
from jobrunner.engine.sample.logits_process import LogitsAdjust
from jobrunner.engine.lora.batching import adapter_spans, order_by_adapter
from jobrunner.engine.lora.wrapped import LoraSet
from jobrunner.engine.models.base import CausalLM
from jobrunner.engine.parallel.channel import ForwardPlan, StepChannel
from jobrunner.engine.parallel.group import TensorParallel
from jobrunner.engine.parallel.shards import ShardPlan
from jobrunner.engine.sample.pooling import Pooler, split
from jobrunner.engine.sample.sampler import DeviceSample, SampleRow, draw_uniform, sample_on_device
from jobrunner.engine.schedule.scheduler import SchedulerOutput
from jobrunner.engine.schedule.sequence import SeqKind
from jobrunner.kernels.ops import AttentionMetadata, apply_token_bitmask, to_device

LOGITS_ROWS_PER_PASS = 256   # bounds the [rows, vocab] logits tensor when scoring long texts


def _zeros(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache tensor. On the CPU from calloc'ed pages (numpy's zeros), which the OS zeroes on
    first touch: a 2 GiB cache costs nothing at start-up and memory only for the blocks used."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = int(np.prod(shape))
    return torch.from_numpy(np.zeros(numel * dtype.itemsize, np.uint8)).view(dtype).view(shape)


@dataclass
class _StepInputs:
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)           # cache slot of each token
    query_lens: list[int] = field(default_factory=list)      # per chunk
    seq_lens: list[int] = field(default_factory=list)        # per chunk: context length after the step
    tables: list[list[int]] = field(default_factory=list)    # per chunk: its sequence's block table
    sample_rows: list[tuple] = field(default_factory=list)   # (token row, chunk, its position past the chunk's
                                                             # last own token: 0, or a drafted one's 1..k)
    score_rows: list[tuple] = field(default_factory=list)    # (token row, target token, seq_id)
    placeholder_rows: list[tuple] = field(default_factory=list)  # (token row, seq_id): input id sampled last step
    pool_rows: list[tuple] = field(default_factory=list)     # (first token row, chunk) of each EMBED chunk
    image_spans: list[tuple] = field(default_factory=list)   # (first token row, image, its first, last + 1 row)
    mrope: list[tuple] = field(default_factory=list)         # (first token row, [3, n] positions): multimodal rotary


def _mrope_rows(x: _StepInputs) -> list[list[int]] | None:
    """The step's positions as three rows (time, height, width) where a chunk has multimodal rotary
    positions, else None: every other token's three are its one position (plain rope)."""
    if not x.mrope:
        return None
    rows = np.tile(np.asarray(x.positions, np.int64), (3, 1))
    for base, positions in x.mrope:
        rows[:, base:base + positions.shape[1]] = positions
    return rows.tolist()


def _logit_passes(x: _StepInputs) -> list[list[int]]:
    """The token rows whose logits a step computes, pass by pass: the sampled rows in one, then the
    scored rows LOGITS_ROWS_PER_PASS at a time."""
    passes = [[r for r, *_ in x.sample_rows]] if x.sample_rows else []
    rows = [r for r, _, _ in x.score_rows]
    return passes + [rows[lo:lo + LOGITS_ROWS_PER_PASS] for lo in range(0, len(rows), LOGITS_ROWS_PER_PASS)]


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, kv_dtype: torch.dtype, device,
                 eos_token_ids: tuple[int, ...] = (), channel: StepChannel | None = None, loras: LoraSet | None = None):
        self.model = model
        self.loras = loras if loras is not None and loras.names else None   # LoRA adapters (engine/lora)
        self.eos_token_ids = eos_token_ids          # masked while a row is short of its min_tokens
        self.device = torch.device(device)
        self.block_size = block_size
        self.channel = channel                      # a tensor-parallel group's; None on one device
        # the in-place CPU decode attention (engine/run/cpu_decode.py builds and loads it), for float caches on CPU
        self.cpu_decode = DecodeKernels() if self.device.type == "cpu" else None
        self.batch_invariant = getattr(model, "batch_invariant", False)   # engine/run/batch_invariance.py
        cfg = model.config
        # One block more than the pool hands out: the padding rows of graph batches write there.
        self.pad_block = num_blocks
        # this rank's KV heads (all of them on one device)
        shape = (num_blocks + 1, block_size, model.shards.kv_heads, cfg.head_dim)
        # [num_blocks, block_size, num_kv_heads, head_dim] per layer, for K and for V; an int8 cache
        # adds float32 scales [num_blocks, block_size, num_kv_heads] (layout in kernels/attention/kv_int8.py)
        zeros = lambda shp, dt: _zeros(shp, dt, self.device)
        if kv_dtype == torch.int8:
            self.kv_caches = [(zeros(shape, kv_dtype), zeros(shape, kv_dtype), zeros(shape[:3], torch.float32),
                               zeros(shape[:3], torch.float32)) for _ in range(cfg.num_layers)]
        else:
            self.kv_caches = [(zeros(shape, kv_dtype), zeros(shape, kv_dtype)) for _ in range(cfg.num_layers)]
        self.sliding_window = cfg.sliding_window
        self.graphs: DecodeGraphs | None = None
        self._last_tokens: torch.Tensor | None = None   # the last launch's sampled tokens, on the device
        self._last_rows: dict[int, int] = {}            # seq_id -> its row there
        self.pooler = Pooler()
        # a vision-language model's tower outputs (engine/run/image_embeds.py); None for text models
        self.image_embeds = ImageEmbeds(model, self.device) if hasattr(model, "encode_images") else None

    def enable_graphs(self, max_batch: int, max_model_len: int, capture: bool = True) -> float:
        """Pure-decode steps of up to max_batch sequences replay CUDA graphs, captured now; returns the
        seconds capture took. capture=False runs the same padded static-buffer path eagerly (tests, CPU)."""
        t0 = time.perf_counter()
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size, self.pad_block, max_batch,
                                   -(-max_model_len // self.block_size), self.device, self.sliding_window, capture)
        self.graphs.capture_all()
        return time.perf_counter() - t0

    @staticmethod
    def kv_bytes_per_block(cfg, block_size: int, kv_dtype: torch.dtype, tensor_parallel: int = 1) -> int:
        """On each rank: its share of the KV heads (at least one)."""
        per_token_head = cfg.head_dim * kv_dtype.itemsize + (4 if kv_dtype == torch.int8 else 0)
        heads = ShardPlan(cfg, TensorParallel(size=tensor_parallel)).kv_heads
        return 2 * cfg.num_layers * block_size * heads * per_token_head

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> LaunchedStep:
        """Enqueues the step's forward, logits and sampling without waiting for the device. Input ids
        that are placeholders come from the previous launch's samples, on the device."""
        step = LaunchedStep(RunnerOutput(num_tokens=sched.num_tokens))
        out = step.out
        if not sched.chunks:
            if sched.block_copies:
                self._run_plan(ForwardPlan(block_copies=sched.block_copies), None)
            return step
        t0 = time.perf_counter()
        nd = sched.num_decodes
        chunks = sched.chunks if self.loras is None else order_by_adapter(sched.chunks, nd)
        x = self._flatten(chunks)
        plan = ForwardPlan(x.input_ids, x.positions, x.slots, x.query_lens, x.seq_lens, x.tables, nd,
                           logit_rows=_logit_passes(x), patch_rows=[r for r, _ in x.placeholder_rows],
                           graphed=(self.graphs is not None and nd == len(sched.chunks) and not x.score_rows
                                    and nd <= self.graphs.max_batch),
                           block_copies=sched.block_copies, lora_spans=adapter_spans(chunks) if self.loras else [],
                           mrope_positions=_mrope_rows(x))
        patch = self._placeholder_ids(x.placeholder_rows)
        out.graphed = plan.graphed
        images = self._images(x.image_spans, out)
        t1 = time.perf_counter()
        hidden = self._run_plan(plan, patch, images)
        t2 = time.perf_counter()
        previous = self._last_tokens, self._last_rows     # penalties read placeholders' ids from these
        self._last_tokens, self._last_rows = None, {}
        passes = iter(plan.logit_rows)                    # computed in this order, as the other ranks do
        if x.sample_rows:
            self._sample(self._logits(hidden, next(passes)), x.sample_rows, step, previous)
        if x.score_rows:
            self._score(hidden, passes, x.score_rows, step)
        if x.pool_rows:
            step.pooled, step.pooled_owners = self.pooler.pool(hidden, x.pool_rows)
        if not step.awaits_mask:
            self._fetch(step)
        out.prepare_s, out.forward_s, out.sample_s = t1 - t0, t2 - t1, time.perf_counter() - t2
        return step

    def _run_plan(self, plan: ForwardPlan, patch, images=None) -> torch.Tensor | None:
        """Block copies, then the forward: [T, hidden] (None without tokens). Rank 0 of a group sends
        the plan (and the placeholder ids) first. images: (flat rows, their embeddings) replacing
        those rows' token embeddings (vision-language models; never under tensor parallelism)."""
        if self.channel is not None and self.channel.tp.leader:
            self.channel.send(plan, None if patch is None else patch[1])
        if plan.block_copies:
            self._copy_blocks(plan.block_copies)
        if not plan.input_ids:
            return None
        if plan.graphed:
            return self.graphs.run(plan.input_ids, plan.positions, plan.slots, plan.seq_lens, plan.tables, patch)
        dev = self.device
        meta = AttentionMetadata.build(self.block_size, plan.num_decodes, plan.query_lens, plan.seq_lens, plan.slots,
                                       plan.tables, dev, self.sliding_window, self.cpu_decode, self.batch_invariant)
        ids = to_device(plan.input_ids, dev, np.int64)
        pos = to_device(plan.mrope_positions if plan.mrope_positions is not None else plan.positions, dev, np.int64)
        if self.loras is not None:
            self.loras.set_step(plan.lora_spans, dev)
        if patch is not None:
            ids.index_copy_(0, *patch)
        if images is not None:
            return self.model(ids, pos, self.kv_caches, meta, image_rows=images[0], image_embeds=images[1])
        return self.model(ids, pos, self.kv_caches, meta)

    def _images(self, spans, out: RunnerOutput):
        """The step's image rows and their tower outputs (encoded now where not at hand), or None."""
        if not spans:
            return None
        before = self.image_embeds.encoded, self.image_embeds.reused
        images = self.image_embeds.splice(spans)
        out.images_encoded = self.image_embeds.encoded - before[0]
        out.images_reused = self.image_embeds.reused - before[1]
        return images

    def _logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return self.model.compute_logits(hidden.index_select(0, to_device(rows, hidden.device, np.int64)))

    @torch.inference_mode()
    def follow(self) -> None:
        """A tensor-parallel rank other than 0: runs rank 0's plans, forward and logits, until it ends."""
        while True:
            plan, patch_ids = self.channel.receive()
            if plan is None:
                return
            patch = None if patch_ids is None else (to_device(plan.patch_rows, self.device, np.int64), patch_ids)
            hidden = self._run_plan(plan, patch)
            for rows in plan.logit_rows:
                self._logits(hidden, rows)

    @torch.inference_mode()
    def sample_masked(self, step: LaunchedStep, bitmask: torch.Tensor) -> None:
        """Samples a step whose batch holds constrained rows, once the host has their grammar bitmask:
        [rows of step.masked's logits, words] int32 (all ones for unconstrained rows)."""
        t0 = time.perf_counter()
        logits, seqs, ahead, previous = step.masked
        step.masked = None
        apply_token_bitmask(logits, bitmask.to(logits.device, non_blocking=True))
        self._draw(logits, seqs, ahead, step, previous)
        self._fetch(step)
        step.out.sample_s += time.perf_counter() - t0

    def _fetch(self, step: LaunchedStep) -> None:
        """Starts copying what the host needs of a launched step (collect waits for it)."""
        wanted = [t for t in (step.candidate_lp, step.candidate_greedy, step.score_lp, step.score_greedy, step.pooled)
                  if t is not None]
        step.fetch = HostCopy([*(step.sampled.tensors() if step.sampled else []), *wanted])

    def collect(self, step: LaunchedStep) -> RunnerOutput:
        """Waits for a launched step and returns its results on the host."""
        out = step.out
        if step.fetch is None:
            return out
        t0 = time.perf_counter()
        host = iter(step.fetch.wait())          # in the order launch() listed them
        out.wait_s = time.perf_counter() - t0
        if step.sampled is not None:
            tokens, logprobs = step.sampled.finish([next(host) for _ in step.sampled.tensors()])
            for seq_id, tok, lp in zip(step.sample_owners, tokens, logprobs):
                out.sampled.setdefault(seq_id, []).append(tok)
                out.sample_logprobs.setdefault(seq_id, []).append(lp)
        if step.candidate_lp is not None:
            values, greedy, i = next(host).tolist(), next(host).tolist(), 0
            for seq_id, count in step.candidate_owners:
                out.candidate_first[seq_id] = values[i:i + count]
                out.candidate_first_greedy[seq_id] = greedy[i:i + count]
                i += count
        if step.score_lp is not None:
            for seq_id, value, greedy in zip(step.score_owners, next(host).tolist(), next(host).tolist()):
                out.token_logprobs.setdefault(seq_id, []).append(value)
                out.token_greedy.setdefault(seq_id, []).append(greedy)
        if step.pooled is not None:
            out.embeddings = split(next(host).tolist(), step.pooled_owners)
        return out

    def _placeholder_ids(self, rows) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(token rows, their ids) for placeholder inputs, gathered on the device from the previous
        launch's sampled tokens."""
        if not rows:
            return None
        dst = to_device([r for r, _ in rows], self.device, np.int64)
        src = to_device([self._last_rows[seq_id] for _, seq_id in rows], self.device, np.int64)
        return dst, self._last_tokens.index_select(0, src)

    def _flatten(self, chunks) -> "_StepInputs":
        """The step's chunks as one flat token batch (decodes first), with the rows to sample or score."""
        bs = self.block_size
        x = _StepInputs()
        for chunk in chunks:
            seq, start, end = chunk.seq, chunk.start, chunk.end
            base = len(x.input_ids)
            table = seq.block_table
            delta = seq.position_delta       # 0 but after a multimodal rotary model's images
            if end - start == 1:
                x.input_ids.append(seq.token_ids[start])
                x.positions.append(start + (delta if start >= seq.num_prompt_tokens else 0))
                x.slots.append(table[start // bs] * bs + start % bs)
            else:
                x.input_ids.extend(seq.token_ids[start:chunk.known_end])
                x.input_ids.extend(chunk.draft)
                pos = np.arange(start, end)
                x.positions.extend(np.where(pos >= seq.num_prompt_tokens, pos + delta, pos).tolist())
                x.slots.extend((np.asarray(table)[pos // bs] * bs + pos % bs).tolist())
            if seq.images is not None and start < seq.num_prompt_tokens:
                self._image_inputs(x, seq, base, start, end)
            if end == seq.num_tokens and seq.awaiting_token:
                # its id is the previous launch's sample, still on the device: patched in there (no sync)
                x.placeholder_rows.append((base + end - start - 1, seq.seq_id))
            x.query_lens.append(end - start)
            x.seq_lens.append(end)
            x.tables.append(table)
            for p in seq.scored_positions(start, end):
                x.score_rows.append((base + p - start, seq.token_ids[p + 1], seq.seq_id))
            if chunk.completes and seq.reads_last_logits:   # a drafting chunk samples at each drafted position too
                last = base + chunk.known_end - start - 1
                x.sample_rows.extend((last + j, chunk, j) for j in range(len(chunk.draft) + 1))
            if seq.kind is SeqKind.EMBED:
                x.pool_rows.append((base, chunk))
        return x

    @staticmethod
    def _image_inputs(x: _StepInputs, seq, base: int, start: int, end: int) -> None:
        """A chunk's image positions (their embeddings come from the tower) and, for multimodal rotary
        models, its prompt tokens' three position rows."""
        images = seq.images
        for i, lo, hi in images.overlaps(start, end):
            image = images.images[i]
            x.image_spans.append((base + lo - start, image, lo - image.offset, hi - image.offset))
        if images.positions is not None:
            last = min(end, seq.num_prompt_tokens)
            x.mrope.append((base, images.positions[:, start:last]))

    def _sample(self, logits, sample_rows, step: LaunchedStep, previous) -> None:
        seqs, ahead = [chunk.seq for _, chunk, _ in sample_rows], [j for *_, j in sample_rows]
        if any(s.matcher is not None for s in seqs):
            step.masked = (logits, seqs, ahead, previous)  # the grammar's mask comes once the previous step's tokens are known
            return
        self._draw(logits, seqs, ahead, step, previous)

    def _draw(self, logits, seqs, ahead, step: LaunchedStep, previous) -> None:
        """One row of logits per sequence (a drafting one: per position, `ahead` past its last token) -> its
        draws (or its candidates' first logprobs), on the device. A drafted position draws what the plain
        engine would draw there (the same uniform): its sample is the plain engine's if the draft was right."""
        if all(s.samples_one_token and not s.sampling.temperature > 0 and s.sampling.logprobs is None
               and not s.sampling.adjusts_logits for s in seqs):    # all greedy, one token each: the hot path
            step.sampled = DeviceSample(logits.argmax(dim=-1), [], [])
            step.sample_owners = [s.seq_id for s in seqs]
        else:
            rows, cand_rows, cand_tokens = [], [], []
            for i, seq in enumerate(seqs):
                if seq.kind is SeqKind.CANDIDATES:
                    cand_rows += [i] * len(seq.candidate_first_tokens)
                    cand_tokens += seq.candidate_first_tokens
                    step.candidate_owners.append((seq.seq_id, len(seq.candidate_first_tokens)))
                    continue
                for k in range(seq.draws):             # sample k of a parent's first draw becomes child k
                    u = (draw_uniform(seq.seed, seq.sample_index + k, seq.num_tokens + ahead[i])
                         if seq.sampling.temperature > 0 else 0.0)
                    rows.append(SampleRow(i, seq.sampling, u))
                    step.sample_owners.append(seq.seq_id)
            if rows:
                adjust = LogitsAdjust.build([r.params for r in rows], [seqs[r.logits_row] for r in rows],
                                            self.eos_token_ids, logits.shape[-1], logits.device, previous)
                step.sampled = sample_on_device(logits, rows, adjust)
            if cand_rows:
                r, t = (to_device(v, logits.device, np.int64) for v in (cand_rows, cand_tokens))
                step.candidate_lp = logits[r, t] - torch.logsumexp(logits, dim=-1)[r]
                step.candidate_greedy = logits.argmax(dim=-1)[r] == t       # lm-eval's is_greedy, per token
        if step.sampled is not None:       # the next launch's placeholder inputs come from these
            self._last_tokens = step.sampled.tokens
            for row, seq_id in enumerate(step.sample_owners):
                self._last_rows.setdefault(seq_id, row)

    def _score(self, hidden, passes, score_rows, step: LaunchedStep) -> None:
        """passes: the score rows' token rows, LOGITS_ROWS_PER_PASS at a time (_logit_passes)."""
        parts, greedy = [], []
        for lo, rows in zip(range(0, len(score_rows), LOGITS_ROWS_PER_PASS), passes):
            targets = to_device([t for _, t, _ in score_rows[lo:lo + LOGITS_ROWS_PER_PASS]], hidden.device, np.int64)
            logits = self._logits(hidden, rows)
            parts.append(logits.gather(1, targets[:, None])[:, 0] - torch.logsumexp(logits, dim=-1))
            greedy.append(logits.argmax(dim=-1) == targets)
        step.score_lp, step.score_greedy = torch.cat(parts), torch.cat(greedy)
        step.score_owners = [seq_id for _, _, seq_id in score_rows]

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        src, dst = (to_device(v, self.device, np.int64) for v in zip(*copies))
        for layer in self.kv_caches:
            for t in layer:
                t.index_copy_(0, dst, t.index_select(0, src))
