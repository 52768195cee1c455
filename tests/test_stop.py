"""Stop strings on the default model's tokenizer: the windowed check fires at exactly the token
where the whole completion first contains a stop string, and the text is cut before it."""
import pytest

from jobrunner.engine.api.request import SamplingParams
from jobrunner.engine.schedule.sequence import Sequence
from jobrunner.engine.core.stop import StopChecker
from jobrunner.engine.load.tokenizer import Tokenizer

TEXT = ("Let me think. The answer is 42.\n\nNext: café ☕ → 東京 and ÿ bytes; END of the "
        "reply, then more words that follow the end marker 🙂 END")


@pytest.fixture(scope="module")
def tokenizer(default_gguf_path):
    return Tokenizer.from_gguf(str(default_gguf_path))


@pytest.mark.parametrize("stops", [("\n\n",), ("END",), ("東京",), ("☕ →",), ("🙂",), ("nowhere", "42."),
                                   ("reply, then more words that follow",)])
def test_stop_fires_where_the_whole_text_first_contains_it(tokenizer, stops):
    prompt = tokenizer.encode("Question?", add_special_tokens=False)
    completion = tokenizer.encode(TEXT, add_special_tokens=False)
    checker = StopChecker(tokenizer, eos_token_ids=())
    params = SamplingParams(max_tokens=10_000, stop=stops)
    fired = None
    for n in range(1, len(completion) + 1):
        seq = Sequence("r", prompt + completion[:n], len(prompt), params)
        if checker.check(seq, 10**6) == "stop":
            fired = n
            break
    first = next(n for n in range(1, len(completion) + 1)
                 if any(s in tokenizer.decode(completion[:n]) for s in stops))
    assert fired == first
    text, _ = checker.final_text(Sequence("r", prompt + completion[:fired], len(prompt), params))
    full = tokenizer.decode(completion[:fired])
    assert text == full[:min(full.find(s) for s in stops if s in full)]
