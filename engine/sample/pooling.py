"""Embeddings: an EMBED sequence's final hidden states (after the model's final norm) pooled into
one vector, chunk by chunk as its prompt is computed, then truncated and L2-normalized.

    last   the hidden state of the prompt's last token (Qwen3-Embedding, gte-Qwen2, e5-mistral)
    mean   the average over every prompt position
    cls    the hidden state of the first token

A prompt may be computed in several chunks (chunked prefill, a step's token budget), so mean keeps
a running float32 sum and cls the first position's state, per sequence, on the device, between
launches. Steps run in launch order on the device's one stream, so the running state a launch
reads is always the previous chunk's. A chunk's rows are added to the running sum one by one in position
order (index_add_ from the sum so far), so the sum's bits do not depend on where the chunks were cut. A chunk starting at position 0 starts afresh: a sequence
preempted and recomputed starts again there (mean and cls take nothing from the prefix cache,
sequence.max_cacheable_prefix; last needs only its final chunk, which always holds the last token).
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from jobrunner.engine.api.request import EmbedParams
from jobrunner.kernels.ops import to_device


class Pooler:
    def __init__(self):
        self._partial: dict[int, torch.Tensor] = {}     # seq_id -> [hidden] float32: mean's sum, cls's state

    def pool(self, hidden: torch.Tensor, rows: list[tuple]) -> tuple[torch.Tensor | None, list[tuple[int, int]]]:
        """hidden: [T, hidden], the step's flattened tokens; rows: (first token row, chunk) of each EMBED
        chunk. Returns the finished vectors of the chunks that complete their sequence, flat ([sum of
        their sizes] float32, in owner order), and their owners (seq_id, size)."""
        means = [(base, c) for base, c in rows if c.seq.embed.pooling == "mean"]
        mean_sums = iter(self._chunk_sums(hidden, means, [self._partial.pop(c.seq.seq_id) if c.start > 0 else None
                                                          for _, c in means]))
        last_rows = [base + c.num_tokens - 1 for base, c in rows if c.seq.embed.pooling == "last" and c.completes]
        lasts = iter(_rows(hidden, last_rows))      # one gather for the step, not one per sequence
        done: list[tuple[torch.Tensor, EmbedParams, int]] = []
        for base, chunk in rows:
            seq = chunk.seq
            pooling = seq.embed.pooling
            if pooling == "mean":
                part = next(mean_sums)                  # the running sum through this chunk
                vector = part / seq.num_tokens if chunk.completes else None
            elif pooling == "cls":
                part = hidden[base].float() if chunk.start == 0 else self._partial.pop(seq.seq_id)
                vector = part if chunk.completes else None
            else:   # last: only the completing chunk matters; it ends with the last token
                part = None
                vector = next(lasts) if chunk.completes else None
            if vector is not None:
                done.append((vector, seq.embed, seq.seq_id))
            elif part is not None:
                self._partial[seq.seq_id] = part
        return finish(done)

    @staticmethod
    def _chunk_sums(hidden: torch.Tensor, rows: list[tuple], before: list) -> list[torch.Tensor]:
        """Each chunk's running float32 sum: its sequence's sum so far (`before`, None: none) plus its rows of
        hidden, added in order, in one index_add over the step."""
        if not rows:
            return []
        token_rows = np.concatenate([np.arange(base, base + c.num_tokens) for base, c in rows])
        segment = np.repeat(np.arange(len(rows)), [c.num_tokens for _, c in rows])
        dev = hidden.device
        sums = torch.zeros(len(rows), hidden.shape[1], dtype=torch.float32, device=dev)
        for i, b in enumerate(before):
            if b is not None:
                sums[i] = b
        sums.index_add_(0, to_device(segment, dev, np.int64),
                        hidden.index_select(0, to_device(token_rows, dev, np.int64)).float())
        return list(sums.unbind(0))


def _rows(hidden: torch.Tensor, rows: list[int]) -> list[torch.Tensor]:
    """hidden's rows `rows` as float32 vectors, in one gather."""
    if not rows:
        return []
    return list(hidden.index_select(0, to_device(rows, hidden.device, np.int64)).float().unbind(0))


def finish(done: list[tuple[torch.Tensor, EmbedParams, int]]) -> tuple[torch.Tensor | None, list[tuple[int, int]]]:
    """Pooled vectors -> truncated to their `dimensions` (Matryoshka) and then, with `normalize`, to unit
    L2 norm; one batched op per distinct (dimensions, normalize). Returns them flat and their owners."""
    if not done:
        return None, []
    vectors = torch.stack([v for v, _, _ in done])          # [N, hidden] float32
    groups: dict[tuple[int, bool], list[int]] = defaultdict(list)
    for i, (_, p, _) in enumerate(done):
        groups[(p.dimensions or vectors.shape[1], p.normalize)].append(i)      # checked <= hidden on add
    parts, owners = [], []
    for (dims, normalize), idx in groups.items():
        v = vectors[to_device(idx, vectors.device, np.int64), :dims]
        if normalize:
            v = torch.nn.functional.normalize(v, dim=-1)
        parts.append(v.reshape(-1))
        owners += [(done[i][2], dims) for i in idx]
    return torch.cat(parts), owners


def split(flat: list[float], owners: list[tuple[int, int]]) -> dict[int, list[float]]:
    """The host's copy of pool()'s flat vectors -> seq_id -> its vector."""
    out, i = {}, 0
    for seq_id, size in owners:
        out[seq_id] = flat[i:i + size]
        i += size
    return out
