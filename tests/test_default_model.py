"""The real default model against transformers (float32, CPU): greedy chat continuations token for
token, and classification label probabilities."""
import math

import pytest
import torch

from jobrunner.engine.api.request import Request, SamplingParams

pytestmark = pytest.mark.default_model

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Count to five."}],
]


@pytest.fixture(scope="module")
def engine(default_gguf_path):
    from jobrunner.engine.config.engine_config import EngineConfig
    from jobrunner.engine.core.engine import Engine
    return Engine(EngineConfig(model=str(default_gguf_path)))


def test_greedy_chat_continuations_match_transformers(engine, hf_default_model, hf_default_tokenizer):
    tok = engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(m, add_generation_prompt=True)) for m in CHATS]
    outs = engine.generate([Request(str(i), p, SamplingParams(max_tokens=24)) for i, p in enumerate(prompts)])
    for messages, ids, out in zip(CHATS, prompts, outs):
        ref_ids = hf_default_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ref_ids = list(ref_ids["input_ids"]) if hasattr(ref_ids, "keys") else list(ref_ids)
        assert ids == ref_ids
        with torch.no_grad():
            ref = hf_default_model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                            pad_token_id=hf_default_tokenizer.eos_token_id)[0, len(ids):].tolist()
        eos = set(engine.rt.eos_token_ids)
        ref = ref[:next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))]
        assert out.token_ids == ref, (out.text, hf_default_tokenizer.decode(ref))


def test_label_probabilities_match_transformers(engine, hf_default_model):
    tok = engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Is 'I loved it' positive or negative? Answer in one word."}],
        add_generation_prompt=True))
    labels = ["positive", "negative", "Positive sentiment"]
    cands = [tok.encode(x) for x in labels]
    out = engine.generate([Request("c", prompt, SamplingParams(max_tokens=0), candidates=cands)])[0]
    ours = [sum(lp) for lp in out.candidate_logprobs]
    ref = []
    for cand in cands:
        with torch.no_grad():
            logits = hf_default_model(torch.tensor([prompt + cand])).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        ref.append(sum(lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(cand)))

    def softmax(xs):
        m = max(xs)
        e = [math.exp(x - m) for x in xs]
        return [v / sum(e) for v in e]
    assert max(abs(a - b) for a, b in zip(softmax(ours), softmax(ref))) < 1e-3
    assert max(abs(a - b) for a, b in zip(ours, ref)) < 1e-2
