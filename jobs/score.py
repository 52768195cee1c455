"""score: the log-likelihood of a given completion after the prompt (held-out text evaluation)."""
from __future__ import annotations

import math

from jobrunner.engine import Request, RequestOutput, SamplingParams
from jobrunner.jobs.base import RowError
from jobrunner.jobs.row import NO_NOTES, NO_OPTIONS, RowNotes, RowOptions
from jobrunner.jobs.spec import JobSpec


class ScoreJob:
    name = "score"
    # every column it may write, and its kind (jobrunner.output.values): the output schema declares them all
    result_columns = {"scored_tokens": "int", "logprob": "float", "mean_logprob": "float", "perplexity": "float"}

    def __init__(self, spec: JobSpec, tokenizer):
        self.column = spec.score.score_column
        self.tokenizer = tokenizer

    def request(self, row_id: str, prompt_ids: list[int], data: dict,
                options: RowOptions = NO_OPTIONS) -> tuple[Request, RowNotes]:
        text = data.get(self.column)
        if not isinstance(text, str) or not text:
            raise RowError(f"score column {self.column!r} is missing, empty or not a string")
        completion = self.tokenizer.encode(text, add_special_tokens=False)
        if not completion:
            raise RowError("the scored text encodes to no tokens")
        return Request(row_id, prompt_ids + completion, SamplingParams(max_tokens=0), score_from=len(prompt_ids)), NO_NOTES

    def columns(self, out: RequestOutput, data: dict, options: RowOptions = NO_OPTIONS,
                notes: RowNotes = NO_NOTES) -> list[dict]:
        if out.error is not None or not out.prompt_logprobs:
            return [{"output": None, "finish_reason": "error", "completion_tokens": 0,
                     "error": out.error or "the engine returned no log-probabilities to score"}]
        lps = out.prompt_logprobs
        total = sum(lps)
        return [{"output": None, "finish_reason": "stop", "completion_tokens": 0, "scored_tokens": len(lps),
                 "logprob": total, "mean_logprob": total / len(lps), "perplexity": math.exp(-total / len(lps))}]
