"""What travels with one row beside its data: what the row asks for beyond the job's settings
(RowOptions, set by a front end as it reads the row), and what a kind's request step noted for its
columns step (RowNotes). Both are frozen: a kind keeps no per-row state, so a row's notes go where
the row goes (the planner, the engine, a copy waiting for its leader, a result-cache hit).

    request, notes = kind.request(row_id, prompt_ids, data, options)
    rows = kind.columns(out, data, options, notes)
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from jobrunner.engine import Constraint
from jobrunner.jobs.tools import ToolRequest

@dataclass(frozen=True, slots=True)
class RowOptions:
    """A row's own request, for rows that carry one (an OpenAI batch line: jobrunner.openai.rows turns
    its body into these); the default asks for nothing beyond the job's settings. A row gives its
    prompt as `messages` (always through the chat template) or as raw `prompt` text (never through
    it), or neither: then the job's prompt column, template or messages column make it."""
    messages: list | None = None            # chat messages, content parts joined (jobs.messages)
    prompt: str | None = None               # raw prompt text
    sampling: Mapping[str, Any] = field(default_factory=dict)     # SamplingParams fields the row sets
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)     # over the job's
    constraint: Constraint | None = None    # what the row's outputs must match, over the job's
    schema_mode: str | None = None          # its JSON schema's mode (jobs.schema_check), over the job's
    kind: str | None = None                 # the kind that answers the row ("embed", "pairs"); None: the job's
    texts: tuple[str, ...] | None = None    # embed: several texts, one vector each (input_index 0..)
    dimensions: int | None = None           # embed: the row's own --dimensions
    model: str | None = None                # the model name the row asks for (a LoRA adapter's picks it)
    tools: ToolRequest | None = None        # functions offered to the model (jobs.tools), over the job's
    reasoning_effort: str | None = None     # a chat template's reasoning_effort variable (where it takes one)
    pairs: tuple[tuple[str, str], ...] | None = None    # pairs: (query, document) pairs to score (jobs.pairs)


NO_OPTIONS = RowOptions()


@dataclass(frozen=True, slots=True)
class RowNotes:
    """What a kind's request step found that its columns step reports (generate, pairs)."""
    truncated_tokens: int = 0               # prompt tokens --truncate-prompt dropped
    reasoning_open: bool = False            # the prompt left the reasoning open (its template opened <think>)
    label_tokens: tuple[int, ...] = ()      # pairs: each candidate's label tokens, at its end (jobs.pairs)
    pair_prompt_tokens: int = 0             # pairs: every pair's whole prompt, summed (the row's prompt_tokens)


NO_NOTES = RowNotes()
