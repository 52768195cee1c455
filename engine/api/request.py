"""What goes into the engine and what comes out. Plain data, no torch."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0            # 0: greedy
    top_p: float = 1.0
    top_k: int = 0                      # 0: off
    min_p: float = 0.0
    seed: int | None = None             # per request, so a row's sample ignores its batch mates
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None         # None: off; k: chosen token's logprob plus top-k alternatives
    prompt_logprobs: bool = False       # logprob of every prompt token after the first
    n: int = 1                          # samples per prompt, sharing the prompt's KV
    # logits processing before sampling (engine/sample/logits_process.py); the defaults change nothing
    presence_penalty: float = 0.0       # OpenAI: minus this from every token already in the completion
    frequency_penalty: float = 0.0      # OpenAI: minus this times the token's count in the completion
    repetition_penalty: float = 1.0     # CTRL/HF: logits of tokens in prompt or completion / p (if > 0) or * p
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, added to its logit), as OpenAI's logit_bias
    min_tokens: int = 0                 # end of sequence, stop token ids and stop strings wait for this many
    # reasoning models: the token ids that open and close the reasoning (engine.sequence: reasoning_end)
    reasoning_markers: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    def __post_init__(self):
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.n < 1:
            raise ValueError("n must be >= 1")
        if not (-2 <= self.presence_penalty <= 2 and -2 <= self.frequency_penalty <= 2):
            raise ValueError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if not self.repetition_penalty > 0:
            raise ValueError("repetition_penalty must be > 0")
        if any(not -100 <= b <= 100 for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits are processed before sampling (engine/sample/logits_process.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)


POOLINGS = ("last", "mean", "cls")     # which hidden states an embedding is made of


@dataclass(frozen=True)
class EmbedParams:
    """An embedding request's pooling: the final hidden states (after the final norm) of the
    prompt's last token, of all its tokens averaged, or of its first token (cls); then truncated
    to `dimensions` (Matryoshka) and, with `normalize`, scaled to unit L2 norm."""
    pooling: str = "last"
    normalize: bool = True
    dimensions: int | None = None       # None: the model's hidden size

    def __post_init__(self):
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, not {self.pooling!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError("dimensions must be >= 1")


CONSTRAINT_KINDS = ("json_schema", "json", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Constraint:
    """What a generated text must match (engine/sample/constraints.py compiles it). `spec` by kind:
    json_schema: the schema as JSON text; json: unused (any JSON object); regex: the pattern;
    choice: a JSON list of the allowed strings; grammar: Lark or GBNF-style EBNF text.
    `reasoning`: the (opening, closing) tags of a reasoning block the text may start with (a reasoning
    model that may open its own reasoning, or answer at once): the grammar then covers the whole text,
    an optional reasoning block, blanks, then the answer under `spec`."""
    kind: str
    spec: str = ""
    reasoning: tuple[str, str] | None = None

    def __post_init__(self):
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}")


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a prompt, preprocessed by the model's image processor (engine.vision), and the run
    of placeholder tokens it fills: prompt_token_ids[offset:offset + length] are all the model's image
    token; the vision tower's `length` embeddings replace theirs. `key` identifies the pixels (a hash
    of `pixels` and `grid`): the prefix cache, the engine's embedding cache and the job's planner,
    dedup and result cache tell images apart by it alone."""
    pixels: np.ndarray                  # float32, as the checkpoint's processor makes it (engine.vision)
    grid: tuple[int, int, int]          # (t, h, w) in patches, before any merge
    key: int                            # 63-bit hash of pixels and grid
    offset: int                         # first placeholder token's index in the prompt
    length: int                         # placeholder tokens (the tower's output rows)


@dataclass
class Request:
    """One prompt. `candidates`: token lists to score after the prompt (classification);
    when set, nothing is generated and each candidate's summed logprob is returned."""
    id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    candidates: list[list[int]] | None = None
    score_from: int | None = None       # score mode: logprobs of prompt tokens [score_from:], nothing generated
    prompt: str | None = None           # the text, kept for the output only
    embed: EmbedParams | None = None    # embedding mode: one forward over the prompt, its pooled hidden state
    more_inputs: list[list[int]] | None = None   # embedding mode: further texts, one vector each after the prompt's
    constraint: Constraint | None = None    # generated text must match it (structured output)
    adapter: str | None = None          # a LoRA adapter of EngineConfig.loras by name; None: the base model
    images: tuple[ImageInput, ...] = ()  # in prompt order, their placeholder runs apart (vision-language models)

    @property
    def tokens_needed(self) -> int:
        """Positions the request occupies at most: the prompt and its longest candidate."""
        if self.more_inputs:
            return max(len(self.prompt_token_ids), *(len(x) for x in self.more_inputs))
        return len(self.prompt_token_ids) + max((len(c) for c in self.candidates or [[]]), default=0)

    def context_error(self, context: int) -> str | None:
        """Why the request does not fit a model's context of `context` positions, or None."""
        if self.tokens_needed <= context:
            return None
        if self.more_inputs:
            return f"an input of {self.tokens_needed} tokens exceeds the model's context of {context} tokens"
        prompt = len(self.prompt_token_ids)     # as the row's prompt_tokens counts it
        if self.tokens_needed > prompt:         # classify: a candidate follows the prompt
            return (f"prompt of {prompt} tokens ({self.tokens_needed} with its longest candidate) exceeds the "
                    f"model's context of {context} tokens")
        return f"prompt of {prompt} tokens exceeds the model's context of {context} tokens"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Completion:
    """One generated sample (a request with n > 1 has several)."""
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str                  # stop | length | error
    logprobs: list[TokenLogprob] | None = None
    reasoning_tokens: int | None = None  # reasoning markers set: completion tokens up to the reasoning's end
    constrained: bool = False           # generated under a constraint (length: the text is incomplete)


@dataclass
class RequestOutput:
    id: str
    completions: list[Completion]
    prompt_tokens: int
    cached_tokens: int                  # prompt tokens served from the prefix cache
    completion_tokens: int
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    error: str | None = None
    prompt_logprobs: list[float] | None = None       # from token 1 (prompt_logprobs) or score_from on
    candidate_logprobs: list[list[float]] | None = None  # per candidate, per token
    # beside prompt_logprobs and candidate_logprobs: whether each scored token is the argmax of the
    # logits that score it (lm-eval's is_greedy is `all` of a continuation's)
    prompt_greedy: list[bool] | None = None
    candidate_greedy: list[list[bool]] | None = None
    embeddings: list[list[float]] | None = None      # embedding mode: one vector per input, the prompt's first
    computed: bool = True               # False: it ended before any step (refused by the checks): no token computed
    draft_tokens: int = 0               # speculative decoding: tokens drafted and verified for it,
    accepted_tokens: int = 0            # and those the target's samples confirmed

    @property
    def embedding(self) -> list[float] | None:
        """The prompt's embedding (embedding mode), else None."""
        return self.embeddings[0] if self.embeddings else None

    @property
    def text(self) -> str:
        return self.completions[0].text if self.completions else ""

    @property
    def token_ids(self) -> list[int]:
        return self.completions[0].token_ids if self.completions else []

    @property
    def finish_reason(self) -> str:
        return self.completions[0].finish_reason if self.completions else "error"
