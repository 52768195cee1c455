"""vLLM's /score and /rerank lines (issue 45), in its run-batch tests' shapes: a yes/no reranker's score under
--kind classify is the label probability classify gives the same prompt, an embedding model's is the cosine of
the vectors --kind embed writes, a model that is neither is an error line saying why; the bodies have the
shapes of vLLM's ScoreResponse and RerankResponse (mirrored here)."""
import json
import math
import shutil

import pytest
from pydantic import BaseModel

from jobrunner.config.job import job_config
from jobrunner.pipeline.build import load_engine, open_job
from jobrunner.openai.scores import pairs, parse_score_body
from jobrunner.output import read_results
from tests import openai_fixtures as fx
from tests.test_embed import write_st_files
from tests.test_openai_batch import engine, model_dir  # noqa: F401 (fixtures: one tiny llama engine a module)
from tests.test_openai_tools import run_batch

RERANK = "Query: {query}\nDocument: {document}\nRelevant:"       # the reranker's own prompt, as --template


class ScoreData(BaseModel):             # vLLM's vllm/entrypoints/pooling/scoring/protocol.py
    index: int
    object: str
    score: float


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class ScoreResponse(BaseModel):
    id: str
    object: str
    created: int
    model: str
    data: list[ScoreData]
    usage: Usage


class RerankDocument(BaseModel):
    text: str | None = None


class RerankResult(BaseModel):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: Usage
    results: list[RerankResult]


NAMES = dict(served_model_name=(fx.RERANKER_MODEL_NAME,))


def test_a_yes_no_rerankers_scores_are_its_label_probabilities(engine, tmp_path):
    lines = fx.VLLM_INPUT_SCORE_BATCH + fx.VLLM_RERANK_LINES + [
        {"custom_id": "n-to-n", "method": "POST", "url": "/score", "body": {
            "text_1": ["Capital of Brazil?", "Capital of France?"], "text_2": fx._DOCUMENTS}},
        {"custom_id": "top-1", "method": "POST", "url": "/rerank", "body": {
            "query": "What is the capital of France?", "documents": fx._DOCUMENTS, "top_n": 1}},
        {"custom_id": "bad", "method": "POST", "url": "/score", "body": {"queries": ["a", "b"], "documents": ["c"] * 3}}]
    out = run_batch(engine, tmp_path / "pairs", lines, kind="classify", labels=("yes", "no"), template=RERANK, **NAMES)
    assert out["bad"]["error"]["param"] == "queries" and "1:1, 1:N or N:N" in out["bad"]["error"]["message"]
    # the reference: classify over each pair's prompt
    rows = [{"id": f"{q}|{d}", "query": q, "document": d} for q in ("What is the capital of France?",
                                                                   "Capital of Brazil?", "Capital of France?")
            for d in fx._DOCUMENTS]
    ds = tmp_path / "pairs.jsonl"
    ds.write_text("\n".join(json.dumps(r) for r in rows))
    open_job(job_config(str(ds), output=str(tmp_path / "ref"), kind="classify", labels=("yes", "no"), template=RERANK),
             engine=engine).run()
    ref = {r["id"]: r["label_probs"][0]["prob"] for r in read_results(str(tmp_path / "ref")).to_pylist()}
    query = "What is the capital of France?"
    want = [ref[f"{query}|{d}"] for d in fx._DOCUMENTS]
    for cid in ("request-1", "request-2"):          # /score and /v1/score
        body = ScoreResponse.model_validate(out[cid]["response"]["body"])
        assert body.object == "list" and body.model == fx.RERANKER_MODEL_NAME and body.id.startswith("score-")
        assert [d.index for d in body.data] == [0, 1] and [d.score for d in body.data] == pytest.approx(want, abs=1e-4)
        assert body.usage.prompt_tokens > 0
    for line in fx.VLLM_RERANK_LINES:               # /rerank, /v1/rerank, /v2/rerank: best first
        body = RerankResponse.model_validate(out[line["custom_id"]]["response"]["body"])
        assert [r.relevance_score for r in body.results] == pytest.approx(sorted(want, reverse=True), abs=1e-4)
        assert [r.document.text for r in body.results] == [fx._DOCUMENTS[r.index] for r in body.results]
    n_to_n = ScoreResponse.model_validate(out["n-to-n"]["response"]["body"])
    assert [d.score for d in n_to_n.data] == pytest.approx(
        [ref[f"Capital of Brazil?|{fx._DOCUMENTS[0]}"], ref[f"Capital of France?|{fx._DOCUMENTS[1]}"]], abs=1e-4)
    top = RerankResponse.model_validate(out["top-1"]["response"]["body"])
    assert len(top.results) == 1 and top.results[0].relevance_score == pytest.approx(max(want), abs=1e-4)


def test_an_embedding_models_scores_are_cosines(engine, tmp_path):
    lines = [*fx.VLLM_INPUT_SCORE_BATCH[:1], {**fx.VLLM_RERANK_LINES[0], "custom_id": "rerank"},
             {"custom_id": "emb", "method": "POST", "url": "/v1/embeddings",
              "body": {"input": ["What is the capital of France?", *fx._DOCUMENTS]}}]
    out = run_batch(engine, tmp_path, lines, kind="embed", **NAMES)
    vectors = [d["embedding"] for d in out["emb"]["response"]["body"]["data"]]
    cos = [sum(a * b for a, b in zip(vectors[0], v)) / math.sqrt(sum(a * a for a in vectors[0]) * sum(b * b for b in v))
           for v in vectors[1:]]
    score = ScoreResponse.model_validate(out["request-1"]["response"]["body"])
    assert [d.score for d in score.data] == pytest.approx(cos, abs=1e-5)
    rerank = RerankResponse.model_validate(out["rerank"]["response"]["body"])
    best = sorted(range(len(cos)), key=lambda i: -cos[i])
    assert [r.index for r in rerank.results] == best
    assert [r.relevance_score for r in rerank.results] == pytest.approx([cos[i] for i in best], abs=1e-5)


def test_a_model_that_embeds_scores_under_generate_and_one_that_does_not_says_why(engine, tiny_hf_model_dir, tmp_path):
    out = run_batch(engine, tmp_path / "plain", fx.VLLM_INPUT_SCORE_BATCH, allow_all_failed=True, **NAMES)
    for x in out.values():
        assert x["error"]["param"] == "url" and "--kind classify --labels yes,no" in x["error"]["message"]
    root = tmp_path / "tiny-embed"
    shutil.copytree(tiny_hf_model_dir("qwen3"), root)
    write_st_files(root, "mean_tokens", normalize=True)
    st = load_engine(job_config("unused", model=str(root), kv_cache_memory=8 * 2**20, device="cpu"))
    out = run_batch(st, tmp_path / "st", fx.VLLM_INPUT_SCORE_BATCH, **NAMES)
    for x in out.values():
        scores = [d.score for d in ScoreResponse.model_validate(x["response"]["body"]).data]
        assert len(scores) == 2 and all(-1 <= s <= 1 for s in scores)


@pytest.mark.parametrize("url,body,words", [
    ("/score", {"queries": "q"}, "documents must be"),
    ("/score", {"text_1": "q", "text_2": ["d", ""]}, "empty string"),
    ("/score", {"queries": "q", "documents": "d", "truncate_prompt_tokens": 8}, "'truncate_prompt_tokens'"),
    ("/rerank", {"query": ["q"], "documents": ["d"]}, "query must be a string"),
    ("/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
    ("/rerank", {"query": "q", "documents": ["d"], "return_documents": True}, "unsupported body keys"),
])
def test_a_bad_score_body_says_what_is_wrong(url, body, words):
    data, error = parse_score_body(url, body)
    assert data is None and words in error


def test_pairs_pair_one_query_with_every_document_or_each_with_one():
    one, _ = parse_score_body("/score", {"text_1": "q", "text_2": ["a", "b"]})
    each, _ = parse_score_body("/v1/score", {"data_1": ["q1", "q2"], "data_2": ["a", "b"]})
    assert pairs(one) == (("q", "a"), ("q", "b")) and pairs(each) == (("q1", "a"), ("q2", "b"))
