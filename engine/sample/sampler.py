"""Token sampling: greedy, temperature, top-k, top-p, min-p, for a whole step at once.

Every sampled row brings its own uniform draw, derived from the request's seed, the sample
index and the token position (`draw_uniform`): a row's sample never depends on which rows
shared its batch, on the device, or on a preemption in between. The step's rows are filtered
together on the device and sampled by inverse CDF; `sample_on_device` enqueues it all without
waiting for the device, and the host reads the results once (`DeviceSample.finish`).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from jobrunner.engine.sample.logits_process import LogitsAdjust
from jobrunner.engine.api.request import SamplingParams, TokenLogprob
from jobrunner.kernels.ops import to_device


@dataclass
class SampleRow:
    logits_row: int                         # row of the step's logits tensor
    params: SamplingParams
    uniform: float = 0.0                    # the row's draw in [0, 1); unused when greedy


def draw_uniform(seed: int, sample_index: int, position: int) -> float:
    """A uniform in [0, 1) fixed by (seed, sample, position): 53 bits of blake2b."""
    key = f"{seed}:{sample_index}:{position}".encode()
    bits = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 11
    return bits / 2.0**53


@dataclass
class DeviceSample:
    """A step's sampled tokens and logprobs, still on the device (nothing waited for)."""
    tokens: torch.Tensor                            # [R] int64
    logprob_rows: list[int]                         # rows that asked for logprobs
    top_k: list[int]                                # their k
    chosen: torch.Tensor | None = None              # [len(logprob_rows)] the chosen token's logprob
    top_ids: torch.Tensor | None = None             # [len(logprob_rows), max k]
    top_values: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        """What the host needs, in the order finish() takes it back."""
        extra = [self.chosen, self.top_ids, self.top_values] if self.logprob_rows else []
        return [self.tokens, *extra]

    def finish(self, host: list[torch.Tensor]) -> tuple[list[int], list[TokenLogprob | None]]:
        """host: tensors() on the host -> the chosen token and, when asked, its logprob per row."""
        tokens = host[0].tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(tokens)
        if self.logprob_rows:
            chosen, ids, values = host[1].tolist(), host[2].tolist(), host[3].tolist()
            for j, (i, k) in enumerate(zip(self.logprob_rows, self.top_k)):
                logprobs[i] = TokenLogprob(tokens[i], chosen[j], list(zip(ids[j][:k], values[j][:k])))
        return tokens, logprobs


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: [N, vocab] float32. Returns the chosen token and, when asked, its logprob per row."""
    if not rows:
        return [], []
    drawn = sample_on_device(logits, rows)
    return drawn.finish([t.cpu() for t in drawn.tensors()])


def sample_on_device(logits: torch.Tensor, rows: list[SampleRow], adjust: LogitsAdjust | None = None) -> DeviceSample:
    """logits: [N, vocab] float32 -> one token per row, enqueued on the device without a host sync.
    adjust: the rows' logits processing (penalties, logit_bias, min_tokens), by row of `rows`; the
    tokens are drawn from the processed logits, the logprobs reported are the model's own."""
    dev = logits.device
    order = [r.logits_row for r in rows]
    if order == list(range(logits.shape[0])):
        x = logits                                   # the common case: no copy of [N, vocab]
    else:
        x = logits.index_select(0, to_device(order, dev, np.int64))
    # ---- logits processing: one step, apart from the filters below (engine/sample/logits_process.py)
    processed = adjust.apply(x) if adjust is not None else x
    # ----
    tokens = processed.argmax(dim=-1)
    sampled = [i for i, r in enumerate(rows) if r.params.temperature > 0]
    if sampled:
        idx = to_device(sampled, dev, np.int64)
        tokens.index_copy_(0, idx, sample_filtered(processed.index_select(0, idx), [rows[i] for i in sampled]))
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    drawn = DeviceSample(tokens, wanted, [rows[i].params.logprobs for i in wanted])
    if wanted:
        idx = to_device(wanted, dev, np.int64)
        lp = torch.log_softmax(x.index_select(0, idx), dim=-1)
        drawn.chosen = lp.gather(1, tokens.index_select(0, idx)[:, None])[:, 0]
        drawn.top_values, drawn.top_ids = lp.topk(max(drawn.top_k), dim=-1)
    return drawn


def sample_filtered(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """[R, vocab] logits of rows with temperature > 0 -> [R] tokens, on the device, no sync."""
    dev, vocab = logits.device, logits.shape[-1]
    col = lambda values, dtype=np.float32: to_device(values, dev, dtype)[:, None]
    x = logits / col([r.params.temperature for r in rows])
    ks = [r.params.top_k if r.params.top_k < vocab else 0 for r in rows]
    if any(ks):                                      # keep each row's k largest (k = 0: all)
        k = col(ks, np.int64)
        kth = x.topk(max(ks), dim=-1).values.gather(1, (k - 1).clamp(min=0))
        x = x.masked_fill((k > 0) & (x < kth), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if any(r.params.min_p > 0 for r in rows):
        floor = col([r.params.min_p for r in rows]) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
    if any(r.params.top_p < 1.0 for r in rows):      # keep the smallest set reaching top_p
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) > col([r.params.top_p for r in rows])
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(drop, 0.0))
    # Inverse CDF: the first token whose cumulative mass exceeds u * total (total: the kept mass;
    # 'right' never lands on a token of zero probability).
    cdf = probs.double().cumsum(dim=-1)
    u = col([r.uniform for r in rows], np.float64) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True)[:, 0].clamp_(max=vocab - 1)
