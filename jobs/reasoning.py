"""Reasoning models: their answer's text split from the reasoning before it.

Qwen3 and DeepSeek-R1 write `<think> reasoning </think> answer`; R1's template opens the
`<think>` itself, so its completions may lack the opening tag. The engine knows where the
answer starts (engine.sequence: `reasoning_end`, counted in Completion.reasoning_tokens: 0 when
the prompt closed the reasoning already, as Qwen3's template does with enable_thinking off;
every token when the completion was cut before `</think>`); the text is split the same way.
"""
from __future__ import annotations

REASONING_PARSERS = {"qwen3": ("<think>", "</think>"), "deepseek_r1": ("<think>", "</think>")}


def reasoning_markers(parser: str, tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The token ids of the parser's opening and closing tags, for SamplingParams.reasoning_markers."""
    start, end = REASONING_PARSERS[parser]
    return tuple(tokenizer.encode(start)), tuple(tokenizer.encode(end))


def split_reasoning(parser: str, text: str, reasoning_tokens: int) -> tuple[str | None, str]:
    """(reasoning or None, answer) of a completion's text; reasoning_tokens: the engine's count."""
    start, end = REASONING_PARSERS[parser]
    if end in text:
        reasoning, answer = text.split(end, 1)
        return _inside(reasoning, start), answer.lstrip()
    if reasoning_tokens:                      # cut while reasoning: no answer yet
        return _inside(text, start), ""
    return None, text


def _inside(reasoning: str, start: str) -> str:
    """The reasoning without its opening tag (absent in R1's completions) and the blank lines around it."""
    return reasoning.lstrip().removeprefix(start).strip()
