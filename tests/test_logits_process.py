"""Logits processing (engine/sample/logits_process.py): repetition penalty against transformers' own
processor, frequency and presence penalties against OpenAI's formula, logit_bias, min_tokens;
then whole greedy generations, batched and with async scheduling, against a transformers loop
that applies the same processors step by step."""
import pytest
import torch
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor,
                                                    RepetitionPenaltyLogitsProcessor)

from jobrunner.engine.sample.logits_process import LogitsAdjust
from jobrunner.engine.api.request import Request, SamplingParams
from jobrunner.engine.schedule.sequence import PLACEHOLDER, Sequence
from tests.tiny import engine_for, hf_model, prompts

VOCAB = 50


def _seq(prompt, completion, params):
    s = Sequence("r", list(prompt), len(prompt), params)
    for t in completion:
        s.append_token(t)
    return s


def _openai_penalties(x, completion, presence, frequency):
    """OpenAI's formula: mu[j] - c[j] * frequency - (c[j] > 0) * presence."""
    c = torch.bincount(torch.tensor(completion, dtype=torch.long), minlength=x.shape[-1]).float()
    return x - c * frequency - (c > 0).float() * presence


def test_each_processor_matches_its_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, VOCAB, generator=g) * 3
    prompt, completion = [3, 4, 4, 9], [9, 11, 11, 11, 2]
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(presence_penalty=0.7, frequency_penalty=0.4),
        SamplingParams(logit_bias=((5, 10.0), (7, -100.0))),
        SamplingParams(min_tokens=8, stop_token_ids=(13,)),
        SamplingParams(),
    ]
    seqs = [_seq(prompt, completion, p) for p in params]
    out = LogitsAdjust.build(params, seqs, (2,), VOCAB, logits.device).apply(logits)
    ids = torch.tensor([prompt + completion])
    expected = [
        RepetitionPenaltyLogitsProcessor(1.3)(ids, logits[0:1].clone())[0],
        _openai_penalties(logits[1], completion, 0.7, 0.4),
        logits[2] + torch.zeros(VOCAB).index_put_((torch.tensor([5, 7]),), torch.tensor([10.0, -100.0])),
        MinNewTokensLengthLogitsProcessor(len(prompt), 8, [2, 13])(ids, logits[3:4].clone())[0],
        logits[4],
    ]
    torch.testing.assert_close(out, torch.stack(expected), rtol=0, atol=1e-6)
    assert not torch.equal(out, logits)              # a new tensor; the model's logits are left as they were


def test_no_adjustment_without_parameters():
    assert LogitsAdjust.build([SamplingParams()], [_seq([1], [], SamplingParams())], (2,), VOCAB, torch.device("cpu")) is None


def test_placeholder_takes_the_previous_launchs_sample():
    p = SamplingParams(frequency_penalty=1.0)
    s = _seq([1, 2], [7], p)
    s.expect_token()
    assert s.token_ids[-1] == PLACEHOLDER
    previous = (torch.tensor([0, 31]), {s.seq_id: 1})     # the step in flight sampled 31 for this sequence
    x = torch.zeros(1, VOCAB)
    out = LogitsAdjust.build([p], [s], (), VOCAB, x.device, previous).apply(x)
    assert out[0, 7] == -1 and out[0, 31] == -1 and out[0].sum() == -2


def _reference_greedy(hf, prompt, p: SamplingParams, eos: int):
    """transformers' forward, one token at a time, with the processors applied by hand in vLLM's order."""
    ids = list(prompt)
    for _ in range(p.max_tokens):
        with torch.no_grad():
            x = hf(torch.tensor([ids])).logits[0, -1].float()
        for t, b in p.logit_bias:
            x[t] += b
        x = MinNewTokensLengthLogitsProcessor(len(prompt), p.min_tokens, [eos])(torch.tensor([ids]), x[None])[0]
        if p.repetition_penalty != 1.0:
            x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([ids]), x[None])[0]
        x = _openai_penalties(x, ids[len(prompt):], p.presence_penalty, p.frequency_penalty)
        tok = int(x.argmax())
        ids.append(tok)
        if tok == eos and len(ids) - len(prompt) > p.min_tokens:
            break
    return ids[len(prompt):]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_greedy_generation_matches_transformers(async_scheduling):
    hf = hf_model("llama")
    eos = 2
    batch = prompts(3, lengths=(7, 12, 5, 9, 15))
    params = [
        # the bias alone repeats 17 twelve times (the tiny model's logits are ~0.3); the penalty stops it
        SamplingParams(max_tokens=12, repetition_penalty=3.0, logit_bias=((17, 0.5),)),
        SamplingParams(max_tokens=12, presence_penalty=1.5, frequency_penalty=0.8),
        SamplingParams(max_tokens=12, logit_bias=((17, 4.0), (40, -3.0))),
        # eos is made likely, and must wait for 10 tokens
        SamplingParams(max_tokens=12, min_tokens=10, repetition_penalty=0.7, frequency_penalty=-0.5,
                       logit_bias=((2, 8.0),)),
        SamplingParams(max_tokens=12),
    ]
    engine = engine_for(hf, async_scheduling=async_scheduling)
    engine.stop_checker.eos = {eos}
    engine.runner.eos_token_ids = (eos,)
    outs = engine.generate([Request(f"r{i}", pr, p) for i, (pr, p) in enumerate(zip(batch, params))])
    for out, pr, p in zip(outs, batch, params):
        assert out.token_ids == _reference_greedy(hf, pr, p, eos), out.id
    assert outs[0].token_ids.count(17) == 1
    assert len(outs[3].token_ids) == 11 and outs[3].token_ids[-1] == eos and outs[3].finish_reason == "stop"
