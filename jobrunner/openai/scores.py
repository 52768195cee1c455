"""vLLM's score and rerank lines (its run-batch serves them): a query and documents in, one relevance score
each out (jobs/pairs.py computes them: a yes/no reranker's label probability, or embedding cosine).

    /score, /v1/score    in  {"model", "queries" | "text_1" | "data_1": str | [str],
                              "documents" | "items" | "text_2" | "data_2": str | [str]}   (1:1, 1:N or N:N)
                         out {"id": "score-...", "object": "list", "created", "model",
                              "data": [{"index": 0, "object": "score", "score": 0.93}, ...], "usage": {...}}
    /rerank, /v1/rerank, /v2/rerank
                         in  {"model", "query": str, "documents": [str], "top_n": 0}
                         out {"id": "rerank-...", "model", "usage": {...},
                              "results": [{"index": 1, "document": {"text": ...}, "relevance_score": 0.93}, ...]}
                             (best first; top_n > 0 keeps that many)

The shapes of vLLM's ScoreRequest / RerankRequest and their responses. The row's data: `input`
{"queries", "documents"} (one query for all, or one a document), `prompt` the first query, `endpoint`.
"""
from __future__ import annotations

import json

SCORE_ENDPOINTS = ("/score", "/v1/score")
RERANK_ENDPOINTS = ("/rerank", "/v1/rerank", "/v2/rerank")
ENDPOINTS = SCORE_ENDPOINTS + RERANK_ENDPOINTS
TEMPLATE_FIELDS = ("query", "document")         # what a --template may name for these lines (jobs.pairs)
_SIDES = (("queries", "documents"), ("queries", "items"), ("text_1", "text_2"), ("data_1", "data_2"))
# accepted at these values: the scores as vLLM computes them by default
_NEUTRAL = {"truncate_prompt_tokens": (None,), "use_activation": (None, True), "softmax": (None, True),
            "activation": (None, True), "priority": (0,), "mm_processor_kwargs": (None, {})}
_NO_EFFECT = ("model", "user")


def parse_score_body(url: str, body: dict) -> tuple[dict | None, str | None]:
    """(row data, None) or (None, what is wrong) for one score or rerank request body."""
    rerank = url in RERANK_ENDPOINTS
    sides = (("query", "documents"),) if rerank else _SIDES
    given = next(((a, b) for a, b in sides if a in body or b in body), sides[0])
    known = {*given, *_NEUTRAL, *_NO_EFFECT, *(("top_n",) if rerank else ())}
    unknown = sorted(set(body) - known)
    if unknown:
        return None, f"unsupported body keys for {url}: {', '.join(unknown)}"
    for key, values in _NEUTRAL.items():
        if body.get(key, values[0]) not in values:
            return None, f"parameter {key!r} is not supported (it would change the scores); remove it"
    queries, error = _texts(body.get(given[0]), given[0])
    documents, error = (None, error) if error else _texts(body.get(given[1]), given[1])
    if error:
        return None, error
    if rerank and not isinstance(body.get("query"), str):
        return None, "query must be a string"
    if len(queries) != 1 and len(queries) != len(documents):
        return None, (f"{given[0]} and {given[1]} must be 1:1, 1:N or N:N; got {len(queries)} and "
                      f"{len(documents)}")
    params = {}
    if rerank:
        top_n = body.get("top_n", 0)
        if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0:
            return None, f"top_n must be an integer >= 0 (0: every document), not {top_n!r}"
        params["top_n"] = top_n
    return {"input": {"queries": queries, "documents": documents}, "prompt": queries[0], "params": params,
            "model": body.get("model"), "endpoint": url}, None


def _texts(value, key: str) -> tuple[list | None, str | None]:
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        return None, f"{key} must be a string or a non-empty list of strings (multimodal inputs are not supported)"
    if not all(t.strip() for t in texts):
        return None, f"{key} holds an empty string"
    return texts, None


def pairs(data: dict) -> tuple[tuple[str, str], ...]:
    """A line's (query, document) pairs: one query for every document, or one each."""
    inp = data["input"]
    queries, documents = inp["queries"], inp["documents"]
    return tuple(zip(queries * len(documents) if len(queries) == 1 else queries, documents))


def is_pairs_rows(rows: list[dict]) -> bool:
    return rows[0].get("endpoint") in ENDPOINTS


def pairs_body(rows: list[dict], model: str, created: int, digest: str) -> dict:
    """A score line's ScoreResponse, or a rerank line's RerankResponse."""
    r = rows[0]
    scores = _value(r.get("pair_scores"))
    tokens = int(r.get("prompt_tokens") or 0)
    if r.get("endpoint") in SCORE_ENDPOINTS:
        return {"id": f"score-{digest[:24]}", "object": "list", "created": created, "model": model,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}
    documents = _value(r.get("input"))["documents"]
    results = sorted(({"index": i, "document": {"text": documents[i]}, "relevance_score": s}
                      for i, s in enumerate(scores)), key=lambda x: -x["relevance_score"])
    top_n = _value(r.get("params")).get("top_n") or 0
    return {"id": f"rerank-{digest[:24]}", "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": results[:top_n] if top_n else results}


def _value(v):
    """A JSON column's value: as written, or its JSON text as the parts keep it."""
    return json.loads(v) if isinstance(v, str) else v
