"""Logits processing before sampling: logit_bias, min_tokens, and the repetition, frequency and
presence penalties, for a whole step's sampled rows at once, on the device.

    adjust = LogitsAdjust.build(rows, seqs, eos_ids, vocab, device, previous)   # host -> device, no sync
    x = adjust.apply(x)                                                          # [R, vocab], a new tensor

The order is vLLM's: logit_bias and the min_tokens mask, then the penalties, then (in the
sampler) temperature and the filters. The penalties read each row's token history as one
padded matrix of ids (`ids`, [P, L]; padding is `vocab`, an extra buffer column nothing reads):
counting is one scatter over the batch, and only the history's logits are read and written;
never a loop over the vocabulary:

    repetition (HF's RepetitionPenaltyLogitsProcessor): tokens of prompt + completion,
        x = x / p where x > 0, x * p where x < 0
    frequency, presence (OpenAI): c = the token's count in the completion,
        x = x - frequency * c - presence * (c > 0)

With async scheduling a row's last token may still be a placeholder on the host: its id is
taken on the device from the previous launch's samples (`previous`), as the runner's inputs are.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from jobrunner.kernels.ops import to_device


@dataclass
class LogitsAdjust:
    bias_at: tuple[torch.Tensor, torch.Tensor] | None = None    # (rows, tokens) of logit_bias entries
    bias: torch.Tensor | None = None                            # [len] added there
    masked_at: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, tokens) set to -inf (min_tokens)
    penalized: torch.Tensor | None = None                       # [P] rows with a penalty
    ids: torch.Tensor | None = None                             # [P, L] history; pad = vocab
    generated: torch.Tensor | None = None                       # [P, L] True where ids[p, j] is a completion token
    repetition: torch.Tensor | None = None                      # [P, 1]
    frequency: torch.Tensor | None = None                       # [P, 1]
    presence: torch.Tensor | None = None                        # [P, 1]

    @classmethod
    def build(cls, params: list, seqs: list, eos_ids, vocab: int, device: torch.device,
              previous: tuple[torch.Tensor | None, dict[int, int]] = (None, {})) -> LogitsAdjust | None:
        """params[i], seqs[i]: the SamplingParams and the Sequence of logits row i (rows of one sequence's
        n draws repeat it). previous: the last launch's sampled tokens on the device and each sequence's
        row there, for a history ending in a placeholder. None when no row adjusts its logits."""
        if not any(p.adjusts_logits for p in params):
            return None
        adj = cls()
        bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
        if bias:
            adj.bias_at = tuple(to_device(v, device, np.int64) for v in ([r for r, _, _ in bias], [t for _, t, _ in bias]))
            adj.bias = to_device([b for _, _, b in bias], device, np.float32)
        eos = tuple(t for t in eos_ids if t < vocab)
        masked = [(i, t) for i, (p, s) in enumerate(zip(params, seqs))
                  if s.num_completion_tokens < p.min_tokens for t in eos + p.stop_token_ids if t < vocab]
        if masked:
            adj.masked_at = tuple(to_device(v, device, np.int64) for v in zip(*masked))
        pen = [i for i, p in enumerate(params)
               if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty]
        if pen:
            adj._history([params[i] for i in pen], [seqs[i] for i in pen], vocab, device, previous)
            adj.penalized = to_device(pen, device, np.int64)
        return adj

    def _history(self, params, seqs, vocab: int, device, previous) -> None:
        """The penalized rows' token ids, padded: prompt + completion where a repetition penalty needs the
        prompt, the completion alone otherwise."""
        starts = [0 if p.repetition_penalty != 1.0 else s.num_prompt_tokens for p, s in zip(params, seqs)]
        length = max([s.num_tokens - a for s, a in zip(seqs, starts)] + [1])
        ids = np.full((len(seqs), length), vocab, dtype=np.int64)
        generated = np.zeros((len(seqs), length), dtype=bool)
        patch_at, patch_from = [], []
        for i, (s, a) in enumerate(zip(seqs, starts)):
            n = s.num_tokens - a
            ids[i, :n] = s.token_ids[a:]
            generated[i, s.num_prompt_tokens - a:n] = True
            if s.awaiting_token:
                ids[i, n - 1] = 0
                patch_at.append(i * length + n - 1)
                patch_from.append(previous[1][s.seq_id])
        self.ids = to_device(ids, device)
        if patch_at:
            src = to_device(patch_from, device, np.int64)
            self.ids.view(-1).index_copy_(0, to_device(patch_at, device, np.int64), previous[0].index_select(0, src))
        self.generated = to_device(generated, device)
        col = lambda values: to_device(values, device, np.float32)[:, None]
        self.repetition = col([p.repetition_penalty for p in params])
        self.frequency = col([p.frequency_penalty for p in params])
        self.presence = col([p.presence_penalty for p in params])

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """[R, vocab] float32 -> the processed logits, a new tensor (the input is left as it was)."""
        x = logits.clone()
        if self.bias is not None:
            x.index_put_(self.bias_at, self.bias, accumulate=True)
        if self.masked_at is not None:
            x.index_put_(self.masked_at, torch.full((), float("-inf"), device=x.device))   # a fill: no host copy
        if self.penalized is not None:
            self._penalize(x)
        return x

    def _penalize(self, x: torch.Tensor) -> None:
        """Penalizes the rows' history tokens in place. Only those logits change, so only they are read
        and written: two [P, vocab + 1] buffers (counts, presence) are the only full-width passes. A padding
        entry stands for token vocab - 1 and gets that token's own value (itself if it isn't in the history),
        so every write to one logit writes the same value."""
        rows, vocab = self.ids.shape[0], x.shape[-1]
        buf = torch.zeros(2, rows, vocab + 1, dtype=x.dtype, device=x.device)
        buf[0].scatter_add_(1, self.ids, self.generated.to(x.dtype))      # count in the completion
        buf[1].scatter_(1, self.ids, 1.0)                                   # in prompt or completion
        tokens = self.ids.clamp(max=vocab - 1)
        counts, seen = buf[0].gather(1, tokens), buf[1].gather(1, tokens) > 0
        at = (self.penalized[:, None], tokens)
        g = x[at]                                                           # [P, L]
        g = torch.where(seen, torch.where(g > 0, g / self.repetition, g * self.repetition), g)
        x[at] = g - self.frequency * counts - self.presence * (counts > 0).to(x.dtype)
