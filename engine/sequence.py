"""Per-sequence state. No torch.

A sequence's tokens are computed left to right: `num_computed_tokens` catches up with
`len(token_ids)`; a generating sequence samples when it catches up, a scoring sequence
stops one short (the last token's logits are never needed).

With asynchronous scheduling a sequence may end in one PLACEHOLDER: the token that the step
in flight is sampling. The next step is scheduled over it (its input id is taken on the
device from that step's samples); the engine puts the real token in its place before
anything reads the text, and before another placeholder is added.
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from engine.request import SamplingParams, TokenLogprob

_ids = itertools.count()
PLACEHOLDER = -1   # never a token id: prompts are checked to lie in 0..vocab-1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    scoring: bool = False          # compute logprobs of tokens[logprobs_from:], sample nothing
    logprobs_from: int = 0         # first token whose logprob is wanted (scoring / prompt logprobs)
    sample_index: int = 0          # which of the request's n samples
    cacheable_prefix: bool = True  # may match the prefix cache when admitted
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0     # prompt tokens that came from the prefix cache
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)   # scoring / prompt logprobs
    num_preemptions: int = 0
    seed: int = 0                  # sampling generator seed (with sample_index)
    fork_samples: int = 1          # tokens to draw at the first sampling event (n > 1 forks after it)
    candidate_first_tokens: list[int] | None = None   # classify: score these at the prompt's end, sample nothing

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def awaiting_token(self) -> bool:
        """The last token is a placeholder for a sample still on the device."""
        return self.token_ids[-1] == PLACEHOLDER

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def compute_target(self) -> int:
        """How many tokens must be computed before the sequence's next event."""
        return self.num_tokens - 1 if self.scoring else self.num_tokens

    @property
    def num_pending(self) -> int:
        return max(self.compute_target - self.num_computed_tokens, 0)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens
