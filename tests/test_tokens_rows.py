"""Rows whose prompt is token ids (the tokens kind, jobs/tokens.py: prompt_ids_column): the intake
neither renders nor tokenizes them, the engine gets exactly their context ids, and
EngineSession.run_rows hands Rows to the job without a file and returns the kind's values."""
import json

import pytest

import jobrunner
from jobrunner.api import session as api_session
from jobrunner.dataset import Row

SMALL = dict(device="cpu", kv_cache_memory="16MB", max_tokens=3)


@pytest.fixture
def model(tiny_hf_model_dir):
    return str(tiny_hf_model_dir("llama"))


def row(i: int, **data) -> Row:
    return Row(index=i, id=f"r{i}", data={"id": f"r{i}", **data}, id_value=f"r{i}")


class Spies:
    """What the engine is given (request id -> its prompt ids) and how often prompts are rendered and
    batch-tokenized (every kind's prompt goes through PromptBuilder.render and encode_batch)."""

    def __init__(self, monkeypatch):
        from jobrunner.engine.core.engine import Engine
        from jobrunner.engine.load.tokenizer import Tokenizer
        from jobrunner.jobs.base import PromptBuilder
        self.prompts, self.renders, self.encodes = {}, 0, 0
        add, render, encode = Engine.add_request, PromptBuilder.render, Tokenizer.encode_batch

        def added(engine, request):
            self.prompts[request.id] = list(request.prompt_token_ids)
            return add(engine, request)

        def rendered(builder, *a, **k):
            self.renders += 1
            return render(builder, *a, **k)

        def encoded(tokenizer, *a, **k):
            self.encodes += 1
            return encode(tokenizer, *a, **k)
        monkeypatch.setattr(Engine, "add_request", added)
        monkeypatch.setattr(PromptBuilder, "render", rendered)
        monkeypatch.setattr(Tokenizer, "encode_batch", encoded)


def test_tokens_rows_reach_the_engine_as_their_context_ids_neither_rendered_nor_tokenized(model, monkeypatch):
    spies = Spies(monkeypatch)
    monkeypatch.setattr(api_session, "_write_rows", lambda *a: pytest.fail("run_rows wrote its rows to a file"))
    rows = [row(0, context_ids=[5, 6, 7], continuation_ids=[[8], [9, 10]]),
            row(1, context_ids=[11, 12, 13, 14]),
            row(2, continuation_ids=[[8]]),                     # no context_ids: an error row
            row(3, context_ids=["5"])]                          # not token ids: an error row
    with jobrunner.open_engine(model=model, **SMALL) as llm:
        out = llm.run_rows(rows, kind="tokens", max_error_rate=1.0)
        assert spies.prompts == {"r0": [5, 6, 7], "r1": [11, 12, 13, 14]}
        assert spies.renders == spies.encodes == 0
        control = llm.run_rows([row(4, prompt="Hello")])     # a generate row is rendered and tokenized
        assert spies.renders == 1 and spies.encodes == 1 and isinstance(control[0]["output"], str)
    assert [r["id"] for r in out] == ["r0", "r1", "r2", "r3"]
    scored, generated, missing, bad = out
    assert len(scored["continuation_logprobs"]) == 2 and all(type(x) is float for x in scored["continuation_logprobs"])
    assert len(scored["continuation_greedy"]) == 2 and all(type(x) is bool for x in scored["continuation_greedy"])
    assert isinstance(generated["output"], str) and generated["error"] is None
    assert missing["error"] == "a tokens row needs context_ids: a list of token ids (integers)"
    assert bad["error"] == "context_ids must hold lists of token ids (integers)"


def test_run_rows_gives_the_values_generate_gives_as_a_table(model):
    """The same tokens rows through jobrunner.generate (a memory:// JSONL, typed into a table) and run_rows
    (Rows in, the kind's values out): the same results, JSON cells aside."""
    data = [{"id": "a", "context_ids": [5, 6, 7], "continuation_ids": [[8], [9, 10]]},
            {"id": "b", "context_ids": [3, 4], "continuation_ids": [[4, 5, 6]]},
            {"id": "c", "context_ids": [11, 12, 13]}]
    with jobrunner.open_engine(model=model, **SMALL) as llm:       # a fresh engine each: no prefix cache hits
        values = llm.run_rows([Row(i, r["id"], r, id_value=r["id"]) for i, r in enumerate(data)], kind="tokens")
    # the tokens kind renders no prompt; a dataset's column check still asks for one that exists
    table = jobrunner.generate(data, model=model, kind="tokens", prompt_column="context_ids", **SMALL).to_dicts()
    assert [r["id"] for r in values] == [r["id"] for r in table] == ["a", "b", "c"]
    for got, want in zip(values, table):
        for name in ("continuation_logprobs", "continuation_greedy"):
            assert got.get(name) == (json.loads(want[name]) if want[name] is not None else None), name
        assert got["output"] == want["output"] and got["error"] == want["error"] is None


def test_run_rows_refuses_what_it_cannot_run(model):
    with jobrunner.open_engine(model=model, **SMALL) as llm:
        with pytest.raises(jobrunner.JobConfigError, match="run_rows takes its rows in memory.*no output"):
            llm.run_rows([row(0, context_ids=[1])], kind="tokens", output="out")
        with pytest.raises(jobrunner.JobConfigError, match="data_parallel must be 1"):
            llm.run_rows([row(0, context_ids=[1])], kind="tokens", data_parallel=2)
        assert llm.run_rows([], kind="tokens") == []
