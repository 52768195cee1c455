"""Sampling, stops, classification and scoring on tiny random models, against transformers where it applies."""

import pytest
import torch

from jobrunner.engine.api.request import Request, SamplingParams
from tests.tiny import engine_for, hf_model, prompts


@pytest.fixture(scope="module")
def model():
    return hf_model("qwen3", seed=3)


@pytest.fixture(scope="module")
def engine(model):
    return engine_for(model)


def hf_logprobs(model, tokens: list[int]) -> list[float]:
    """logprob of tokens[i] given tokens[:i], for i >= 1."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [lp[i - 1, tokens[i]].item() for i in range(1, len(tokens))]


def test_seeded_sampling_ignores_batch_mates(engine):
    p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, min_p=0.01, seed=7, ignore_eos=True)
    batch = prompts(5, lengths=(6, 11, 3))
    alone = engine.generate([Request("x", batch[0], p)])[0].token_ids
    together = engine.generate([Request(str(i), ids, p) for i, ids in enumerate(batch)])[0].token_ids
    assert alone == together
    other_seed = SamplingParams(**{**p.__dict__, "seed": 8})
    assert engine.generate([Request("y", batch[0], other_seed)])[0].token_ids != alone


def test_n_samples_share_prompt_and_differ(engine):
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=1, n=4, ignore_eos=True)
    before = engine.counters().prompt_tokens_computed
    out = engine.generate([Request("n", prompts(6, lengths=(20,))[0], p)])[0]
    assert [c.index for c in out.completions] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.completions}) > 1
    assert engine.counters().prompt_tokens_computed - before == 20      # the prompt ran once for 4 samples
    assert out.completion_tokens == 40


def test_stop_token_ids_and_max_tokens(engine):
    ids = prompts(7, lengths=(9,))[0]
    free = engine.generate([Request("a", ids, SamplingParams(max_tokens=8, ignore_eos=True))])[0]
    stop_at = free.token_ids[3]
    out = engine.generate([Request("b", ids, SamplingParams(max_tokens=8, stop_token_ids=(stop_at,),
                                                            ignore_eos=True))])[0]
    first = free.token_ids.index(stop_at)
    assert out.token_ids == free.token_ids[:first + 1] and out.finish_reason == "stop"
    assert free.finish_reason == "length" and len(free.token_ids) == 8


def test_prompt_logprobs_and_score_match_transformers(engine, model):
    ids = prompts(8, lengths=(25,))[0]
    ref = hf_logprobs(model, ids)
    out = engine.generate([Request("s", ids, SamplingParams(max_tokens=0), score_from=10)])[0]
    assert len(out.prompt_logprobs) == 15
    assert max(abs(a - b) for a, b in zip(out.prompt_logprobs, ref[9:])) < 1e-4
    gen = engine.generate([Request("g", ids, SamplingParams(max_tokens=1, prompt_logprobs=True))])[0]
    assert max(abs(a - b) for a, b in zip(gen.prompt_logprobs, ref)) < 1e-4


def test_candidate_scores_match_transformers_and_prompt_runs_once(model):
    engine = engine_for(model, enable_prefix_caching=False)
    ids = prompts(9, lengths=(13,))[0]
    cands = [[5], [7, 8, 9], [7, 8, 11], [300, 2]]
    out = engine.generate([Request("c", ids, SamplingParams(max_tokens=0), candidates=cands)])[0]
    for cand, lps in zip(cands, out.candidate_logprobs):
        ref = hf_logprobs(model, ids + cand)[len(ids) - 1:]
        assert len(lps) == len(cand)
        assert abs(sum(lps) - sum(ref)) < 1e-3
    assert engine.counters().prompt_tokens_computed == len(ids)
    assert engine.counters().tokens_computed == len(ids) + sum(len(c) - 1 for c in cands)


def test_bad_requests_finish_with_errors_not_exceptions(engine):
    outs = engine.generate([
        Request("empty", [], SamplingParams()),
        Request("oov", [1, 10**6], SamplingParams()),
        Request("long", [1] * 600, SamplingParams()),
        Request("ok", [1, 2, 3], SamplingParams(max_tokens=2)),
    ])
    assert [o.finish_reason for o in outs] == ["error", "error", "error", "length"]
    assert "context" in outs[2].error and outs[3].error is None


def test_int8_kv_cache_doubles_capacity_and_keeps_greedy_output(model):
    base = engine_for(model)
    q = engine_for(model, kv_cache_dtype="int8")
    assert q.rt.num_blocks > 1.9 * base.rt.num_blocks * 64 / (64 + 16)   # head_dim 24 here: scales cost more
    batch = prompts(10, lengths=(7, 30, 15))
    p = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = [o.token_ids for o in base.generate([Request(str(i), ids, p) for i, ids in enumerate(batch)])]
    got = [o.token_ids for o in q.generate([Request(str(i), ids, p) for i, ids in enumerate(batch)])]
    same = sum(a == b for a, b in zip(ref, got))
    assert same >= 2
    with pytest.raises(Exception, match="fp8"):
        engine_for(model, kv_cache_dtype="fp8")
