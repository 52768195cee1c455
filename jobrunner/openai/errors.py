"""The `error` object of an OpenAI batch error line ({code, message, param, line}, openai.types.BatchError)
from a row's error text.

    error_object("line 4: parameter 'tools' is not supported ...", None)
      -> {"code": "invalid_request", "message": "parameter 'tools' ...", "param": "tools", "line": 4}

A row's error is one string (the Parquet `error` column); the body key it is about is found in the
phrasings jobrunner.openai.request, embeddings, responses, scores, tools, batch and routed use, and
jobs' for tools and strict-mode refusals (tests/test_openai_tools.py holds them to it); a /v1/responses
line's error names the Responses key (text, reasoning, max_output_tokens, input). line: the row's `line`
column (openai_batch.parse_record's line number), else the "line N:" the reader put before a line it could
not parse.
"""
from __future__ import annotations

import re

from jobrunner.output.values import is_int

_WHERE = re.compile(r"^(?:\S+ )?line (\d+): ")
# (pattern, param): the first that matches names the key; group 1, where there is one, is the key
_PARAMS = (
    (re.compile(r"^parameter '(\w+)'"), None),
    (re.compile(r"^unsupported body keys for \S+: ([\w-]+)"), None),
    (re.compile(r"^model '"), "model"),
    (re.compile(r"^(?:unsupported endpoint|url: )"), "url"),
    (re.compile(r"^(?:message |messages |every message|OpenAI batch body without messages)"), "messages"),
    (re.compile(r"^image(?: \d+ of \d+)?: "), "messages"),      # a message's image (jobrunner.images), as its url
    (re.compile(r"^OpenAI batch record without a body"), "body"),
    (re.compile(r"^an OpenAI chat or completions line in an embed job"), "url"),
    (re.compile(r"^reasoning effort: "), "reasoning_effort"),
    (re.compile(r"^(stop|logprobs|top_logprobs|logit_bias|chat_template_kwargs|input|dimensions|encoding_format"
                r"|prompt|tool_choice|parallel_tool_calls|instructions|reasoning_effort|text|reasoning|top_n"
                r"|queries|documents|items|query|text_1|text_2|data_1|data_2)"
                r"(?: must| needs| holds|:|\.| '| item| content| message| and )"),
     None),
    (re.compile(r"^(?:tools\b|tool parameters refused|tool_choice required)"), "tools"),
    (re.compile(r"^(response_format)\b|^JSON schema refused in strict mode"), "response_format"),
    (re.compile(r"^bad (dimensions)"), None),
)
# a /v1/responses line's names for the chat request's keys (jobrunner.openai.responses maps them so)
_RESPONSES_KEYS = {"response_format": "text", "reasoning_effort": "reasoning", "max_tokens": "max_output_tokens",
                   "messages": "input"}
# what a strict-mode refusal adds for one line: the body key that picks the line's own mode
_STRICT_HINT = ' (for one line: the body key "x-jobrunner-schema-mode": "validate")'


def error_param(message: str, endpoint: str | None = None) -> str | None:
    """The body key (or url) an error is about; None when it is about no one key (an engine error)."""
    text = _WHERE.sub("", message, count=1)
    for pattern, param in _PARAMS:
        m = pattern.match(text)
        if m:
            param = param or m.group(1)
            return _RESPONSES_KEYS.get(param, param) if endpoint == "/v1/responses" else param
    return None


def error_object(message: str, line, endpoint: str | None = None) -> dict:
    """The error line's `error`: code model_not_found for a body.model that is not the job's model
    (as vLLM answers), invalid_request for a body we cannot run, else row_error (the engine's)."""
    found = _WHERE.match(message)
    if not is_int(line) and found:
        line = int(found.group(1))
    text = _WHERE.sub("", message, count=1)
    if " refused in strict mode: " in text:
        text += _STRICT_HINT
    param = error_param(message, endpoint)
    code = "model_not_found" if param == "model" else "invalid_request" if param else "row_error"
    return {"code": code, "message": text, "param": param, "line": int(line) if is_int(line) else None}
