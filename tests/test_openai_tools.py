"""Tool calls (issue 45): tools rendered through the chat template's own `tools` (token for token as
transformers renders them), tool_choice required and a named function enforced by a grammar (every
call's arguments validate against its schema), auto parsed from what the model wrote, on tiny random
checkpoints of two families whose templates take tools (Qwen2 with Qwen2.5's template, Llama with Llama
3.1's); the parsers on strings; --tools for a dataset; and the small conformance gaps (strict-mode
refusals, reasoning null, the model that ran under --any-model)."""
import json
import os

import jsonschema
import pytest
from openai.types import BatchError
from openai.types.chat import ChatCompletion

from jobrunner.engine import Completion, RequestOutput
from jobrunner.config.job import JobConfigError, job_config
from jobrunner.pipeline.build import load_engine, open_job
from jobrunner.pipeline.exit_codes import EXIT_OK
from jobrunner.openai.errors import error_object
from jobrunner.openai.request import body_params, text_messages
from jobrunner.openai.row_options import row_options
from jobrunner.jobs import PromptBuilder
from jobrunner.jobs.generate import GenerateJob
from jobrunner.jobs.row import RowOptions
from jobrunner.jobs.spec import JobSpec
from jobrunner.jobs.tool_grammar import tool_call_constraint
from jobrunner.jobs.tool_parsers import TOOL_PARSERS, parser_for_template
from jobrunner.jobs.tools import tool_request
from tests import tool_templates

pytest.importorskip("llguidance")

# vLLM's run-batch tool test (tests/entrypoints/openai/test_run_batch.py: WEATHER_TOOL), the location bounded
# (maxLength) so that a random model's string ends within the test's max_tokens
WEATHER = {"type": "function", "function": {
    "name": "get_current_weather", "description": "Get the current weather in a given location",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}}}
# a pydantic-style schema: $defs and a $ref, integers bounded
FLIGHT = {"type": "function", "function": {"name": "book_flight", "parameters": {
    "$defs": {"Seat": {"type": "string", "enum": ["aisle", "window"]}},
    "type": "object", "properties": {"passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                                     "seat": {"$ref": "#/$defs/Seat"}},
    "required": ["passengers", "seat"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in San Francisco?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, FLIGHT)}


def _line(cid, url="/v1/chat/completions", **body):
    return {"custom_id": cid, "method": "POST", "url": url, "body": {"model": "tiny", **body}}


def run_batch(engine, tmp_path, lines, **kw):
    """(output and error lines by custom_id): each input line in exactly one file, each body a ChatCompletion."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    ds = tmp_path / "batch.jsonl"
    ds.write_text("\n".join(json.dumps(x) for x in lines))
    kw.setdefault("served_model_name", ("tiny",))
    res = open_job(job_config(str(ds), output=str(tmp_path / "out"), output_format="openai-batch", **kw),
                   engine=engine).run()
    assert res.exit_code == EXIT_OK
    ok = [json.loads(x) for x in open(os.path.join(res.output, "results.openai.jsonl"))]
    failed = [json.loads(x) for x in open(os.path.join(res.output, "errors.openai.jsonl"))]
    assert sorted(x["custom_id"] for x in ok + failed) == sorted(x["custom_id"] for x in lines)
    for x in failed:
        assert x["response"] is None and BatchError.model_validate(x["error"]).line is not None
    return {x["custom_id"]: x for x in ok + failed}


def _engine(tiny_hf_model_dir, arch, template):
    engine = load_engine(job_config("unused", model=str(tiny_hf_model_dir(arch, max_position_embeddings=2048)),
                                    kv_cache_memory=16 * 2**20, device="cpu"))
    engine.tokenizer.chat_template = template
    return engine


@pytest.fixture(scope="module")
def qwen(tiny_hf_model_dir):
    return _engine(tiny_hf_model_dir, "qwen2", tool_templates.QWEN25)


@pytest.fixture(scope="module")
def llama(tiny_hf_model_dir):
    return _engine(tiny_hf_model_dir, "llama", tool_templates.LLAMA31)


# --- parsers, on strings ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name,text,content,calls", [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n'
               '{"name": "g", "arguments": {}}\n</tool_call>', "Let me look.", [("f", {"a": 1}), ("g", {})]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "g", "argu',
     None, [("f", {"a": 1})]),                                             # cut in its last call: the first stands
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</', None, [("f", {"a": 1})]),   # its tag cut
    ("hermes", "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    ("hermes", "No tools needed.", "No tools needed.", []),
    ("llama3_json", '{"name": "f", "parameters": {"a": "x"}}', None, [("f", {"a": "x"})]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"b": 2}}', None,
     [("f", {}), ("g", {"b": 2})]),
    ("llama3_json", '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"b": ', None, [("f", {})]),   # cut
    ("llama3_json", '{"name": "f", "parameters": {}} and some text', '{"name": "f", "parameters": {}} and some text', []),
    ("llama3_json", 'The answer is {"a": 1}', 'The answer is {"a": 1}', []),
    ("llama3_json", '{"a": 1}', '{"a": 1}', []),                                # JSON, but no call
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]', None,
     [("f", {"a": 1}), ("g", {})]),
    ("mistral", ' [{"name": "f", "arguments": {"a": 1}}]', None, [("f", {"a": 1})]),   # the special token decoded away
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"name": "g", "argum', None, [("f", {})]),  # cut
    ("mistral", "Sure: [1, 2]", "Sure: [1, 2]", []),
])
def test_parsers_read_each_familys_calls(name, text, content, calls):
    got_content, got = TOOL_PARSERS[name].parse(text)
    assert got_content == content
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == calls


def test_the_parser_is_picked_from_the_chat_template():
    assert parser_for_template(tool_templates.QWEN25) == "hermes"
    assert parser_for_template(tool_templates.LLAMA31) == "llama3_json"
    assert parser_for_template("{{ '[TOOL_CALLS] ' + (tools | tojson) }}") == "mistral"
    assert parser_for_template("{% for m in messages %}{{ m.content }}{% endfor %}") is None


# --- the grammar of a forced choice -------------------------------------------------------------------------

class _SpecialMarker:
    """A tokenizer where [TOOL_CALLS] is one special token (id 5), as in Mistral's."""

    def encode(self, text, add_special_tokens=False):
        return [5] if text == "[TOOL_CALLS]" else list(text.encode())

    def decode(self, ids, skip_special_tokens=True):
        return ""


@pytest.mark.parametrize("name,choice,parallel,text,ok", [
    ("hermes", "required", True, '<tool_call>\n{"name": "book_flight", "arguments": {"passengers": 2, "seat": '
                                 '"aisle"}}\n</tool_call>\n<tool_call>\n{"name": "get_current_weather", '
                                 '"arguments": {"location": "Paris"}}\n</tool_call>', True),
    ("hermes", "required", False, '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Paris"}}'
                                  '\n</tool_call>\n<tool_call>', False),                   # one call only
    ("hermes", "book_flight", True, '<tool_call>\n{"name": "get_current_weather", "arguments": {}}', False),
    ("hermes", "book_flight", True, '<tool_call>\n{"name": "book_flight", "arguments": {"passengers": 12, ', False),
    ("llama3_json", "required", True, '{"name": "get_current_weather", "parameters": {"location": "Rome", "unit": '
                                      '"celsius"}}; {"name": "book_flight", "parameters": {"passengers": 1, '
                                      '"seat": "window"}}', True),
    ("llama3_json", "get_current_weather", True, '{"name": "get_current_weather", "arguments": {', False),
])
def test_a_forced_choice_is_a_grammar_of_the_familys_calls(name, choice, parallel, text, ok):
    import llguidance
    from jobrunner.engine.sample.constraints import _byte_tokenizer, grammar_text
    c = tool_call_constraint(TOOL_PARSERS[name], tool_request([WEATHER, FLIGHT], choice, parallel), "strict", None)
    m = llguidance.LLMatcher(_byte_tokenizer(), grammar_text(c), log_level=0)
    data = list(text.encode())
    assert (m.try_consume_tokens(data) == len(data) and m.is_accepting()) == ok


def test_a_special_marker_is_matched_as_its_token():
    c = tool_call_constraint(TOOL_PARSERS["mistral"], tool_request([WEATHER], "required"), "strict", _SpecialMarker())
    assert c.kind == "grammar" and c.spec.startswith('start: <[5]> " [" call (", " call)* "]"')


@pytest.mark.parametrize("tools,choice,words", [
    ([{"type": "web_search"}], "auto", "only function tools"),
    ([{"type": "function", "function": {"name": "has space"}}], "auto", "needs a name"),
    ([WEATHER, WEATHER], "auto", "unique"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}], "auto", "not a valid JSON schema"),
    ([WEATHER], "book_flight", "names no function"),
    ([], "auto", "non-empty list"),
])
def test_bad_tools_are_refused_saying_why(tools, choice, words):
    with pytest.raises(ValueError, match=words):
        tool_request(tools, choice)


def test_an_openai_body_keeps_its_tools_and_tool_history():
    flat = {"type": "function", "name": "get_current_weather", "parameters": WEATHER["function"]["parameters"]}
    params, error = body_params({"messages": ASK, "tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "get_current_weather"}}, "parallel_tool_calls": False}, chat=True)
    assert error is None and params == {"tools": [WEATHER], "tool_choice": "get_current_weather",
                                        "parallel_tool_calls": False}
    assert body_params({"messages": ASK, "tools": [flat]}, chat=True)[0]["tools"] == [
        {"type": "function", "function": {k: v for k, v in flat.items() if k != "type"}}]
    for body, key in (({"messages": ASK, "tool_choice": "required"}, "tool_choice"),
                      ({"messages": ASK, "tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
                      ({"messages": ASK, "tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls")):
        _, error = body_params(body, chat=True)
        assert error_object(error, 1)["param"] == key
    assert body_params({"prompt": "x", "tools": [WEATHER]}, chat=False)[1].startswith("parameter 'tools'")
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_current_weather", "arguments": "{\"location\": \"SF\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 21}"}]
    assert text_messages(history) == (history, None)
    bad = [history[0], {**history[1], "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]
    assert "not JSON text" in text_messages(bad)[1] and error_object(text_messages(bad)[1], 2)["param"] == "messages"
    assert "'function_call'" in text_messages([{"role": "assistant", "function_call": {"name": "f"}}])[1]


# --- the prompt: the template's own tools, token for token as transformers renders it ----------------------

HISTORY = [{"role": "system", "content": "You answer with tools."}, *ASK,
           {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
               "name": "get_current_weather", "arguments": "{\"location\": \"San Francisco\", \"unit\": \"celsius\"}"}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 21}"},
           {"role": "user", "content": "And a flight for two, by the window?"}]


@pytest.mark.parametrize("arch,template", [("qwen2", "QWEN25"), ("llama", "LLAMA31")])
@pytest.mark.parametrize("messages", [ASK, HISTORY], ids=["ask", "history"])
def test_the_prompt_is_the_templates_own_rendering_of_the_tools(tiny_hf_model_dir, arch, template, messages):
    import transformers
    from jobrunner.engine.load.tokenizer import Tokenizer
    model_dir = tiny_hf_model_dir(arch, max_position_embeddings=2048)
    ours = Tokenizer.from_hf_dir(None, str(model_dir))
    ours.chat_template = getattr(tool_templates, template)
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    line = _line("x", messages=messages, tools=[WEATHER, FLIGHT])["body"]
    data = {"messages": text_messages(messages)[0], "params": body_params(line, chat=True)[0]}
    _, ids = PromptBuilder(JobSpec("generate"), ours).build(data, row_options(data))
    # transformers' templates read a call's arguments as an object (OpenAI sends JSON text), as vLLM passes them
    as_hf = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                                  for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
    ref = hf.apply_chat_template(as_hf, tools=[WEATHER, FLIGHT], chat_template=getattr(tool_templates, template),
                                 add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == list(ref)


def test_tools_need_a_template_that_reads_them(qwen):
    builder = PromptBuilder(JobSpec("generate"), qwen.tokenizer)
    saved = qwen.tokenizer.chat_template
    try:
        qwen.tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
        with pytest.raises(ValueError, match="takes no tools"):
            builder.render({}, RowOptions(messages=ASK, tools=tool_request([WEATHER])))
    finally:
        qwen.tokenizer.chat_template = saved


# --- tiny models: forced calls validate, auto parses what the model wrote -----------------------------------

def _calls(line) -> tuple[ChatCompletion, list]:
    body = ChatCompletion.model_validate(line["response"]["body"])
    return body, body.choices[0].message.tool_calls or []


@pytest.mark.parametrize("family", ["qwen", "llama"])
def test_forced_tool_calls_validate_against_their_schemas(family, request, tmp_path):
    engine = request.getfixturevalue(family)
    named = {"type": "function", "function": {"name": "book_flight"}}
    lines = [
        _line("vllm-required", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=120),
        _line("named", messages=ASK, tools=[WEATHER, FLIGHT], tool_choice=named, max_tokens=120),
        _line("one-call", messages=ASK, tools=[WEATHER, FLIGHT], tool_choice="required", parallel_tool_calls=False,
              max_tokens=120),
        _line("history", messages=HISTORY, tools=[WEATHER, FLIGHT], tool_choice="required", max_tokens=120,
              parallel_tool_calls=False),
        _line("none", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=8),
    ]
    out = run_batch(engine, tmp_path, lines)
    ids = []
    for cid in ("vllm-required", "named", "one-call", "history"):
        body, calls = _calls(out[cid])
        # required with parallel calls: a random model may call again and again until max_tokens (then
        # "length", the calls before the cut one kept); one call: it ends
        done = ("tool_calls", "length") if cid == "vllm-required" else ("tool_calls",)
        assert body.choices[0].finish_reason in done and body.choices[0].message.content is None
        assert calls and all(c.type == "function" and c.id.startswith("call_") for c in calls)
        for c in calls:
            jsonschema.Draft202012Validator(SCHEMAS[c.function.name]).validate(json.loads(c.function.arguments))
        ids += [c.id for c in calls]
        if cid != "vllm-required":
            assert len(calls) == 1
    assert _calls(out["vllm-required"])[1][0].function.name == "get_current_weather"     # as vLLM's test reads it
    assert _calls(out["named"])[1][0].function.name == "book_flight"
    assert len(set(ids)) == len(ids)
    none, calls = _calls(out["none"])
    assert not calls and none.choices[0].finish_reason in ("stop", "length")


def test_auto_parses_what_the_model_wrote(llama, tmp_path):
    """Llama's calls are plain JSON: a response_format of the call's shape makes the model write one, which
    tool_choice auto then reads as a call; a reply that is no call stays content."""
    params = {k: v for k, v in FLIGHT["function"]["parameters"].items() if k != "$defs"}
    call_shape = {"type": "object", "properties": {"name": {"const": "book_flight"}, "parameters": params},
                  "required": ["name", "parameters"], "additionalProperties": False,
                  "$defs": FLIGHT["function"]["parameters"]["$defs"]}
    rf = {"type": "json_schema", "json_schema": {"name": "call", "schema": call_shape}}
    lines = [_line("writes-a-call", messages=ASK, tools=[WEATHER, FLIGHT], response_format=rf, max_tokens=80),
             _line("writes-text", messages=ASK, tools=[WEATHER], max_tokens=12)]
    out = run_batch(llama, tmp_path, lines)
    body, calls = _calls(out["writes-a-call"])
    assert body.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "book_flight"
    jsonschema.Draft202012Validator(SCHEMAS["book_flight"]).validate(json.loads(calls[0].function.arguments))
    text, calls = _calls(out["writes-text"])
    assert not calls and TOOL_PARSERS["llama3_json"].parse(text.choices[0].message.content)[1] == []


def test_auto_columns_read_the_reply_with_the_templates_parser(qwen):
    job = GenerateJob(JobSpec("generate"), qwen.tokenizer)
    reply = ('Checking both.\n<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Oslo"}}\n'
             '</tool_call>\n<tool_call>\n{"name": "book_flight", "arguments": {"passengers": 1, "seat": "aisle"}}\n'
             '</tool_call>')
    out = RequestOutput("r", [Completion(0, [1, 2], reply, "stop")], prompt_tokens=3, cached_tokens=0,
                        completion_tokens=2)
    row = job.columns(out, {}, RowOptions(messages=ASK, tools=tool_request([WEATHER, FLIGHT])))[0]
    assert row["output"] == "Checking both." and row["finish_reason"] == "tool_calls"
    assert [c["name"] for c in row["tool_calls"]] == ["get_current_weather", "book_flight"]
    one = job.columns(out, {}, RowOptions(messages=ASK, tools=tool_request([WEATHER, FLIGHT], parallel=False)))[0]
    assert [c["name"] for c in one["tool_calls"]] == ["get_current_weather"]          # parallel_tool_calls false
    none = job.columns(out, {}, RowOptions(messages=ASK, tools=tool_request([WEATHER], "none")))[0]
    assert none["output"] == reply and "tool_calls" not in none and none["finish_reason"] == "stop"


def test_a_template_of_no_known_format_needs_a_parser(qwen, tmp_path):
    saved = qwen.tokenizer.chat_template
    qwen.tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}{{ tools | tojson }}"
    try:
        out = run_batch(qwen, tmp_path, [_line("a", messages=ASK, tools=[WEATHER], max_tokens=4)], allow_all_failed=True)
    finally:
        qwen.tokenizer.chat_template = saved
    assert "--tool-call-parser" in out["a"]["error"]["message"] and out["a"]["error"]["param"] == "tools"


# --- --tools for a dataset ------------------------------------------------------------------------------

def test_a_datasets_rows_are_offered_the_tools_file(qwen, tmp_path):
    from jobrunner.output import read_results
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([WEATHER, FLIGHT]))
    ds = tmp_path / "rows.jsonl"
    ds.write_text("\n".join(json.dumps({"id": str(i), "prompt": p}) for i, p in
                            enumerate(["Weather in Oslo?", "Book me a seat."])))
    res = open_job(job_config(str(ds), output=str(tmp_path / "out"), tools=str(tools), tool_choice="book_flight",
                              max_tokens=120), engine=qwen).run()
    assert res.exit_code == EXIT_OK
    for row in read_results(str(tmp_path / "out")).to_pylist():
        assert row["error"] is None, row["error"]
        calls = json.loads(row["tool_calls"])
        assert row["finish_reason"] == "tool_calls" and [c["name"] for c in calls] == ["book_flight"]
        jsonschema.Draft202012Validator(SCHEMAS["book_flight"]).validate(json.loads(calls[0]["arguments"]))
    for kw, words in ((dict(tool_choice="auto"), "--tool-choice needs --tools"),
                      (dict(tools="[]", tool_choice="auto"), "non-empty list"),
                      (dict(tools=json.dumps([WEATHER]), tool_choice="nope"), "--tool-choice 'nope' names no function"),
                      (dict(tools=json.dumps([WEATHER]), tool_call_parser="xml"), "--tool-call-parser"),
                      (dict(tools=json.dumps([WEATHER]), kind="classify", labels=("a", "b")), "generate only")):
        with pytest.raises(JobConfigError, match=words):
            job_config(str(ds), **kw).job_spec()
    from jobrunner.config.tool_options import check_job_tools
    for kw, words in ((dict(chat=False), "need --chat"), (dict(tool_choice="required", json=True), "contradicts")):
        with pytest.raises(JobConfigError, match=words):
            cfg = job_config(str(ds), tools=json.dumps([WEATHER]), **kw)
            check_job_tools(cfg.kind, cfg.prompt.chat)


# --- the small gaps ------------------------------------------------------------------------------------

def test_a_strict_mode_refusal_names_the_body_key_and_our_options(qwen, tmp_path):
    one_of = {"type": "object", "properties": {"v": {"oneOf": [{"type": "integer"}, {"type": "integer", "minimum": 5}]}},
              "required": ["v"]}
    never = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}}}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": one_of}}
    out = run_batch(qwen, tmp_path, [
        _line("schema", messages=ASK, response_format=rf, max_tokens=8),
        _line("tool", messages=ASK, tools=[never], tool_choice="required", max_tokens=8),
        _line("validate", messages=ASK, response_format=rf, max_tokens=8, **{"x-jobrunner-schema-mode": "validate"})])
    for cid, param in (("schema", "response_format"), ("tool", "tools")):
        e = out[cid]["error"]
        assert (e["code"], e["param"]) == ("invalid_request", param), e
        assert "--json-schema-mode validate" in e["message"] and "x-jobrunner-schema-mode" in e["message"]
        assert "coerce_one_of" not in e["message"]
    assert out["validate"]["error"] is None


def test_vllms_reasoning_batch_reads_the_reasoning_key(qwen, tmp_path):
    from tests import openai_fixtures as fx
    out = run_batch(qwen, tmp_path, fx.VLLM_INPUT_REASONING_BATCH, reasoning_parser="qwen3", max_tokens=6,
                    served_model_name=(fx.REASONING_MODEL_NAME,))
    for x in out.values():
        message = x["response"]["body"]["choices"][0]["message"]
        assert "reasoning" in message and "reasoning_content" in message      # a random model writes no <think>: null
        assert ChatCompletion.model_validate(x["response"]["body"]).model == fx.REASONING_MODEL_NAME


def test_reasoning_is_null_when_the_parser_is_on_and_found_none(tmp_path):
    from jobrunner.openai.batch import write_openai_batch_output
    from jobrunner.output import ResultWriter
    base = dict(prompt_tokens=3, cached_tokens=0, completion_tokens=4, error=None, finish_reason="stop",
                messages=ASK, params={}, reasoning_tokens=0)
    for parser, out in ((None, "off"), ("qwen3", "on")):
        w = ResultWriter(str(tmp_path / out), {"config": {"model": "m", "reasoning_parser": parser}})
        w.write([{"id": "a", "output": "Answer", "reasoning": None, **base}])
        w.close({"rows": 1})
        write_openai_batch_output(str(tmp_path / out))
    on, off = (json.loads(open(tmp_path / d / "results.openai.jsonl").read())["response"]["body"]["choices"][0]["message"]
               for d in ("on", "off"))
    assert on == {"role": "assistant", "content": "Answer", "reasoning": None, "reasoning_content": None}
    assert off == {"role": "assistant", "content": "Answer"}


def test_under_any_model_the_body_names_the_model_that_ran(qwen, tmp_path):
    lines = [_line("other", messages=ASK, max_tokens=2) | {"body": {"model": "gpt-4o-mini", "messages": ASK,
                                                                      "max_tokens": 2}},
             _line("alias", messages=ASK, max_tokens=2)]
    out = run_batch(qwen, tmp_path, lines, any_model=True)
    other, alias = (out[c]["response"]["body"] for c in ("other", "alias"))
    assert other["model"] == "tiny" and other["requested_model"] == "gpt-4o-mini"      # the first served name
    assert alias["model"] == "tiny" and "requested_model" not in alias
    assert ChatCompletion.model_validate(other).model_extra["requested_model"] == "gpt-4o-mini"
