"""The response body of one OpenAI batch output line: a chat.completion (for /v1/chat/completions
rows) or a text_completion (for /v1/completions rows, those with a prompt and no messages), from
the result rows (samples) of one custom_id. Bodies parse with the official `openai` package's
ChatCompletion and Completion types (tests/test_openai_batch.py checks every line).

Result columns read here: output, finish_reason, sample_index, prompt_tokens, cached_tokens,
completion_tokens, logprobs (jobs.logprobs' entries), reasoning and reasoning_tokens (with a
--reasoning-parser: the message's `reasoning`, vLLM's ChatMessage field today, and `reasoning_content`,
its earlier name that DeepSeek's API and many clients read: null both when the parser found none), tool_calls
(with tools: the message's tool_calls, with ids; finish_reason "tool_calls").
"""
from __future__ import annotations

import json
from typing import Any

from jobrunner.openai.tools import chat_tool_calls
from jobrunner.output.values import is_int


def is_chat(row: dict[str, Any]) -> bool:
    return row.get("messages") is not None or row.get("prompt") is None


def response_body(rows: list[dict[str, Any]], model: str, created: int, digest: str, reasoning: bool = False) -> dict:
    """rows: the successful samples of one custom_id; reasoning: --reasoning-parser was on."""
    chat = is_chat(rows[0])
    indices = [r["sample_index"] if is_int(r.get("sample_index")) else i for i, r in enumerate(rows)]
    choices = [_chat_choice(r, i, digest, reasoning) if chat else _text_choice(r, i) for r, i in zip(rows, indices)]
    prompt = int(rows[0].get("prompt_tokens") or 0)
    completion = sum(int(r.get("completion_tokens") or 0) for r in rows)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
             "prompt_tokens_details": {"cached_tokens": int(rows[0].get("cached_tokens") or 0)},
             "completion_tokens_details": {"reasoning_tokens": sum(int(r.get("reasoning_tokens") or 0)
                                                                   for r in rows)}}
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{digest[:24]}",
            "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": usage}


def _chat_choice(r: dict, index: int, digest: str, reasoning: bool) -> dict:
    message = {"role": "assistant", "content": r.get("output")}     # null: no answer (cut while reasoning)
    if reasoning or r.get("reasoning") is not None:     # current vLLM's name, and DeepSeek's API's and older vLLM's
        message["reasoning"] = message["reasoning_content"] = r.get("reasoning")
    calls = r.get("tool_calls")
    if isinstance(calls, str):              # a json column, as the parts keep it
        calls = json.loads(calls)
    if calls:
        message["tool_calls"] = chat_tool_calls(calls, digest, index)
    entries = r.get("logprobs")
    return {"index": index, "message": message, "finish_reason": r.get("finish_reason"),
            "logprobs": {"content": entries, "refusal": None} if entries is not None else None}


def _text_choice(r: dict, index: int) -> dict:
    """The legacy completions' logprobs: parallel lists, the alternatives as {token: logprob}."""
    entries, logprobs = r.get("logprobs"), None
    if entries is not None:
        offsets, at = [], 0
        for e in entries:
            offsets.append(at)
            at += len(e["token"])
        logprobs = {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                    "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                    "text_offset": offsets}
    return {"index": index, "text": r.get("output") or "", "finish_reason": r.get("finish_reason"),
            "logprobs": logprobs}
