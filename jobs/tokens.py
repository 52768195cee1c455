"""tokens: rows that carry token ids instead of text, as lm-eval's requests do (its harness decides
where a context ends and a continuation begins, and how a long context is cut), so nothing is
re-tokenized. This is the kind behind the lm-evaluation-harness backend (jobrunner/lm_eval_model.py).

    {"context_ids": [...], "continuation_ids": [[...], ...]}
        -> continuation_logprobs: each continuation's summed logprob after the context;
           continuation_greedy: whether each is the greedy one (every token its position's argmax)
    {"context_ids": [...]}
        -> generated from the context as kind generate does (the job's sampling, stop strings, ...)

One row holds every continuation of one context (a multiple-choice question's endings): the engine
computes the context once and branches each continuation off its KV (engine: Request.candidates).

A kind whose prompt is token ids the row holds names their column in `prompt_ids_column`: the
intake then neither renders nor tokenizes its rows (no prompt text, no prompt column) and passes
that column's value, as the row has it, to `request` as `prompt_ids`; the kind checks it (a bad or
missing value: RowError, an error row). Kinds without the attribute get the ids of their rendered
prompt (jobrunner/pipeline/intake.py).
"""
from __future__ import annotations

from jobrunner.engine import Request, RequestOutput, SamplingParams
from jobrunner.jobs.base import RowError
from jobrunner.jobs.generate import GenerateJob
from jobrunner.jobs.row import NO_NOTES, NO_OPTIONS, RowNotes, RowOptions
from jobrunner.jobs.spec import JobSpec

CONTEXT, CONTINUATIONS = "context_ids", "continuation_ids"


class TokensJob:
    name = "tokens"
    prompt_ids_column = CONTEXT     # the prompt is the row's context ids: nothing rendered or tokenized
    # every column it may write, and its kind (jobrunner.output.values): the output schema declares them all
    result_columns = {"continuation_logprobs": "json", "continuation_greedy": "json", **GenerateJob.result_columns}

    def __init__(self, spec: JobSpec, tokenizer):
        self.generate = GenerateJob(spec, tokenizer)

    def request(self, row_id: str, prompt_ids: list[int], data: dict,
                options: RowOptions = NO_OPTIONS) -> tuple[Request, RowNotes]:
        """prompt_ids: the row's context_ids as the row holds them (unchecked until here)."""
        context = _ids(prompt_ids, CONTEXT)
        if not context:
            raise RowError(f"{CONTEXT} is empty (lm-eval puts a prefix token before an empty context)")
        if data.get(CONTINUATIONS) is None:
            return self.generate.request(row_id, context, data, options)
        continuations = data[CONTINUATIONS]
        if not isinstance(continuations, list) or not continuations:
            raise RowError(f"{CONTINUATIONS} must be a non-empty list of token id lists")
        cands = [_ids(c, CONTINUATIONS) for c in continuations]
        if any(not c for c in cands):
            raise RowError(f"every continuation in {CONTINUATIONS} needs at least one token")
        return Request(row_id, context, SamplingParams(max_tokens=0), candidates=cands), NO_NOTES

    def columns(self, out: RequestOutput, data: dict, options: RowOptions = NO_OPTIONS,
                notes: RowNotes = NO_NOTES) -> list[dict]:
        if data.get(CONTINUATIONS) is None:
            return self.generate.columns(out, data, options, notes)
        if out.error is not None or out.candidate_logprobs is None or out.candidate_greedy is None:
            return [{"output": None, "finish_reason": "error", "completion_tokens": 0,
                     "error": out.error or "the engine returned no continuation log-probabilities"}]
        return [{"output": None, "finish_reason": "stop", "completion_tokens": 0,
                 "continuation_logprobs": [sum(lps) for lps in out.candidate_logprobs],
                 "continuation_greedy": [all(flags) for flags in out.candidate_greedy]}]


def _ids(value, column: str) -> list[int]:
    if value is None:
        raise RowError(f"a tokens row needs {column}: a list of token ids (integers)")
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise RowError(f"{column} must hold lists of token ids (integers)")
    return value
