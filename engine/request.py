"""What goes into the engine and what comes out. Plain data, no torch."""
from __future__ import annotations

from dataclasses import dataclass, field


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


CONSTRAINT_KINDS = ("json_schema", "json", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Constraint:
    """What a generated text must match (engine/constraints.py compiles it). `spec` by kind:
    json_schema: the schema as JSON text; json: unused (any JSON object); regex: the pattern;
    choice: a JSON list of the allowed strings; grammar: Lark or GBNF-style EBNF text."""
    kind: str
    spec: str = ""

    def __post_init__(self):
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}")


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
    constraint: Constraint | None = None    # generated text must match it (structured output)

    @property
    def tokens_needed(self) -> int:
        """Positions the request occupies at most: the prompt and its longest candidate."""
        return len(self.prompt_token_ids) + max((len(c) for c in self.candidates or [[]]), default=0)

    def context_error(self, context: int) -> str | None:
        """Why the request does not fit a model's context of `context` positions, or None."""
        if self.tokens_needed > context:
            return f"prompt of {self.tokens_needed} tokens exceeds the model's context of {context} tokens"
        return None


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

    @property
    def text(self) -> str:
        return self.completions[0].text if self.completions else ""

    @property
    def token_ids(self) -> list[int]:
        return self.completions[0].token_ids if self.completions else []

    @property
    def finish_reason(self) -> str:
        return self.completions[0].finish_reason if self.completions else "error"
