"""pairs: a query and documents (RowOptions.pairs: (query, document) pairs) -> one relevance score each,
in `pair_scores` (a list, in the pairs' order). Two ways, by what the model is:

    labels   a reranker that answers yes or no (Qwen3-Reranker), under --kind classify with two labels:
             each pair's prompt is --template filled with {query} and {document}; its score is
             P(first label) / (P(first) + P(second)) at the prompt's end, as classify's label_probs.
             One request: the pairs' common prefix is the prompt (computed once), each pair's rest
             followed by each label a candidate; a label's logprob is the sum over its own tokens (the
             candidate's last ones, RowNotes.label_tokens), given the pair's whole prompt. The row's
             prompt_tokens are every pair's whole prompt, summed (as vLLM's usage counts a score line),
             not the shared prefix the request holds.
    cosine   an embedding model (--kind embed, or a checkpoint whose sentence-transformers files say
             how it pools): each text embedded (one request, one vector each), a pair's score the
             cosine of its two vectors.
"""
from __future__ import annotations

import math
from dataclasses import replace

from jobrunner.engine import Request, RequestOutput, SamplingParams, common_prefix
from jobrunner.jobs.base import RowError
from jobrunner.jobs.row import NO_NOTES, NO_OPTIONS, RowNotes, RowOptions


class PairScoreJob:
    result_columns = {"pair_scores": "json"}

    def __init__(self, method: str, inner, builder=None, tokenizer=None):
        self.method, self.inner = method, inner         # labels: a ClassifyJob; cosine: an EmbedJob
        self.name = inner.name
        self.builder, self.tokenizer = builder, tokenizer

    def request(self, row_id: str, prompt_ids: list[int], data: dict,
                options: RowOptions = NO_OPTIONS) -> tuple[Request, RowNotes]:
        if self.method == "cosine":
            return self.inner.request(row_id, prompt_ids, data, replace(options, texts=_texts(options.pairs)))
        labels = self.inner.labels(data)
        if len(labels) != 2:
            raise RowError(f"scoring pairs with labels needs two (the relevant one first, e.g. --labels yes,no), "
                           f"not {len(labels)}")
        rendered = [self.builder.pair_prompt(q, d) for q, d in options.pairs]
        ids = [self.tokenizer.encode(text, add_special_tokens=special) for text, special in rendered]
        shared = min(min(common_prefix(ids[0], other) for other in ids), min(map(len, ids)))
        if shared == 0:
            raise RowError("the pairs' prompts share no first token; give --template a fixed start")
        candidates, label_tokens = [], []
        for pair_ids in ids:
            delimiter = self.inner.delimiter_after(pair_ids)
            for label in labels:
                tokens = self.inner.encode(label, delimiter)
                candidates.append(pair_ids[shared:] + tokens)
                label_tokens.append(len(tokens))
        request = Request(row_id, ids[0][:shared], SamplingParams(max_tokens=0), candidates=candidates)
        return request, RowNotes(label_tokens=tuple(label_tokens), pair_prompt_tokens=sum(map(len, ids)))

    def columns(self, out: RequestOutput, data: dict, options: RowOptions = NO_OPTIONS,
                notes: RowNotes = NO_NOTES) -> list[dict]:
        if out.error is not None:
            return [{"output": None, "finish_reason": "error", "completion_tokens": 0}]
        scores = self._cosines(out, options) if self.method == "cosine" else _label_scores(out, notes, options)
        if scores is None:
            return [{"output": None, "finish_reason": "error", "completion_tokens": 0,
                     "error": "the engine returned no scores for the pairs"}]
        row = {"output": None, "finish_reason": "stop", "completion_tokens": 0, "pair_scores": scores}
        if notes.pair_prompt_tokens:        # labels: the request's prompt is the pairs' shared prefix only
            row["prompt_tokens"] = notes.pair_prompt_tokens
        return [row]

    def _cosines(self, out: RequestOutput, options: RowOptions) -> list[float] | None:
        vectors, pairs = out.embeddings, options.pairs
        if not vectors or len(vectors) != len(_texts(pairs)):
            return None
        one_query = _one_query(pairs)
        first_doc = 1 if one_query else len(pairs)
        return [_cosine(vectors[0 if one_query else i], vectors[first_doc + i]) for i in range(len(pairs))]


def _label_scores(out: RequestOutput, notes: RowNotes, options: RowOptions) -> list[float] | None:
    """P(first label) / (P(first) + P(second)) of each pair: the sigmoid of their logprobs' difference."""
    lps, sizes = out.candidate_logprobs, notes.label_tokens
    if not lps or len(lps) != 2 * len(options.pairs) or len(sizes) != len(lps):
        return None
    label = [sum(lp[-n:]) for lp, n in zip(lps, sizes)]      # a label's own tokens: the candidate's last n
    return [_sigmoid(label[2 * i] - label[2 * i + 1]) for i in range(len(options.pairs))]


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


def _one_query(pairs) -> bool:
    return len({q for q, _ in pairs}) == 1


def _texts(pairs) -> tuple[str, ...]:
    """The texts embedded for cosine scoring: the query (one for all, or each pair's), then the documents."""
    queries = [pairs[0][0]] if _one_query(pairs) else [q for q, _ in pairs]
    return (*queries, *(d for _, d in pairs))


def _cosine(a, b) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0
