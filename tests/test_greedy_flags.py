"""The engine's is_greedy flags (RequestOutput.candidate_greedy, prompt_greedy): whether each scored
token is the argmax of the logits that score it, as lm-eval's hf backend defines is_greedy. A
continuation the engine itself generated greedily is greedy at every token; one token changed is not
at that token and after it only by chance."""
from __future__ import annotations

from jobrunner.engine import Request, SamplingParams
from tiny import engine_for, hf_model, prompts


def test_a_greedy_continuation_is_greedy_at_every_token_and_a_changed_one_is_not():
    hf = hf_model("llama")
    engine = engine_for(hf)
    prompt = prompts(3)[2]
    greedy = engine.generate([Request("g", prompt, SamplingParams(max_tokens=6, ignore_eos=True))])[0].token_ids
    changed = list(greedy)
    changed[2] = (changed[2] + 1) % 320
    cands = [greedy, changed, greedy[:1]]
    out = engine.generate([Request("c", prompt, SamplingParams(max_tokens=0), candidates=cands)])[0]
    assert out.candidate_greedy[0] == [True] * 6
    assert out.candidate_greedy[1][:3] == [True, True, False]
    assert out.candidate_greedy[2] == [True]
    assert [len(f) for f in out.candidate_greedy] == [len(lp) for lp in out.candidate_logprobs]

    scored = engine.generate([Request("s", prompt + changed, SamplingParams(max_tokens=0),
                                      score_from=len(prompt))])[0]
    assert scored.prompt_greedy[:3] == [True, True, False]
    assert max(abs(a - b) for a, b in zip(scored.prompt_logprobs, out.candidate_logprobs[1], strict=True)) < 1e-4
