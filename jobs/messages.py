"""Chat messages as a row gives them: OpenAI's content parts become one string, as vLLM joins them.
Shared by OpenAI batch lines (jobrunner.openai_request) and --messages-column rows (jobs.base)."""
from __future__ import annotations

from typing import Any


def text_messages(messages: list) -> tuple[list | None, str | None]:
    """An OpenAI line's messages: text parts joined (join_text_parts); tool calls, function calls,
    audio and tool or function messages are errors."""
    out, error = join_text_parts(messages)
    if error is not None:
        return None, error
    for m in out:
        if isinstance(m, dict):
            unsupported = [k for k in ("tool_calls", "function_call", "audio") if not empty(m.get(k))]
            if unsupported or m.get("role") in ("tool", "function"):
                return None, f"message field {(unsupported or [m.get('role')])[0]!r} is not supported"
    return out, None


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


def empty(value: Any) -> bool:
    return value is None or value is False or (isinstance(value, (list, dict, str)) and not value)
