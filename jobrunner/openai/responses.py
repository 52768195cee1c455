"""OpenAI Batch /v1/responses lines: the request body in (as a chat request: jobrunner.openai.request), a
`Response` object out (it parses with openai.types.responses.Response).

    in   {"model": "...", "instructions": "...", "input": "text" | [items], "max_output_tokens": 300,
          "text": {"format": {"type": "json_schema", "name": "x", "schema": {...}}, "verbosity": "low"},
          "reasoning": {"effort": "low"},
          "tools": [{"type": "function", "name": "f", "parameters": {...}}], "tool_choice": "auto", ...}
    out  {"id": "resp_...", "object": "response", "status": "completed" | "incomplete", "output": [
             {"type": "reasoning", ...}, {"type": "message", "content": [{"type": "output_text", ...}]},
             {"type": "function_call", "call_id": "call_...", "name": "f", "arguments": "{...}"}],
          "usage": {"input_tokens", "output_tokens", "total_tokens", ...}, ...}

input items: messages ({role, content}: a string or input_text / output_text / input_image parts (an
image_url of a data: or http(s) URL, as chat image_url parts read it); `developer` is the
system role), function_call items (an assistant message's tool_calls) and function_call_output items
(tool messages); reasoning items of earlier turns are dropped, as chat templates drop earlier reasoning.
`instructions` is a system message before them. Keys a batch cannot honour (previous_response_id,
conversation, background, include, ...) make the line an error naming them.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from jobrunner.openai.request import VERBOSITIES, body_params
from jobrunner.openai.tools import response_function_calls, responses_tools

__all__ = ["ENDPOINT", "input_messages", "is_responses_rows", "parse_responses_body", "response_object"]

ENDPOINT = "/v1/responses"
# taken by this module; the rest go to the chat request's checks (body_params: temperature, top_p, ...)
_OWN = ("input", "instructions", "max_output_tokens", "text", "reasoning", "tools", "tool_choice", "model")
# accepted at these values only (truncation "disabled": a prompt too long fails its line, never cut)
_NEUTRAL = {"truncation": ("disabled",), "background": (False,), "include": ([],), "top_logprobs": (0,)}
_NO_EFFECT = ("prompt_cache_retention",)
_STATEFUL = ("previous_response_id", "conversation", "prompt", "max_tool_calls")
_TEXT_PARTS = ("input_text", "output_text", "text")


def parse_responses_body(body: dict) -> tuple[dict | None, str | None]:
    """(row data, None) or (None, what is wrong) for one /v1/responses request body."""
    for key in (*_STATEFUL, *_NEUTRAL):
        value = body.get(key)
        if value is not None and not (key in _NEUTRAL and value in _NEUTRAL[key]):
            return None, f"parameter {key!r} is not supported (a batch line runs alone, from its own input)"
    messages, error = input_messages(body.get("input"), body.get("instructions"))
    if error is None:
        chat, error = _chat_request(body)
    if error is not None:
        return None, error
    params, error = body_params(chat, chat=True)
    if error is not None:
        return None, error
    if body.get("instructions") is not None:
        params["instructions"] = body["instructions"]       # echoed by the Response
    return {"messages": messages, "params": params, "model": body.get("model"), "endpoint": ENDPOINT}, None


def input_messages(items: Any, instructions: Any) -> tuple[list | None, str | None]:
    """The chat messages of a Responses `input` (and `instructions`)."""
    if instructions is not None and not isinstance(instructions, str):
        return None, "instructions must be a string"
    head = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return head + [{"role": "user", "content": items}], None
    if not isinstance(items, list) or not items:
        return None, "input must be a string or a non-empty list of input items"
    out = list(head)
    for item in items:
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            message, error = _message(item)
            if error is not None:
                return None, error
            out.append(message)
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("content") is None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text, _ = (output, None) if isinstance(output, str) else _chat_content(output)
            if not isinstance(text, str):
                return None, "input: a function_call_output's output must be a string or text parts"
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind != "reasoning":
            return None, f"input item of type {kind!r} is not supported (messages, function_call, function_call_output)"
    if not out:
        return None, "input holds no message"
    return out, None


def _message(item: dict) -> tuple[dict | None, str | None]:
    role, content = item.get("role"), item.get("content")
    if role not in ("user", "assistant", "system", "developer"):
        return None, f"input message role must be user, assistant, system or developer, not {role!r}"
    if isinstance(content, str):
        text = content
    else:
        text, error = _chat_content(content)
        if error is not None:
            return None, error
    return {"role": "system" if role == "developer" else role, "content": text}, None


def _chat_content(parts) -> tuple[str | list | None, str | None]:
    """Input parts as a chat message's content: text parts' texts joined by newlines (as chat content parts
    are); with input_image parts ({image_url: a data: or http(s) URL}), chat parts in their order."""
    if not isinstance(parts, list):
        return None, "input message content must be a string or a list of parts"
    out = []
    for p in parts:
        kind = p.get("type") if isinstance(p, dict) else type(p).__name__
        if kind in _TEXT_PARTS and isinstance(p.get("text"), str):
            out.append({"type": "text", "text": p["text"]})
        elif kind == "input_image" and isinstance(p.get("image_url"), str):
            out.append({"type": "image_url", "image_url": {"url": p["image_url"], "detail": p.get("detail", "auto")}})
        elif kind == "input_image":
            return None, "input_image parts need an image_url (a data: or http(s) URL); file_id is not supported"
        else:
            return None, f"input content part of type {kind!r} is not supported (only text and input_image parts)"
    if all(p["type"] == "text" for p in out):
        return "\n".join(p["text"] for p in out), None
    return out, None


def _chat_request(body: dict) -> tuple[dict | None, str | None]:
    """The body as a chat request's keys (body_params checks those): max_output_tokens as max_tokens,
    text as response_format and verbosity (_text_keys), reasoning.effort as reasoning_effort, flat
    function tools as chat ones."""
    chat = {k: v for k, v in body.items() if k not in _OWN and k not in _NEUTRAL and k not in _NO_EFFECT}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("text") is not None and (error := _text_keys(body["text"], chat)):
        return None, error
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict) or reasoning.get("summary") is not None or set(reasoning) - {
                "effort", "summary", "generate_summary"}:
            return None, "reasoning must be {\"effort\": ...} (reasoning summaries are not supported)"
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
    for key in ("tools", "tool_choice"):
        if body.get(key) is not None:
            chat[key] = body[key]
    return chat, None


def _text_keys(text, chat: dict) -> str | None:
    """`text` into the chat request: format as response_format; verbosity, OpenAI's hint of the answer's
    length, as verbosity (recorded and echoed by the Response, no effect: our models have no such control).
    What is wrong with it, or None."""
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        return "text must be {\"format\": {...}, \"verbosity\": ...}"
    if text.get("verbosity") is not None:
        if text["verbosity"] not in VERBOSITIES:
            return f"text.verbosity must be one of {', '.join(VERBOSITIES)}, not {text['verbosity']!r}"
        chat["verbosity"] = text["verbosity"]
    fmt = text.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            return f"text.format's type must be text, json_object or json_schema; got {fmt!r}"
        if fmt["type"] == "json_schema":
            if not isinstance(fmt.get("schema"), dict):
                return "text.format json_schema needs schema, a JSON schema object"
            fmt = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
        chat["response_format"] = fmt
    return None


def is_responses_rows(rows: list[dict]) -> bool:
    return rows[0].get("endpoint") == ENDPOINT


def response_object(rows: list[dict], model: str, created: int, digest: str) -> dict:
    """The Response of one line's result row (a Responses request has one sample)."""
    r, params = rows[0], _params(rows[0])
    output = []
    if r.get("reasoning") is not None:
        output.append({"type": "reasoning", "id": _id("rs", digest), "summary": [],
                       "content": [{"type": "reasoning_text", "text": r["reasoning"]}]})
    cut = r.get("finish_reason") == "length"
    if r.get("output") is not None:
        output.append({"type": "message", "id": _id("msg", digest), "role": "assistant",
                       "status": "incomplete" if cut else "completed",
                       "content": [{"type": "output_text", "text": r["output"], "annotations": []}]})
    output += response_function_calls(_calls(r), digest)
    prompt, completion = int(r.get("prompt_tokens") or 0), int(r.get("completion_tokens") or 0)
    tools = params.get("tools") or []
    choice = params.get("tool_choice") or "auto"
    return {
        "id": _id("resp", digest), "object": "response", "created_at": created, "model": model,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
        "instructions": params.get("instructions"), "output": output,
        "tools": responses_tools(tools),
        "tool_choice": choice if choice in ("none", "auto", "required") else {"type": "function", "name": choice},
        "parallel_tool_calls": params.get("parallel_tool_calls", True),
        "max_output_tokens": params.get("max_tokens"), "temperature": params.get("temperature"),
        "top_p": params.get("top_p"), "text": _text_config(params),
        "usage": {"input_tokens": prompt, "output_tokens": completion, "total_tokens": prompt + completion,
                  # cache_write_tokens: a prompt-cache write billed apart, which a batch run has none of
                  "input_tokens_details": {"cached_tokens": int(r.get("cached_tokens") or 0), "cache_write_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": int(r.get("reasoning_tokens") or 0)}},
    }


def _text_config(params: dict) -> dict:
    text = {"format": _text_format(params.get("response_format"))}
    if params.get("verbosity") is not None:
        text["verbosity"] = params["verbosity"]
    return text


def _text_format(rf: dict | None) -> dict:
    if not rf or rf.get("type") != "json_schema":
        return rf or {"type": "text"}
    return {"type": "json_schema", **rf["json_schema"]}


def _calls(row: dict) -> list[dict]:
    calls = row.get("tool_calls")
    return json.loads(calls) if isinstance(calls, str) else calls or []


def _params(row: dict) -> dict:
    p = row.get("params")
    return json.loads(p) if isinstance(p, str) else p or {}


def _id(prefix: str, digest: str) -> str:
    return f"{prefix}_" + hashlib.sha256(f"{prefix}\0{digest}".encode()).hexdigest()[:32]

