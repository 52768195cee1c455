"""Per-sequence state, and the rules that follow from a sequence's kind. No torch.

A sequence's tokens are computed left to right: `num_computed_tokens` catches up with
`compute_target`, where the sequence's next event happens:

    kind        event when caught up                        compute_target
    GENERATE    sample `draws` tokens (n > 1: the first     num_tokens
                event draws n; samples 1..n-1 fork)
    SCORE       done: logprobs of tokens[logprobs_from:]    num_tokens - 1 (the last token's
                                                            logits are never needed)
    CANDIDATES  score each candidate's first token at the   num_tokens
                prompt's end, then branch one SCORE child
                per longer candidate
    EMBED       done: its pooled final hidden state         num_tokens
                (engine/sample/pooling.py); samples nothing

Callers ask the predicates below instead of re-deriving these rules.

With asynchronous scheduling a GENERATE sequence may end in one PLACEHOLDER: the token that
the step in flight is sampling, so the next step can be scheduled before the sample is read.
Only these places touch it, each for its own reason:
  * here: `expect_token` adds it, `append_token` puts the real token in its place (the text,
    stop checks and hashes only ever read real tokens);
  * the engine decides which sequences get one (engine.Engine._expect_tokens: those that go
    on with exactly one token after their sample);
  * the KV manager hashes a full block only once its tokens are known (`num_known_tokens` in
    allocate; the output processor calls `register_resolved` when `append_token` resolves one);
  * the model runner takes a placeholder's input id on the device from the previous step's
    samples (`awaiting_token`), without waiting for them.
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from jobrunner.engine.schedule.prompt_images import PromptImages
from jobrunner.engine.api.request import EmbedParams, SamplingParams, TokenLogprob

_ids = itertools.count()
PLACEHOLDER = -1   # never a token id: prompts are checked to lie in 0..vocab-1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class SeqKind(enum.Enum):
    GENERATE = "generate"        # samples tokens; may also score its prompt (prompt logprobs)
    SCORE = "score"              # logprobs of tokens[logprobs_from:], samples nothing
    CANDIDATES = "candidates"    # scores candidate_first_tokens at the prompt's end, samples nothing
    EMBED = "embed"              # pools its prompt's hidden states, samples nothing


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    kind: SeqKind = SeqKind.GENERATE
    logprobs_from: int = 0         # first token whose logprob is wanted (0: none; SCORE, or prompt logprobs)
    sample_index: int = 0          # which of the request's n samples (SCORE child of CANDIDATES: which candidate)
    seed: int = 0                  # sampling generator seed (with sample_index)
    draws: int = 1                 # GENERATE: tokens to draw at the next sampling event (n at the first, then 1)
    candidate_first_tokens: list[int] | None = None   # CANDIDATES: the first token of each candidate
    embed: EmbedParams | None = None                  # EMBED: how its hidden states are pooled
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0     # prompt tokens that came from the prefix cache
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)   # scored tokens' logprobs, from logprobs_from
    token_greedy: list[bool] = field(default_factory=list)      # whether each scored token is its position's argmax
    matcher: object | None = None  # constrained: its grammar matcher (engine/sample/constraints.py), fed every sampled
                                   # token; it outlives preemption, since the sequence keeps its tokens
    matcher_sees_reasoning: bool = False   # its grammar covers an optional reasoning block (Constraint.reasoning):
                                           # fed every completion token, the reasoning's included
    # Reasoning models (sampling.reasoning_markers set): where the answer starts, as a token count
    # (prompt included); None while the sequence is reasoning. See `reasoning_end_in_prompt`.
    reasoning_end: int | None = None
    lora: int = 0                  # its LoRA adapter (engine/lora: 1-based index), 0: the base model
    images: PromptImages | None = None   # its prompt's images (engine/schedule/prompt_images.py); None: text only
    draft: list[int] = field(default_factory=list)   # tokens guessed past its last, verified by its next step
                                                     # (engine/spec); never part of token_ids until accepted

    def __post_init__(self):
        if self.sampling.reasoning_markers is not None and self.reasoning_end is None:
            self.reasoning_end = reasoning_end_in_prompt(self.token_ids[:self.num_prompt_tokens],
                                                         *self.sampling.reasoning_markers)

    # --- children -----------------------------------------------------------------------------

    def fork(self, sample_index: int) -> Sequence:
        """Sample `sample_index` of an n > 1 request: the parent's tokens so far, its own draws from then on."""
        return Sequence(self.request_id, list(self.token_ids), self.num_prompt_tokens, self.sampling,
                        sample_index=sample_index, seed=self.seed, reasoning_end=self.reasoning_end, lora=self.lora,
                        images=self.images, matcher_sees_reasoning=self.matcher_sees_reasoning)

    def candidate_child(self, candidate: list[int], index: int) -> Sequence:
        """A SCORE sequence for the rest of candidate `index` (its first token is scored already)."""
        return Sequence(self.request_id, self.token_ids + list(candidate), self.num_prompt_tokens, self.sampling,
                        kind=SeqKind.SCORE, logprobs_from=self.num_tokens + 1, sample_index=index, lora=self.lora,
                        images=self.images)

    @property
    def hash_root(self) -> int:
        """Where its KV block hash chain starts: KV computed under one adapter is never another's."""
        return 0 if not self.lora else hash(("lora", self.lora))

    def key_ids(self, lo: int, hi: int) -> list[int]:
        """token_ids[lo:hi] as the KV cache keys them: an image's placeholders by the image's pixels."""
        if self.images is None:
            return self.token_ids[lo:hi]
        return self.images.key_ids(self.token_ids, lo, hi)

    @property
    def position_delta(self) -> int:
        """A token past the prompt at index i sits at position i + this (multimodal rotary; else 0)."""
        return self.images.delta if self.images is not None else 0

    # --- what the kind implies ------------------------------------------------------------------

    @property
    def is_scoring(self) -> bool:
        """Computes logprobs of its own tokens and ends; no completion of its own."""
        return self.kind is SeqKind.SCORE

    @property
    def samples_one_token(self) -> bool:
        """Its next event appends exactly one sampled token and it goes on (no fork, no branch, no end
        by kind): the case the greedy fast path and async placeholders serve."""
        return self.kind is SeqKind.GENERATE and self.draws == 1

    @property
    def reads_last_logits(self) -> bool:
        """Its event reads the logits after its last computed token (to sample, or to score the
        candidates' first tokens); a SCORE sequence's event needs none."""
        return self.kind in (SeqKind.GENERATE, SeqKind.CANDIDATES)

    @property
    def pools_every_position(self) -> bool:
        """An EMBED sequence whose pooling reads positions other than the last (mean, cls): each of
        them must be computed here, so none may come from the prefix cache."""
        return self.kind is SeqKind.EMBED and self.embed.pooling != "last"

    @property
    def compute_target(self) -> int:
        """How many tokens must be computed before the sequence's next event."""
        return self.num_tokens - 1 if self.is_scoring else self.num_tokens

    @property
    def max_cacheable_prefix(self) -> int:
        """The most leading tokens that may come from the prefix cache on admission: tokens before the
        first scored one (its logits must be computed) and before the compute target; none for an
        embedding pooled over more than its last position (the cache keeps K and V, not hidden states)."""
        if self.pools_every_position:
            return 0
        limit = self.compute_target - 1
        if self.logprobs_from:
            limit = min(limit, self.logprobs_from - 1)
        return max(limit, 0)

    def scored_positions(self, start: int, end: int) -> range:
        """Positions in [start, end) whose logits score the token after them: from logprobs_from - 1 up to
        the last scored token (SCORE: the sequence's end; prompt logprobs: the prompt's end)."""
        if not self.logprobs_from:
            return range(0)
        last = self.num_tokens - 1 if self.is_scoring else self.num_prompt_tokens - 1
        return range(max(start, self.logprobs_from - 1), min(end, last))

    def record_token_logprobs(self, start: int, values: list[float], greedy: list[bool]) -> None:
        """Stores the scored logprobs (and argmax flags) of a chunk that began at position start, by
        position: a sequence preempted and recomputed scores the same tokens again and overwrites them."""
        first = max(start, self.logprobs_from - 1) - (self.logprobs_from - 1)
        self.token_logprobs[first:] = values
        self.token_greedy[first:] = greedy

    # --- tokens and the async placeholder --------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def awaiting_token(self) -> bool:
        """The last token is a placeholder for a sample still on the device."""
        return self.token_ids[-1] == PLACEHOLDER

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are known on the host (all but a trailing placeholder)."""
        return self.num_tokens - self.awaiting_token

    def expect_token(self) -> None:
        """Holds the place of the token the step in flight samples, so the next step can compute it."""
        self.token_ids.append(PLACEHOLDER)

    def append_token(self, token: int) -> bool:
        """Adds a sampled token; True when it replaced the placeholder (then its block may become hashable)."""
        resolved = self.awaiting_token
        if resolved:
            self.token_ids[-1] = token
        else:
            self.token_ids.append(token)
        if self.reasoning_end is None and self.sampling.reasoning_markers is not None:
            end = self.sampling.reasoning_markers[1]
            if self.token_ids[-len(end):] == list(end) and self.num_completion_tokens >= len(end):
                self.reasoning_end = self.num_tokens
        return resolved

    def constrained_from(self, position: int) -> bool:
        """Whether the token at `position` is under the sequence's constraint: not while reasoning,
        nor the reasoning's closing marker (the answer starts at reasoning_end); every one where the
        grammar itself covers the reasoning (matcher_sees_reasoning)."""
        if self.matcher_sees_reasoning:
            return True
        return not self.in_reasoning and (self.reasoning_end is None or position >= self.reasoning_end)

    @property
    def in_reasoning(self) -> bool:
        """A reasoning model's sequence before its answer: a constraint on the answer applies from
        position `reasoning_end` on (the hook for constrained decoding)."""
        return self.sampling.reasoning_markers is not None and self.reasoning_end is None

    @property
    def num_reasoning_tokens(self) -> int:
        """Completion tokens before the answer (the end marker included); all of them while reasoning."""
        if self.sampling.reasoning_markers is None:
            return 0
        end = self.num_tokens if self.reasoning_end is None else self.reasoning_end
        return max(end - self.num_prompt_tokens, 0)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_pending(self) -> int:
        return max(self.compute_target - self.num_computed_tokens, 0)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens


def reasoning_end_in_prompt(prompt: list[int], start: tuple[int, ...], end: tuple[int, ...]) -> int | None:
    """Where the answer starts if the prompt already closed the reasoning (its last marker is `end`, as
    Qwen3's template writes `<think>\n\n</think>` with enable_thinking off): the prompt's length; else
    None: generation starts inside the reasoning, whether the model opens it itself (Qwen3) or the
    template did (DeepSeek-R1, whose answers may lack the opening tag). vLLM's rule for both."""
    last_end, last_start = last_index_of(prompt, end), last_index_of(prompt, start)
    return len(prompt) if last_end is not None and (last_start is None or last_start < last_end) else None


def last_index_of(tokens: list[int], marker: tuple[int, ...]) -> int | None:
    """Where the last occurrence of the token run `marker` starts in tokens; None if it never occurs."""
    m = list(marker)
    for i in range(len(tokens) - len(m), -1, -1):
        if tokens[i] == m[0] and tokens[i:i + len(m)] == m:
            return i
    return None
