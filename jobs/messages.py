"""Chat messages as a row gives them: content parts (a list of {"type": "text", "text": ...}, as OpenAI and
Hugging Face chat datasets write them) become one string, as vLLM joins them; a message with an image part
(OpenAI's {"type": "image_url", "image_url": {"url": ...}}, Hugging Face's {"type": "image", ...}) keeps its
parts, and `template_images` takes its images out for the prompt's image list, leaving {"type": "image"} in
place (what Qwen2-VL's and LLaVA's chat templates render an image token for). Used for --messages-column
rows and a row's own messages (jobs.base), and by jobrunner.openai.request. A tool-calling history (assistant
tool_calls, tool results) is put in the shape chat templates read (tool_call_messages).

An image part's source is opaque here (no IO in jobs/): jobrunner/images reads it. image_url parts follow
OpenAI (an http(s) or data: URL); image parts follow transformers' chat format: one of `image` (any value
jobrunner/images takes: bytes, a path or URL, an image struct), `url`, `path` or `base64`, or none (the
row's --image-column fills it)."""
from __future__ import annotations

import json


IMAGE_PART = {"type": "image"}             # what the chat template sees of an image, in place
IMAGE_URL_SCHEMES = ("data:", "http://", "https://")    # OpenAI's image_url urls
IMAGE_DETAILS = ("auto", "low", "high", "original")    # image_url.detail: accepted, changes nothing (as vLLM)
IMAGE_SOURCE_KEYS = ("image", "url", "path", "base64")  # an image part's source, as transformers reads it


def join_text_parts(messages: list) -> tuple[list | None, str | None]:
    """Messages whose content is a list of text parts get the parts' texts joined by newlines (as vLLM
    joins them); a message with an image part keeps its parts, text parts as {"type": "text", "text"}.
    A part of another kind (input_audio, file, ...), or an image part of the wrong shape, is an error."""
    out = []
    for m in messages:
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            parts, images = [], False
            for part in m["content"]:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                elif kind in ("image_url", "image"):
                    error = image_part_error(part)
                    if error is not None:
                        return None, error
                    parts.append(part)
                    images = True
                else:
                    return None, f"message content part of type {kind!r} is not supported (only text and image parts)"
            m = {**m, "content": parts if images else "\n".join(p["text"] for p in parts)}
        out.append(m)
    return out, None


def image_part_error(part: dict) -> str | None:
    """What is wrong with an image content part's shape, or None (its image is read later: jobrunner/images)."""
    if part["type"] == "image_url":
        spec = part.get("image_url")
        url = spec.get("url") if isinstance(spec, dict) else spec
        if not isinstance(url, str) or not url.startswith(IMAGE_URL_SCHEMES):
            return (f"message content part image_url: its url must be an http(s):// or data: URL, not "
                    f"{_short(url)}")
        detail = spec.get("detail") if isinstance(spec, dict) else None
        if detail is not None and detail not in IMAGE_DETAILS:
            return f"message content part image_url: detail must be one of {', '.join(IMAGE_DETAILS)}, not {detail!r}"
        return None
    given = [k for k in IMAGE_SOURCE_KEYS if part.get(k) is not None]
    if len(given) > 1:
        return f"message content part image: give one of {', '.join(IMAGE_SOURCE_KEYS)}, not {' and '.join(given)}"
    return None


def has_images(messages: list) -> bool:
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(isinstance(p, dict) and p.get("type") in ("image", "image_url") for p in m["content"])
               for m in messages)


def template_images(messages: list, column_images: tuple = ()) -> tuple[list, list]:
    """(the messages as the chat template gets them, the prompt's image sources in their order). Each image
    part becomes IMAGE_PART; its source is the part's own (an image_url part: its url; an image part: its
    image, url, path or base64 value, the last as a data: URL) or, for an image part without one, the next
    of `column_images` (a row's --image-column values). Column images no part takes go at the start of the
    first user message, before its text. ValueError when the counts disagree (the caller's RowError)."""
    holes = sum(1 for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
                for p in m["content"] if p.get("type") == "image" and _source_key(p) is None)
    if holes and holes != len(column_images):
        raise ValueError(f"the messages hold {holes} image parts without an image, and the image column gives "
                         f"{len(column_images)} images")
    out, sources, column = [], [], list(column_images)
    for m in messages:
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            parts = []
            for part in m["content"]:
                if part.get("type") == "image_url":
                    spec = part["image_url"]
                    sources.append(spec.get("url") if isinstance(spec, dict) else spec)
                elif part.get("type") == "image":
                    key = _source_key(part)
                    if key is None:
                        sources.append(column.pop(0))
                    else:
                        value = part[key]
                        sources.append(f"data:;base64,{value}" if key == "base64" and isinstance(value, str)
                                       else value)
                else:
                    parts.append(part)
                    continue
                parts.append(IMAGE_PART)
            m = {**m, "content": parts}
        out.append(m)
    if column:
        first = next((i for i, m in enumerate(out) if isinstance(m, dict) and m.get("role") == "user"), None)
        if first is None:
            raise ValueError("the image column's images go in the first user message, and the messages have none")
        m = out[first]
        content = m.get("content")
        text = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
        out[first] = {**m, "content": [IMAGE_PART] * len(column) + text}
        before = sum(1 for m in out[:first] if isinstance(m.get("content"), list)       # the earlier messages' images
                     for p in m["content"] if p.get("type") == "image")
        sources[before:before] = column
    return out, sources


def text_as_parts(messages: list) -> list:
    """Messages whose string content is a text part instead ([{"type": "text", "text": content}]), for a
    chat template that reads contents only as lists of parts (LLaVA's)."""
    return [{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str) else m
            for m in messages]


def _source_key(part: dict) -> str | None:
    return next((k for k in IMAGE_SOURCE_KEYS if part.get(k) is not None), None)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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
