"""An OpenAI request body (chat or legacy completions) checked and turned into a row's parameters.

Nothing in a body is ignored silently: each key is honoured (turned into our parameter), changes
nothing (accepted), or would change the output in a way we don't support: then the row fails
with an error naming the parameter. Keys we don't know fail the same way.

    data, error = parse_chat_body(body)                # a chat or completions line's row data
    params, error = body_params(body, chat=True)      # params: SamplingParams names (jobrunner.openai.rows)
    messages, error = text_messages(body["messages"])  # text parts joined into one string; image_url parts kept
"""
from __future__ import annotations

import json
from typing import Any

from jobrunner.engine import Constraint
from jobrunner.config.sections import MAX_TOP_LOGPROBS
from jobrunner.openai.tools import TOOL_KEYS, tools_params
from jobrunner.jobs.messages import join_text_parts, tool_call_messages
from jobrunner.jobs.schema_check import SCHEMA_MODES

# Our extension: the line's JSON schema mode (strict | validate), as --json-schema-mode for the job.
SCHEMA_MODE_KEY = "x-jobrunner-schema-mode"

# Taken as they are (our names are OpenAI's, or vLLM's extras).
SAME_NAME = ("temperature", "top_p", "n", "seed", "presence_penalty", "frequency_penalty",
             "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos")
# Renamed or reshaped below.
RESHAPED = ("max_tokens", "max_completion_tokens", "stop", "logprobs", "top_logprobs", "logit_bias",
            "chat_template_kwargs", "response_format", SCHEMA_MODE_KEY, "reasoning_effort", "verbosity")
# Change nothing in a batch run's output (parallel_tool_calls: without tools; with them, jobrunner.openai.tools reads it).
NO_EFFECT = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "safety_identifier",
             "prompt_cache_key", "stream_options", "model")
# Accepted at their value that changes nothing; any other value is unsupported.
NEUTRAL_VALUES = {"stream": (False,), "echo": (False,), "best_of": (1,), "suffix": ("",),
                  "modalities": (["text"],)}
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")   # a template's reasoning_effort
# OpenAI's hint of how long an answer should be: checked and recorded in the row's params, no effect (our
# models have no such control)
VERBOSITIES = ("low", "medium", "high")


def parse_chat_body(body: dict) -> tuple[dict | None, str | None]:
    """(row data {"messages", "params", "model"} and "prompt" for /v1/completions, None), or (None, what is
    wrong) for a chat completions or completions body."""
    messages, prompt = body.get("messages"), body.get("prompt")
    if messages is None and prompt is None:
        return None, "OpenAI batch body without messages (or prompt)"
    if messages is not None and not isinstance(messages, list):
        return None, "OpenAI batch body: messages must be a list"
    chat = messages is not None
    params, error = body_params(body, chat)
    if chat and error is None:
        messages, error = text_messages(messages)
    elif error is None:
        prompt, error = completion_prompt(prompt)
    if error is not None:
        return None, error
    data = {"messages": messages, "params": params, "model": body.get("model")}
    if not chat:
        data["prompt"] = prompt
    return data, None


def body_params(body: dict, chat: bool) -> tuple[dict | None, str | None]:
    """(params, None) or (None, what is wrong) for a body's keys other than messages and prompt. Chat: tools
    (jobrunner.openai.tools) too."""
    params: dict[str, Any] = {}
    if chat and (error := tools_params(body, params)):
        return None, error
    for key, value in body.items():
        if key in ("messages", "prompt") or key in NO_EFFECT or value is None or chat and key in TOOL_KEYS:
            continue
        if key in SAME_NAME:
            params[key] = value
        elif key in RESHAPED:
            error = _reshape(key, value, body, chat, params)
            if error:
                return None, error
        elif key in NEUTRAL_VALUES and value in NEUTRAL_VALUES[key]:
            continue
        elif _empty(value):                 # tools: [], functions: {}, ... ask for nothing
            continue
        else:
            return None, f"parameter {key!r} is not supported (it would change the output); remove it"
    return params, None


def _reshape(key: str, value: Any, body: dict, chat: bool, params: dict) -> str | None:
    if key in ("max_tokens", "max_completion_tokens"):
        params["max_tokens"] = value
    elif key == "stop":
        if not (isinstance(value, str) or isinstance(value, list) and all(isinstance(s, str) for s in value)):
            return "stop must be a string or a list of strings"
        params["stop"] = value
    elif key == "logprobs":
        return _logprobs(value, body.get("top_logprobs"), chat, params)
    elif key == "top_logprobs":
        if not chat or not body.get("logprobs"):
            return "top_logprobs needs logprobs: true (chat completions)"
    elif key == "logit_bias":
        return _logit_bias(value, params)
    elif key == "chat_template_kwargs":
        if not isinstance(value, dict):
            return "chat_template_kwargs must be an object, e.g. {\"enable_thinking\": false}"
        params[key] = value
    elif key == "response_format":
        return _response_format(value, params)
    elif key == SCHEMA_MODE_KEY:
        if value not in SCHEMA_MODES:
            return f"{SCHEMA_MODE_KEY} must be strict or validate, not {value!r}"
        params["schema_mode"] = value
    elif key == "reasoning_effort":
        if value not in REASONING_EFFORTS:
            return f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, not {value!r}"
        params["reasoning_effort"] = value
    elif key == "verbosity":
        if value not in VERBOSITIES:
            return f"parameter 'verbosity' must be one of {', '.join(VERBOSITIES)}, not {value!r}"
        params["verbosity"] = value
    return None


def _logprobs(value: Any, top: Any, chat: bool, params: dict) -> str | None:
    """Chat: logprobs true/false and top_logprobs 0..20; completions: logprobs 0..5, the alternatives' count."""
    k = (top or 0) if chat else value
    if chat and not isinstance(value, bool):
        return "logprobs must be true or false (the alternatives' count is top_logprobs)"
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS:
        return f"{'top_logprobs' if chat else 'logprobs'} must be an integer in [0, {MAX_TOP_LOGPROBS}]"
    if value is not False:
        params["logprobs"] = k
    return None


def _logit_bias(value: Any, params: dict) -> str | None:
    """{"token id": bias} -> [[token id, bias], ...]."""
    if not isinstance(value, dict):
        return "logit_bias must be an object of token id -> bias"
    pairs = []
    for token, bias in value.items():
        try:
            pairs.append([int(token), float(bias)])
        except (TypeError, ValueError):
            return f"logit_bias: {token!r}: {bias!r} is not a token id and a number"
    params["logit_bias"] = pairs
    return None


def _response_format(value: Any, params: dict) -> str | None:
    """Checked as the row's constraint will read it (response_format_constraint); json_object and
    json_schema go on to it, text changes nothing."""
    try:
        if response_format_constraint(value) is not None:
            params["response_format"] = value
    except ValueError as e:
        return str(e)
    return None


def response_format_constraint(rf) -> Constraint | None:
    """OpenAI's `response_format` -> a Constraint (None for "text"); ValueError for what we can't honour."""
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind not in RESPONSE_FORMATS:
        raise ValueError(f"response_format must be an object whose type is one of {', '.join(RESPONSE_FORMATS)}; "
                         f"got {rf!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json")
    spec = rf.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise ValueError("response_format json_schema needs json_schema.schema, a JSON schema object")
    return Constraint("json_schema", json.dumps(schema))     # strict or not, the schema is enforced


def text_messages(messages: list) -> tuple[list | None, str | None]:
    """An OpenAI line's messages: text parts joined (jobs.messages.join_text_parts), a message with image_url
    parts ({"type": "image_url", "image_url": {"url": an http(s) or data: URL, "detail": auto | low | high}})
    kept as parts (its images are read at intake: jobrunner/images; `detail` changes nothing, as in vLLM);
    a tool-calling history (assistant tool_calls, tool results) as jobs.messages.tool_call_messages accepts
    it; function calls, audio and function messages are errors, and so are Hugging Face's image parts."""
    hf = next((p for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
               for p in m["content"] if isinstance(p, dict) and p.get("type") == "image"), None)
    if hf is not None:
        return None, ("message content part of type 'image' is not supported (an OpenAI line gives its images "
                      "as image_url parts)")
    out, error = join_text_parts(messages)
    if error is None:
        error = tool_call_messages(out)[1]
    if error is not None:
        return None, error
    for m in out:
        if isinstance(m, dict):
            unsupported = [k for k in ("function_call", "audio") if not _empty(m.get(k))]
            if unsupported or m.get("role") == "function":
                return None, f"message field {(unsupported or [m.get('role')])[0]!r} is not supported"
    return out, None


def completion_prompt(prompt: Any) -> tuple[str | None, str | None]:
    """A /v1/completions prompt: a string (or a list holding one string)."""
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, None
    return None, "prompt must be a string (lists of prompts and token-id prompts are not supported)"


def _empty(value: Any) -> bool:
    """A value that asks for nothing (tools: [], functions: {}, ...)."""
    return value is None or value is False or (isinstance(value, (list, dict, str)) and not value)
