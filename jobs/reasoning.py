"""Reasoning models: their answer's text split from the reasoning before it.

Qwen3 and DeepSeek-R1 write `<think> reasoning </think> answer`; R1's template opens the
`<think>` itself, so its completions may lack the opening tag. The engine knows where the
answer starts (engine.sequence: `reasoning_end`, counted in Completion.reasoning_tokens: 0 when
the prompt closed the reasoning already, as Qwen3's template does with enable_thinking off;
every token when the completion was cut before `</think>`, or wrote no marker at all). The text
is split by its markers: text outside them is the answer, so a model that writes none answers
with all of it and no reasoning (its reasoning_tokens then 0, jobs.generate). A constraint (a JSON
schema, forced tool calls) holds for the answer whether or not the model opens a reasoning block
(answer_constraint).
"""
from __future__ import annotations

from dataclasses import replace

from jobrunner.engine import Constraint, last_index_of

REASONING_PARSERS = {"qwen3": ("<think>", "</think>"), "deepseek_r1": ("<think>", "</think>")}


def reasoning_markers(parser: str, tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The token ids of the parser's opening and closing tags, for SamplingParams.reasoning_markers."""
    start, end = REASONING_PARSERS[parser]
    return tuple(tokenizer.encode(start)), tuple(tokenizer.encode(end))


def prompt_opens_reasoning(prompt: list[int], markers: tuple[tuple[int, ...], tuple[int, ...]]) -> bool:
    """Whether the prompt leaves the reasoning open (its last marker is the opening one, as
    DeepSeek-R1's template writes `<think>`): then a completion with no marker is all reasoning."""
    start, end = last_index_of(prompt, markers[0]), last_index_of(prompt, markers[1])
    return start is not None and (end is None or end < start)


def split_reasoning(parser: str, text: str, opened: bool = False) -> tuple[str | None, str | None]:
    """(reasoning, answer) of a completion's text, None for a part that is absent. opened: the prompt
    left the reasoning open (prompt_opens_reasoning). Text outside any reasoning markers is the answer:
    a model that writes none (or a prompt that closed the reasoning) gives (None, text)."""
    start, end = REASONING_PARSERS[parser]
    if end in text:
        reasoning, answer = text.split(end, 1)
        return _inside(reasoning, start) or None, answer.lstrip() or None
    if text.lstrip().startswith(start) or opened:     # cut while reasoning: no answer yet
        return _inside(text, start) or None, None
    return None, text


def _inside(reasoning: str, start: str) -> str:
    """The reasoning without its opening tag (absent in R1's completions) and the blank lines around it."""
    return reasoning.lstrip().removeprefix(start).strip()


def answer_constraint(c: Constraint | None, parser: str | None, prompt: list[int],
                      markers: tuple[tuple[int, ...], tuple[int, ...]]) -> Constraint | None:
    """The constraint on the answer as the engine applies it. A prompt with neither marker leaves the
    model to open its own reasoning (Qwen3) or answer at once (a model that writes none): the grammar
    then takes an optional reasoning block before the answer (Constraint.reasoning), since the engine's
    own rule constrains only what follows a closing marker. A prompt that opened the reasoning (R1's
    template) or closed it (enable_thinking off) keeps that rule."""
    if c is None or parser is None or any(last_index_of(prompt, m) is not None for m in markers):
        return c
    return replace(c, reasoning=REASONING_PARSERS[parser])
