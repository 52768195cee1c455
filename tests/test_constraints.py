"""Structured output on tiny random models: every row that stops matches its constraint, the step's
bitmask equals the library's matcher token by token, and a grammar's EOS rule holds through
preemption, n = 3 and async scheduling."""
from __future__ import annotations

import json
import re
import types

import jsonschema
import pytest
import torch

pytest.importorskip("llguidance")

from conftest import make_tiny_tokenizer  # noqa: E402

from jobrunner.engine.config.engine_config import EngineConfig  # noqa: E402
from jobrunner.engine.sample.constraints import ConstraintError, Grammars, check_constraint  # noqa: E402
from jobrunner.engine.core.engine import Engine  # noqa: E402
from jobrunner.engine.api.request import Constraint, Request, SamplingParams  # noqa: E402
from jobrunner.engine.run.runtime import build_runtime  # noqa: E402
from jobrunner.engine.load.tokenizer import Tokenizer  # noqa: E402
from jobrunner.kernels.ops import apply_token_bitmask  # noqa: E402
from tests.tiny import bundle_of, hf_model, prompts  # noqa: E402

EOS = 2         # the tiny tokenizer's <|im_end|>
SCHEMA = {"type": "object", "properties": {
    "label": {"enum": ["positive", "negative"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["label", "score", "tags"], "additionalProperties": False}
BRACED = r"\{[a-z]{0,6}\}"
TWELVE_BLOCKS = 2 * 2 * 2 * 16 * 16 * 4 * 12


@pytest.fixture(scope="module")
def model():
    return hf_model("llama")


def tiny_tokenizer() -> Tokenizer:
    return Tokenizer(make_tiny_tokenizer(), eos_token_ids=(EOS,))


def engine_with_tokenizer(hf, **overrides) -> Engine:
    cfg = EngineConfig(**({"model": "tiny", "kv_cache_memory": 4 * 2**20, "max_num_batched_tokens": 256} | overrides))
    bundle = types.SimpleNamespace(**(vars(bundle_of(hf)) | {"tokenizer": tiny_tokenizer()}))
    return Engine(cfg, build_runtime(cfg, bundle))


def run(engine, constraint: Constraint, count=8, n=1, max_tokens=48, temperature=1.0):
    reqs = [Request(str(i), ids, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i, n=n),
                    constraint=constraint)
            for i, ids in enumerate(prompts(5, lengths=(5, 17, 33, 2, 48, 16, 9, 12)[:count]))]
    return engine.generate(reqs)


def stopped_texts(outs) -> list[str]:
    assert all(o.error is None for o in outs), [o.error for o in outs]
    texts = [c.text for o in outs for c in o.completions if c.finish_reason == "stop"]
    assert texts, "no row stopped: nothing checked"
    assert all(c.constrained for o in outs for c in o.completions)
    return texts


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_json_schema_rows_validate(model, async_scheduling):
    engine = engine_with_tokenizer(model, async_scheduling=async_scheduling)
    for text in stopped_texts(run(engine, Constraint("json_schema", json.dumps(SCHEMA)), max_tokens=64)):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_any_json_object(model):
    outs = run(engine_with_tokenizer(model), Constraint("json"), max_tokens=64)
    for text in stopped_texts(outs):
        assert isinstance(json.loads(text), dict)


def test_regex_matches_fully(model):
    pattern = r"(yes|no) [0-9]{1,3}"
    for text in stopped_texts(run(engine_with_tokenizer(model), Constraint("regex", pattern))):
        assert re.fullmatch(pattern, text), text


def test_choice_greedy_and_sampled(model):
    choices = ["positive", "negative", "neutral"]
    engine = engine_with_tokenizer(model)
    for temperature in (0.0, 1.0):
        texts = stopped_texts(run(engine, Constraint("choice", json.dumps(choices)), temperature=temperature))
        assert set(texts) <= set(choices) and len(texts) == 8


@pytest.mark.parametrize("grammar", [
    'start: "{" /[a-z]{0,6}/ "}"',                       # Lark
    'root ::= "{" [a-z]? [a-z]? [a-z]? [a-z]? [a-z]? [a-z]? "}"',   # GBNF-style EBNF
])
def test_grammar_eos_only_after_brace_through_preemption_n3_async(model, grammar):
    """EOS is forbidden until the closing brace; forks copy the parent's matcher; a preempted
    sequence keeps its matcher (its tokens stay); the mask of step k+1 waits for step k."""
    engine = engine_with_tokenizer(model, kv_cache_memory=TWELVE_BLOCKS, max_num_batched_tokens=16,
                                   async_scheduling=True)
    outs = run(engine, Constraint("grammar", grammar), count=6, n=3, max_tokens=24)
    assert engine.counters().preemptions > 0
    assert all(len(o.completions) == 3 for o in outs)
    for text in stopped_texts(outs):
        assert re.fullmatch(BRACED, text), text
    for o in outs:
        for c in o.completions:
            ids = c.token_ids
            assert EOS not in ids[:-1]
            if c.finish_reason == "length":
                assert not re.fullmatch(BRACED, c.text)


def test_same_outputs_with_and_without_async(model):
    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    a = run(engine_with_tokenizer(model, async_scheduling=True), constraint, max_tokens=40)
    b = run(engine_with_tokenizer(model, async_scheduling=False), constraint, max_tokens=40)
    assert [[c.token_ids for c in o.completions] for o in a] == [[c.token_ids for c in o.completions] for o in b]


def test_length_cut_is_marked(model):
    outs = run(engine_with_tokenizer(model), Constraint("json_schema", json.dumps(SCHEMA)), max_tokens=3)
    assert all(c.finish_reason == "length" and c.constrained for o in outs for c in o.completions)


def test_mixed_batch_leaves_unconstrained_rows_alone(model):
    engine = engine_with_tokenizer(model)
    ids = prompts(7, lengths=(11,))[0]
    free = engine.generate([Request("f", ids, SamplingParams(max_tokens=12, ignore_eos=True))])[0].token_ids
    outs = engine.generate([Request("f2", ids, SamplingParams(max_tokens=12, ignore_eos=True)),
                            Request("c", ids, SamplingParams(max_tokens=12),
                                    constraint=Constraint("regex", "[a-z]+"))])
    assert outs[0].token_ids == free


def test_bad_constraints_become_row_errors(model):
    engine = engine_with_tokenizer(model)
    ids = prompts(1, lengths=(6,))[0]
    bad = [Constraint("json_schema", "{not json"), Constraint("json_schema", '{"type": "objectx"}'),
           Constraint("regex", "a(b"), Constraint("grammar", "start: nowhere"), Constraint("choice", "[]")]
    reqs = [Request(f"bad{i}", ids, SamplingParams(max_tokens=4), constraint=c) for i, c in enumerate(bad)]
    reqs.append(Request("good", ids, SamplingParams(max_tokens=4), constraint=Constraint("regex", "[a-z]+")))
    outs = engine.generate(reqs)
    assert all(o.error and o.finish_reason == "error" for o in outs[:-1]), [o.error for o in outs]
    assert outs[-1].error is None and outs[-1].completion_tokens > 0
    assert all(check_constraint(c) for c in bad)


def test_compile_timeout_is_an_error():
    grammars = Grammars(tiny_tokenizer(), (EOS,), 384, timeout_s=0.0)
    with pytest.raises(ConstraintError, match="grammar-timeout"):
        grammars.compile(Constraint("regex", "[a-z]{1,9}"))


def test_compiled_once_per_distinct_constraint():
    grammars = Grammars(tiny_tokenizer(), (EOS,), 384)
    c = Constraint("json_schema", json.dumps(SCHEMA))
    assert grammars.compile(c) is grammars.compile(Constraint("json_schema", json.dumps(SCHEMA)))
    assert grammars.compile(c) is not grammars.compile(Constraint("json"))


@pytest.mark.parametrize("constraint", [Constraint("json_schema", json.dumps(SCHEMA)),
                                        Constraint("grammar", 'start: "{" /[a-z]{0,6}/ "}"')])
def test_mask_equals_brute_force_matcher(constraint):
    """Along a valid text, each step's bitmask (batch call, then the mask kernel) allows exactly the
    tokens the library's matcher accepts one by one, EOS exactly where it accepts, and nothing past
    the tokenizer's vocabulary (the model's 384 rows against the tokenizer's 320). Where the grammar
    forces the next bytes (the rest of an enum value), llguidance keeps only the tokens of their
    canonical tokenization: there the mask is a non-empty subset, each token a piece of those bytes."""
    tok = tiny_tokenizer()
    grammars = Grammars(tok, (EOS,), 384)
    matcher = grammars.compile(constraint).deep_copy()
    text = '{"label": "negative", "score": 3, "tags": ["a"]}' if constraint.kind == "json_schema" else "{fox}"
    for token in tok.encode(text) + [None]:
        mask = grammars.fill([matcher, None])
        logits = apply_token_bitmask(torch.zeros(2, 384), mask)
        allowed = set((logits[0] > float("-inf")).nonzero()[:, 0].tolist())
        brute = {t for t in range(320) if t != EOS and matcher.validate_tokens([t]) == 1}
        if matcher.is_accepting():
            brute.add(EOS)
        forced = matcher.compute_ff_bytes()
        if forced:
            assert allowed and allowed <= brute
            assert all(forced.startswith(tok.decode([t]).encode()) for t in allowed)
        else:
            assert allowed == brute and brute
        assert bool((logits[1] == 0).all())
        if token is not None:
            assert matcher.consume_token(token)
    assert matcher.is_accepting()


def test_a_reasoning_models_constraint_applies_to_the_answer_only(model):
    """The reasoning is free and its closing marker ends it: here the marker is a digit the answer's
    regex forbids, pushed by logit_bias. It is sampled first (unconstrained while reasoning), then
    the answer is letters only (the mask beats the bias)."""
    engine = engine_with_tokenizer(model)
    tok = engine.tokenizer
    (close,) = tok.encode("7")
    params = SamplingParams(max_tokens=10, logit_bias=((close, 100.0),), reasoning_markers=((EOS + 1000,), (close,)))
    outs = engine.generate([Request(str(i), ids, params, constraint=Constraint("regex", "[a-z]+"))
                            for i, ids in enumerate(prompts(9, lengths=(5, 12, 20)))])
    for out in outs:
        (c,) = out.completions
        assert c.token_ids[0] == close and c.reasoning_tokens == 1
        answer = tok.decode(c.token_ids[1:])
        assert re.fullmatch("[a-z]+", answer) if c.finish_reason == "stop" else re.fullmatch("[a-z]*", answer), answer


@pytest.mark.parametrize("constraint", [Constraint("json_schema", json.dumps(SCHEMA)), Constraint("regex", BRACED)])
def test_speculative_rows_draft_within_the_grammar_and_match_the_plain_engine(model, constraint):
    """Drafts cut where the grammar refuses, each drafted position sampled under the mask after the drafts
    before it: the same tokens as the plain engine, sampled or greedy, every stopped row valid."""
    for temperature in (1.0, 0.0):
        plain = run(engine_with_tokenizer(model), constraint, max_tokens=64, temperature=temperature)
        engine = engine_with_tokenizer(model, speculative="ngram")
        spec = run(engine, constraint, max_tokens=64, temperature=temperature)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
        if constraint.kind == "json_schema":      # its keys repeat: drafts (the regex's rows stop within a few tokens)
            assert engine.counters().accepted_tokens > 0
            for text in stopped_texts(spec):
                jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert all(re.fullmatch(BRACED, t) for t in stopped_texts(spec))
