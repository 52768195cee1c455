"""An OpenAI line's tools: `tools`, `tool_choice` and `parallel_tool_calls` checked into the row's params
(the chat format; a /v1/responses line's flat function tools and {"type": "function", "name"} choice are
turned into it), the row's jobs.tools.ToolRequest from those params, and the calls of a reply in each
endpoint's output shape with their ids.

    params["tools"], params["tool_choice"], params["parallel_tool_calls"]    # tools_params(body, params)
    req = row_tool_request(params)                      # jobs.tools.ToolRequest or None
    message["tool_calls"] = chat_tool_calls(calls, digest)
    output += response_function_calls(calls, digest)    # /v1/responses' function_call items

A call's id is a hash of the line's body id, its sample and its place: unique per job and stable on
resume, as the line's other ids (jobrunner.openai.batch).
"""
from __future__ import annotations

import hashlib

from jobrunner.jobs.tools import TOOL_CHOICES, ToolRequest, tool_request

TOOL_KEYS = ("tools", "tool_choice", "parallel_tool_calls")


def tools_params(body: dict, params: dict) -> str | None:
    """The body's tool keys into params (tools as the chat template takes them, tool_choice as a name);
    what is wrong with them, or None. No tools and a choice that asks for none: nothing."""
    tools, choice = body.get("tools") or None, body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    name = _choice_name(choice)
    if name is None:
        return (f"tool_choice must be {', '.join(TOOL_CHOICES)} or {{\"type\": \"function\", \"function\": "
                f"{{\"name\": ...}}}}, not {choice!r}")
    if tools is None:
        return None if name in ("none", "auto") else f"tool_choice {name!r} needs tools"
    try:
        req = tool_request(tools, name, True if parallel is None else parallel)
    except ValueError as e:
        return str(e)
    params["tools"] = list(req.tools)
    params["tool_choice"] = req.name or req.choice
    params["parallel_tool_calls"] = req.parallel
    return None


def row_tool_request(params: dict) -> ToolRequest | None:
    """The ToolRequest of a line's params (tools_params checked them)."""
    if not params.get("tools"):
        return None
    return tool_request(params["tools"], params.get("tool_choice"), params.get("parallel_tool_calls", True))


def _choice_name(choice) -> str | None:
    """none | auto | required | the named function; None for a value of no such shape."""
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        return choice if choice in TOOL_CHOICES else None
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function") if isinstance(choice.get("function"), dict) else choice   # chat | responses
        return fn.get("name") if isinstance(fn.get("name"), str) else None
    return None


def call_id(digest: str, sample: int, k: int) -> str:
    return "call_" + hashlib.sha256(f"{digest}\0{sample}\0{k}".encode()).hexdigest()[:24]


def chat_tool_calls(calls: list[dict], digest: str, sample: int = 0) -> list[dict]:
    """A chat message's tool_calls (openai ChatCompletionMessageToolCall)."""
    return [{"id": call_id(digest, sample, k), "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}} for k, c in enumerate(calls)]


def response_function_calls(calls: list[dict], digest: str) -> list[dict]:
    """A Response's function_call output items (openai ResponseFunctionToolCall)."""
    return [{"type": "function_call", "id": "fc_" + call_id(digest, 0, k)[5:], "call_id": call_id(digest, 0, k),
             "name": c["name"], "arguments": c["arguments"], "status": "completed"} for k, c in enumerate(calls)]


def responses_tools(tools: list[dict]) -> list[dict]:
    """Chat-format function tools in the Responses API's flat shape (a Response echoes its tools)."""
    out = []
    for t in tools:
        fn = t["function"]
        out.append({"type": "function", "name": fn["name"], "description": fn.get("description"),
                    "parameters": fn.get("parameters"), "strict": fn.get("strict")})
    return out
