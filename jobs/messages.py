"""Chat messages as a row gives them: content parts (a list of {"type": "text", "text": ...}, as OpenAI
and Hugging Face chat datasets write them) become one string, as vLLM joins them. Used for
--messages-column rows and a row's own messages (jobs.base), and by jobrunner.openai.request."""
from __future__ import annotations


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
