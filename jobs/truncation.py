"""--truncate-prompt: a prompt too long for the model's context is cut instead of failing its row."""
from __future__ import annotations

from jobrunner.jobs.base import RowError

TRUNCATE_MODES = ("none", "left", "right")


def truncate_prompt(ids: list[int], mode: str, context: int | None, max_tokens: int) -> tuple[list[int], int]:
    """(the prompt's ids, how many were dropped). A prompt is cut to leave room for max_tokens in the
    context: `left` drops its start (keeps the end, where a chat's question and generation prompt are),
    `right` its end. mode none, or no context known: the prompt as it is (a too-long one fails in the engine)."""
    if mode == "none" or context is None or len(ids) + max_tokens <= context:
        return ids, 0
    keep = context - max_tokens
    if keep < 1:
        raise RowError(f"max_tokens {max_tokens} leaves no room for a prompt in the model's context of "
                       f"{context} tokens; lower max_tokens")
    return (ids[-keep:] if mode == "left" else ids[:keep]), len(ids) - keep
