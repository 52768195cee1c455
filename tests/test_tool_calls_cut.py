"""Tool calls cut by max_tokens (issue 58, item 13): every complete call before the cut one stands, even where
the cut call's string holds the closing tag (BFCL's parallel case); a forced reply cut in its first call has
no content (null, finish_reason length), never the tag it had begun; bodies parse with the openai package."""
import json

import pytest
from openai.types.chat import ChatCompletion

from jobrunner.engine import Completion, RequestOutput
from jobrunner.openai.response import response_body
from jobrunner.jobs.generate import GenerateJob
from jobrunner.jobs.row import RowOptions
from jobrunner.jobs.spec import JobSpec
from jobrunner.jobs.tool_parsers import TOOL_PARSERS
from jobrunner.jobs.tools import tool_request
from tests.test_openai_tools import ASK, WEATHER, _line, qwen, run_batch  # noqa: F401 (qwen: the tiny Qwen2 engine)

pytest.importorskip("llguidance")

OSLO = '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Oslo"}}\n</tool_call>'
# a second call cut inside a string that holds the closing tag (and a brace)
CUT_AFTER_TAG = OSLO + '\n<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "a </tool_call> }b'


@pytest.mark.parametrize("name,text,content,calls", [
    ("hermes", CUT_AFTER_TAG, None, [("get_current_weather", {"location": "Oslo"})]),
    ("hermes", "<tool_call>", None, []),                                 # cut right after the first tag
    ("hermes", '<tool_call>\n{"name": "get_current_weather", "argu', None, []),
    ("hermes", 'Checking.\n<tool_call>\n{"name": "f", "arguments": {"q": "x', "Checking.", []),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"q": "</tool_call>"}}\n</tool_call>', None,
     [("f", {"q": "</tool_call>"})]),                                    # a whole call whose string holds the tag
    ("hermes", "Use <tool_call> tags.", "Use <tool_call> tags.", []),      # no call after the tag: content
    ("llama3_json", '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"b": "}}}', None, [("f", {})]),
])
def test_a_cut_call_leaves_the_calls_before_it(name, text, content, calls):
    got_content, got = TOOL_PARSERS[name].parse(text)
    assert got_content == content
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == calls


def _forced_reply(job, text):
    out = RequestOutput("r", [Completion(0, [1, 2, 3], text, "length")], prompt_tokens=3, cached_tokens=0,
                        completion_tokens=3)
    row = job.columns(out, {}, RowOptions(messages=ASK, tools=tool_request([WEATHER], "required")))[0]
    body = response_body([{**row, "messages": ASK, "prompt_tokens": 3}], "tiny", 0, "d" * 32)
    return row, ChatCompletion.model_validate(body).choices[0]


def test_a_forced_reply_cut_by_max_tokens_keeps_its_whole_calls_and_no_content(qwen):
    job = GenerateJob(JobSpec("generate"), qwen.tokenizer)
    row, choice = _forced_reply(job, CUT_AFTER_TAG)
    assert row["output"] is None and [c["name"] for c in row["tool_calls"]] == ["get_current_weather"]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"location": "Oslo"}
    for first_cut in ("<tool_call>", "<tool_", '<tool_call>\n{"name": "get_current_weather", "arguments": {"loc'):
        row, choice = _forced_reply(job, first_cut)
        assert row["output"] is None and row["tool_calls"] is None
        assert choice.finish_reason == "length" and choice.message.content is None and not choice.message.tool_calls


# a function whose one argument is a fixed string holding the closing tag: under tool_choice required the
# grammar writes the whole call; a bias on "\n" makes the model start another one after each
NOTE_TEXT = "a </tool_call> " + "bcd efg " * 3
NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string", "enum": [NOTE_TEXT]}},
    "required": ["text"], "additionalProperties": False}}}


def test_bfcl_parallel_calls_cut_in_the_second_keep_the_first(qwen, tmp_path):
    newline = qwen.tokenizer.encode("\n", add_special_tokens=False)
    call = '<tool_call>\n{"name": "note", "arguments": {"text": "%s"}}\n</tool_call>\n' % NOTE_TEXT
    per_call = len(qwen.tokenizer.encode(call, add_special_tokens=False))
    head = len(qwen.tokenizer.encode(call.split("</tool_call>")[0] + "</tool_call>", add_special_tokens=False))
    # cut in the second call, past the closing tag in its string, well before that call ends
    max_tokens = per_call + (head + per_call) // 2
    line = _line("bfcl", messages=ASK, tools=[NOTE], tool_choice="required", max_tokens=max_tokens,
                 temperature=0, logit_bias={str(newline[0]): 100})
    out = run_batch(qwen, tmp_path, [line])
    choice = ChatCompletion.model_validate(out["bfcl"]["response"]["body"]).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("note", {"text": NOTE_TEXT})]
