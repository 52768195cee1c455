"""A constraint on a reasoning model's answer (issue 58, item 14): under --reasoning-parser, a model that writes no
reasoning still answers under its response format (/v1/responses text.format, chat response_format); one that
opens a reasoning block answers under it after the block. The grammar: an optional reasoning block, then the
answer."""
import json

import jsonschema
import llguidance
import pytest
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from jobrunner.engine import Constraint
from jobrunner.engine.sample.constraints import _byte_tokenizer, grammar_text
from jobrunner.jobs.reasoning import answer_constraint
from tests.test_openai_responses import TICKET
from tests.test_openai_tools import ASK, _line, qwen, run_batch  # noqa: F401 (qwen: the tiny Qwen2 engine)

THINK = ("<think>", "</think>")
POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}


def _accepts(c: Constraint, text: str) -> bool:
    m = llguidance.LLMatcher(_byte_tokenizer(), grammar_text(c), log_level=0)
    data = list(text.encode())
    return m.try_consume_tokens(data) == len(data) and m.is_accepting()


@pytest.mark.parametrize("kind,spec,answer", [
    ("json_schema", json.dumps(POINT), '{"x": 1}'),
    ("regex", "[0-9]+", "42"),
    ("choice", json.dumps(["yes", "no"]), "no"),
    ("grammar", 'start: "a" "b"+', "abb"),
])
def test_the_answer_may_follow_a_reasoning_block(kind, spec, answer):
    c = Constraint(kind, spec, reasoning=THINK)
    assert _accepts(c, answer)                                          # no reasoning: the answer at once
    assert _accepts(c, "<think>\nplan {not it} </thin\n</think>\n\n" + answer)
    assert not _accepts(c, "free text")                                 # no answer outside the format
    assert not _accepts(c, "<think>plan</think>\n\nfree text")
    assert not _accepts(c, "<think>a</think>b</think>" + answer)        # the block ends at its first closing tag
    assert not _accepts(Constraint(kind, spec), "<think>plan</think>" + answer)   # without: no block allowed


def test_only_a_prompt_with_no_marker_leaves_the_reasoning_to_the_model():
    markers, c = ((100,), (101,)), Constraint("json")
    assert answer_constraint(c, "qwen3", [5, 6], markers).reasoning == THINK      # the model opens it, or not
    assert answer_constraint(c, "qwen3", [5, 100], markers) == c                  # R1: opened by the template
    assert answer_constraint(c, "qwen3", [5, 100, 7, 101], markers) == c          # closed: enable_thinking off
    assert answer_constraint(c, None, [5, 6], markers) == c and answer_constraint(None, "qwen3", [5], markers) is None


def test_a_model_that_writes_no_reasoning_answers_in_the_format(qwen, tmp_path):
    # the random model, given the choice, opens <think>: a bias against "<" (its only token starting with
    # one) makes it a model that writes no reasoning
    no_think = {str(qwen.tokenizer.encode("<", add_special_tokens=False)[0]): -100}
    rf = {"type": "json_schema", "json_schema": {"name": "ticket", "schema": TICKET, "strict": True}}
    lines = [
        {"custom_id": "responses", "method": "POST", "url": "/v1/responses", "body": {
            "model": "tiny", "input": "I was charged twice.", "max_output_tokens": 40, "logit_bias": no_think,
            "text": {"format": {"type": "json_schema", "name": "ticket", "schema": TICKET, "strict": True}}}},
        _line("chat", messages=ASK, response_format=rf, max_tokens=40, logit_bias=no_think),
        _line("samples", messages=ASK, response_format=rf, max_tokens=40, logit_bias=no_think, n=2,
              temperature=1.0, seed=3),                              # forked samples keep the whole grammar
    ]
    out = run_batch(qwen, tmp_path, lines, reasoning_parser="qwen3")
    r = Response.model_validate(out["responses"]["response"]["body"])
    assert r.status == "completed" and [o.type for o in r.output] == ["message"]      # no reasoning written
    jsonschema.validate(json.loads(r.output_text), TICKET)
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    bodies = {cid: ChatCompletion.model_validate(out[cid]["response"]["body"]) for cid in ("chat", "samples")}
    assert len(bodies["samples"].choices) == 2
    for body in bodies.values():
        for choice in body.choices:
            assert choice.finish_reason == "stop" and choice.message.reasoning_content is None
            jsonschema.validate(json.loads(choice.message.content), TICKET)
