"""Token sampling: greedy, temperature, top-k, top-p, min-p, for a whole step at once.

Every sampled row brings its own uniform draw, derived from the request's seed, the sample
index and the token position (`draw_uniform`): a row's sample never depends on which rows
shared its batch, on the device, or on a preemption in between. The step's rows are filtered
together on the device and sampled by inverse CDF, with one host sync for the whole step.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from engine.request import SamplingParams, TokenLogprob


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
    sampled = [i for i, r in enumerate(rows) if r.params.temperature > 0]
    if sampled:
        idx = torch.tensor(sampled, device=x.device)
        tokens[idx] = sample_filtered(x.index_select(0, idx), [rows[i] for i in sampled])
    tokens_list = tokens.tolist()                    # the step's one host sync
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


def sample_filtered(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """[R, vocab] logits of rows with temperature > 0 -> [R] tokens, on the device, no sync."""
    dev, vocab = logits.device, logits.shape[-1]
    col = lambda values, dtype=torch.float32: torch.tensor(values, dtype=dtype, device=dev)[:, None]
    x = logits / col([r.params.temperature for r in rows])
    ks = [r.params.top_k if r.params.top_k < vocab else 0 for r in rows]
    if any(ks):                                      # keep each row's k largest (k = 0: all)
        k = col(ks, torch.int64)
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
    u = col([r.uniform for r in rows], torch.float64) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True)[:, 0].clamp_(max=vocab - 1)
