"""/v1/responses lines (issue 45) in the shapes of OpenAI's Batch and Responses docs, on a tiny random Qwen2
checkpoint with Qwen2.5's template: every body parses with openai.types.responses.Response, the prompt is the
chat request the line stands for, and what a batch cannot honour is an error line naming the key."""
import json

import jsonschema
import pytest
from openai.types.responses import Response

from jobrunner.openai.responses import input_messages, parse_responses_body
from tests.test_openai_tools import FLIGHT, WEATHER, qwen, run_batch  # noqa: F401 (qwen: the tiny Qwen2 engine)

pytest.importorskip("llguidance")

FLAT_FLIGHT = {"type": "function", **FLIGHT["function"]}          # the Responses API's flat function tool
TICKET = {"type": "object", "properties": {"category": {"type": "string", "enum": ["billing", "bug", "other"]},
                                          "urgent": {"type": "boolean"}},
          "required": ["category", "urgent"], "additionalProperties": False}


def _line(cid, **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/responses", "body": {"model": "gpt-4.1", **body}}


LINES = [
    # OpenAI's Batch guide: a Responses line
    _line("story", input="Tell me a short story.", max_output_tokens=6),
    # instructions, message items with input_text parts, a JSON schema answer (text.format)
    _line("ticket", instructions="Sort the support ticket.", max_output_tokens=40,
          input=[{"role": "user", "content": [{"type": "input_text", "text": "I was charged twice."}]}],
          text={"format": {"type": "json_schema", "name": "ticket", "schema": TICKET, "strict": True}}),
    # function tools, a forced call, and a history of a call and its output
    _line("call", input="Book a flight for two.", tools=[FLAT_FLIGHT], tool_choice="required",
          parallel_tool_calls=False, max_output_tokens=120),
    _line("named", input=[{"role": "developer", "content": "Use the tools."},
                          {"role": "user", "content": "Weather in Oslo, then a flight."},
                          {"type": "function_call", "call_id": "call_a", "name": "get_current_weather",
                           "arguments": "{\"location\": \"Oslo\"}"},
                          {"type": "function_call_output", "call_id": "call_a", "output": "{\"temp\": 3}"}],
          tools=[{"type": "function", **WEATHER["function"]}, FLAT_FLIGHT],
          tool_choice={"type": "function", "name": "book_flight"}, max_output_tokens=120),
    # what a batch line cannot honour
    _line("stateful", input="Go on.", previous_response_id="resp_123"),
    _line("effort", input="Think.", reasoning={"effort": "low"}),       # Qwen2.5's template takes no effort
    _line("image", input=[{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]),
    _line("format", input="x", text={"format": {"type": "xml"}}),
]


def test_responses_lines_give_response_objects(qwen, tmp_path):
    out = run_batch(qwen, tmp_path, LINES, any_model=True)
    bodies = {cid: Response.model_validate(x["response"]["body"]) for cid, x in out.items() if x["response"]}
    assert set(bodies) == {"story", "ticket", "call", "named"}
    for cid, r in bodies.items():
        assert r.object == "response" and r.id.startswith("resp_") and r.model_extra["requested_model"] == "gpt-4.1"
        assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens > 0
    story = bodies["story"]
    assert story.status == "incomplete" and story.incomplete_details.reason == "max_output_tokens"
    assert story.usage.output_tokens == 6 and story.output[0].type == "message"
    ticket = bodies["ticket"]
    assert ticket.status == "completed" and ticket.text.format.type == "json_schema"
    jsonschema.validate(json.loads(ticket.output_text), TICKET)          # the SDK's own joined text
    for cid, name in (("call", "book_flight"), ("named", "book_flight")):
        calls = [o for o in bodies[cid].output if o.type == "function_call"]
        assert [c.name for c in calls] == [name] and calls[0].call_id.startswith("call_")
        jsonschema.validate(json.loads(calls[0].arguments), FLIGHT["function"]["parameters"])
    assert bodies["named"].tool_choice.name == "book_flight" and bodies["call"].parallel_tool_calls is False
    assert bodies["named"].tools[1].name == "book_flight"
    errors = {cid: x["error"] for cid, x in out.items() if x["error"]}
    assert errors["stateful"]["param"] == "previous_response_id"
    assert errors["effort"]["param"] == "reasoning" and "reasoning_effort" in errors["effort"]["message"]
    assert errors["image"]["param"] == "input" and "takes no images" in errors["image"]["message"]   # a text model
    assert errors["format"]["param"] == "text"


def test_the_input_becomes_the_chat_it_stands_for():
    messages, error = input_messages(LINES[3]["body"]["input"], "Be brief.")
    assert error is None and messages == [
        {"role": "system", "content": "Be brief."}, {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "Weather in Oslo, then a flight."},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_a", "type": "function", "function": {
            "name": "get_current_weather", "arguments": "{\"location\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "{\"temp\": 3}"}]
    data, error = parse_responses_body(LINES[1]["body"])
    assert error is None and data["params"]["max_tokens"] == 40
    assert data["params"]["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "ticket", "schema": TICKET, "strict": True}}
    assert parse_responses_body({"input": "x", "reasoning": {"summary": "auto"}})[1].startswith("reasoning")
    assert parse_responses_body({"input": []})[1].startswith("input")


def test_a_reasoning_effort_reaches_a_template_that_takes_it(qwen, tmp_path):
    from jobrunner.jobs import PromptBuilder
    from jobrunner.jobs.spec import JobSpec
    from jobrunner.openai.row_options import row_options
    saved = qwen.tokenizer.chat_template
    try:
        qwen.tokenizer.chat_template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                                        "{% if reasoning_effort is defined %}[effort: {{ reasoning_effort }}]{% endif %}")
        data, _ = parse_responses_body({"input": "Think.", "reasoning": {"effort": "high"}})
        text, _ = PromptBuilder(JobSpec("generate"), qwen.tokenizer).render(data, row_options(data))
        assert text == "Think.[effort: high]"
        out = run_batch(qwen, tmp_path, [_line("e", input="Think.", reasoning={"effort": "low"}, max_output_tokens=2)],
                        any_model=True)
        assert Response.model_validate(out["e"]["response"]["body"]).status == "incomplete"
    finally:
        qwen.tokenizer.chat_template = saved
