"""Token sampling: greedy, temperature, top-k, top-p, min-p, with a generator per sequence.

Each sampled sequence draws from its own torch.Generator, seeded from the request's seed and
sample index, so a row's sample never depends on which rows shared its batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import SamplingParams, TokenLogprob


@dataclass
class SampleRow:
    logits_row: int                         # row of the step's logits tensor
    params: SamplingParams
    generator: torch.Generator | None       # None for greedy


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: [N, vocab] float32. Returns the chosen token and, when asked, its logprob per row."""
    if not rows:
        return [], []
    order = [r.logits_row for r in rows]
    if order == list(range(logits.shape[0])):
        x = logits                                   # the common case: no copy of [N, vocab]
    else:
        x = logits.index_select(0, torch.tensor(order, device=logits.device))
    tokens = x.argmax(dim=-1)
    for i, r in enumerate(rows):
        if r.params.temperature > 0:
            tokens[i] = _sample_one(x[i], r.params, r.generator)
    tokens_list = tokens.tolist()
    logprobs: list[TokenLogprob | None] = [None] * len(rows)
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if wanted:
        lp = torch.log_softmax(x[wanted], dim=-1)
        for j, i in enumerate(wanted):
            k = rows[i].params.logprobs
            top = []
            if k:
                vals, ids = lp[j].topk(k)
                top = list(zip(ids.tolist(), vals.tolist()))
            logprobs[i] = TokenLogprob(tokens_list[i], float(lp[j, tokens_list[i]]), top)
    return tokens_list, logprobs


def _sample_one(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    x = logits / p.temperature
    if p.top_k and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cum = sorted_probs.cumsum(-1)
        drop = (cum - sorted_probs) > p.top_p          # keep the smallest set reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p, one draw per vocab entry.
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return int((probs / noise).argmax())


def make_generator(seed: int, device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
    return g
