"""Chat messages as a row gives them: content parts (a list of {"type": "text", "text": ...}, as OpenAI
and Hugging Face chat datasets write them) become one string, as vLLM joins them. Used for
--messages-column rows and a row's own messages (jobs.base), and by jobrunner.openai.request. A tool-calling
history (assistant tool_calls, tool results) is put in the shape chat templates read (tool_call_messages)."""
from __future__ import annotations

import json


def join_text_parts(messages: list) -> tuple[list | None, str | None]:
    """Messages whose content is a list of text parts get the parts' texts joined by newlines (as vLLM
    joins them); a part of another kind (image_url, input_audio, file, ...) is an error."""
    out = []
    for m in messages:
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            texts = []
            for part in m["content"]:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    return None, f"message content part of type {kind!r} is not supported (only text parts)"
                texts.append(part["text"])
            m = {**m, "content": "\n".join(texts)}
        out.append(m)
    return out, None


def tool_call_messages(messages: list) -> tuple[list | None, str | None]:
    """Messages as chat templates read a tool-calling history: an assistant message's tool_calls
    ([{"id", "type": "function", "function": {"name", "arguments"}}]) with the arguments as an object
    (OpenAI sends them as JSON text; transformers' templates read a dict, as vLLM passes them), and
    `tool` messages answering a call (their content a string). The others as they are."""
    out = []
    for m in messages:
        if isinstance(m, dict) and m.get("tool_calls"):
            calls, error = _calls_for_template(m["tool_calls"])
            if error is not None:
                return None, error
            m = {**m, "tool_calls": calls}
        elif isinstance(m, dict) and m.get("role") == "tool" and not isinstance(m.get("content"), str):
            return None, "message of role 'tool' needs a string content (the call's result)"
        out.append(m)
    return out, None


def _calls_for_template(calls) -> tuple[list | None, str | None]:
    if not isinstance(calls, list):
        return None, "message tool_calls must be a list of {id, type: function, function: {name, arguments}}"
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            return None, "message tool_calls must be a list of {id, type: function, function: {name, arguments}}"
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                return None, f"message tool_calls: the arguments of {fn['name']!r} are not JSON text"
        if not isinstance(args, dict):
            return None, f"message tool_calls: the arguments of {fn['name']!r} must be a JSON object"
        out.append({**call, "function": {**fn, "arguments": args}})
    return out, None
