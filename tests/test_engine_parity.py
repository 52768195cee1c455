"""Greedy output token-identical to HF transformers (float32, CPU) on tiny random models of each architecture."""
import pytest

from jobrunner.engine.api.request import Request, SamplingParams
from tests.tiny import ARCHS, engine_for, hf_greedy, hf_model, prompts


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return hf_model(request.param)


def _run(engine, batch, n=32):
    p = SamplingParams(max_tokens=n, ignore_eos=True, logprobs=0)
    return engine.generate([Request(str(i), ids, p) for i, ids in enumerate(batch)])


def test_greedy_matches_transformers(model):
    batch = prompts(1)
    outs = _run(engine_for(model), batch)
    for ids, out in zip(batch, outs):
        ref_tokens, ref_lps = hf_greedy(model, ids, 32)
        assert out.token_ids == ref_tokens
        ours = [lp.logprob for lp in out.completions[0].logprobs]
        assert max(abs(a - b) for a, b in zip(ours, ref_lps)) < 1e-4
        assert out.finish_reason == "length" and out.completion_tokens == 32


@pytest.mark.parametrize("overrides", [
    dict(max_num_batched_tokens=7),                       # prefill in many small chunks
    dict(block_size=4),
    dict(block_size=1, max_num_seqs=2),
    dict(kv_cache_memory=2 * 2 * 2 * 16 * 16 * 4 * 12),  # 12 blocks: forces preemption
    dict(enable_prefix_caching=False),
])
def test_output_independent_of_batching(overrides):
    model = hf_model("llama")
    batch = prompts(2, lengths=(9, 30, 3, 21))
    base = [o.token_ids for o in _run(engine_for(model), batch, 24)]
    engine = engine_for(model, **overrides)
    assert [o.token_ids for o in _run(engine, batch, 24)] == base
    one_by_one = [_run(engine_for(model, **overrides), [ids], 24)[0].token_ids for ids in batch]
    assert one_by_one == base


def test_preemption_happens_under_tiny_budget():
    model = hf_model("llama")
    engine = engine_for(model, kv_cache_memory=2 * 2 * 2 * 16 * 16 * 4 * 12)
    batch = prompts(3, lengths=(40, 40, 40))
    outs = _run(engine, batch, 40)
    assert engine.counters().preemptions > 0
    assert all(o.completion_tokens == 40 and o.error is None for o in outs)


def test_prefix_cache_hits_and_same_output():
    model = hf_model("qwen2")
    shared = prompts(4, lengths=(40,))[0]
    batch = [shared + [5, 6, 7], shared + [9], shared + [11, 12]]
    engine = engine_for(model)
    outs = _run(engine, batch, 8)
    assert [o.cached_tokens for o in outs] == [0, 32, 32]   # admitted together: computed once, shared
    assert engine.counters().prompt_tokens_computed == sum(map(len, batch)) - 64
    ref = [hf_greedy(model, ids, 8)[0] for ids in batch]
    assert [o.token_ids for o in outs] == ref


@pytest.mark.parametrize("budget", [5, 24, 256])
def test_shared_prefixes_with_chunked_prefill_and_partial_blocks(budget):
    """Prompts sharing 20-28 tokens (full and partial blocks), prefilled in chunks: the prefix cache,
    its partial-block copies included, must not change a single token. (Budget 24 once copied a
    partial block whose newest tokens were still being written in the same step.)"""
    model = hf_model("llama")
    base = prompts(11, lengths=(28,))[0]
    batch = sorted([base + s for s in prompts(12, lengths=(9, 14, 3, 11))] + [base[:20] + [7, 7]])
    ref = _run(engine_for(model, enable_prefix_caching=False), batch, 10)
    engine = engine_for(model, max_num_batched_tokens=budget, max_num_seqs=2)
    for _ in range(2):                       # the second round runs from a warm cache
        outs = _run(engine, batch, 10)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
        for o, r in zip(outs, ref):
            got, want = [x.logprob for x in o.completions[0].logprobs], [x.logprob for x in r.completions[0].logprobs]
            assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    assert engine.counters().prompt_tokens_cached > 0
