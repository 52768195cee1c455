"""What every job kind shares: turning a row into a prompt, and the row errors that stop one row only."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from engine import SamplingParams, Tokenizer
from jobs.messages import join_text_parts, tool_call_messages
from jobs.row import NO_OPTIONS, RowOptions
from jobs.spec import JobSpec
from jobs.template import unescape


class RowError(ValueError):
    """This row cannot run; it becomes an output row with `error` set and the job goes on."""


class PromptBuilder:
    """Row -> prompt token ids: a column, a template or a messages list, through the chat template or raw."""

    def __init__(self, spec: JobSpec, tokenizer: Tokenizer, template=None):
        self.spec = spec.prompt
        self.tokenizer = tokenizer
        self.template = template                     # jobs.template.PromptTemplate or None
        self.system = unescape(self.spec.system) if self.spec.system else None   # the template's escapes, \n etc.
        self.chat = uses_chat(spec, tokenizer)
        self.kind = spec.kind
        self.tools = spec.tools                      # the job's; a row's own win (RowOptions.tools)

    def messages(self, data: dict, options: RowOptions = NO_OPTIONS) -> list[dict] | None:
        """The row's chat messages, or None when the row is a plain prompt in no-chat mode."""
        if options.messages is not None:                    # the row's own: always through the chat template
            return _check_messages(options.messages)
        if options.prompt is not None:                      # the row's own raw text: never
            return None
        if self.spec.messages_column:
            return _check_messages(data.get(self.spec.messages_column))
        text = self.text(data)
        if not self.chat:
            return None
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        return msgs + [{"role": "user", "content": text}]

    def text(self, data: dict, options: RowOptions = NO_OPTIONS) -> str:
        if options.prompt is not None:
            return options.prompt
        if self.template is not None:
            try:
                return self.template.render(data)
            except KeyError as e:
                raise RowError(str(e)) from None
        col = self.spec.prompt_column
        if col not in data or data[col] is None:
            raise RowError(f"prompt column {col!r} is missing or null")
        value = data[col]
        if not isinstance(value, str):
            raise RowError(f"prompt column {col!r} is a {type(value).__name__}, not a string")
        if not value.strip():
            raise RowError(f"prompt column {col!r} is empty")
        return value

    def render(self, data: dict, options: RowOptions = NO_OPTIONS) -> tuple[str, bool]:
        """The prompt text, and whether the tokenizer adds its special tokens (raw text: yes;
        a rendered chat template already has them)."""
        msgs = self.messages(data, options)
        if msgs is None:
            if options.tools is not None or self.tools is not None:
                raise RowError("tools are offered through the chat template: a raw prompt (--no-chat, "
                               "/v1/completions) cannot offer them")
            text = self.text(data, options)
            return (f"{self.system}\n\n{text}" if self.system else text), True
        if not self.tokenizer.has_chat_template:
            raise RowError("messages need a chat template, and this model has none")
        kwargs = {**dict(self.spec.chat_template_kwargs), **options.chat_template_kwargs,     # the row's own win
                  **self._template_variables(options)}
        try:
            return self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, **kwargs), False
        except Exception as e:  # a template's raise_exception, or a message it rejects
            raise RowError(f"chat template failed: {e}") from None

    def pair_prompt(self, query: str, document: str) -> tuple[str, bool]:
        """A (query, document) pair's prompt (a /score or /rerank line's, jobs.pairs): --template filled
        with {query} and {document}, through the chat template or raw as a plain prompt is."""
        if self.template is None or not {"query", "document"} <= set(self.template.columns):
            raise RowError("scoring a query and a document with a reranker's labels needs --template with "
                           "{query} and {document} (the model's own prompt, as the README's rerank.toml)")
        return self.render({"query": query, "document": document})

    def _template_variables(self, options: RowOptions) -> dict:
        """What a row passes the chat template beyond its messages: `tools` (the functions it offers) and
        `reasoning_effort`; each only to a template that reads it (else the row fails, saying so)."""
        source = getattr(self.tokenizer, "chat_template", None) or ""
        out = {}
        tools = options.tools if options.tools is not None else self.tools
        if tools is not None:
            if "tools" not in source:
                raise RowError("tools: this model's chat template takes no tools (it never reads `tools`)")
            out["tools"] = list(tools.tools)
        if options.reasoning_effort is not None:
            if "reasoning_effort" not in source:
                raise RowError("reasoning effort: this model's chat template takes none (it never reads "
                               "`reasoning_effort`)")
            out["reasoning_effort"] = options.reasoning_effort
        return out

    def build(self, data: dict, options: RowOptions = NO_OPTIONS) -> tuple[str, list[int]]:
        text, special = self.render(data, options)
        return text, self.tokenizer.encode(text, add_special_tokens=special)


def uses_chat(spec: JobSpec, tokenizer: Tokenizer) -> bool:
    """Whether a plain prompt goes through the chat template: --chat/--no-chat when given; else
    generate does when the model has one, and classify and score score raw text, as lm-eval
    (no chat template by default) and vLLM's prompt logprobs do. Messages (a --messages-column,
    a row's own: RowOptions.messages) always go through it: see PromptBuilder.messages."""
    if spec.prompt.chat is not None:
        return spec.prompt.chat
    return spec.kind == "generate" and tokenizer.has_chat_template


def _check_messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise RowError("messages must be a non-empty list of {role, content} objects")
    value, error = join_text_parts(value)   # content parts [{"type": "text", "text": ...}], as OpenAI lines
    if error is None:
        value, error = tool_call_messages(value)    # a tool-calling history, as chat templates read it
    if error is not None:
        raise RowError(error)
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not (
                isinstance(m.get("content"), str) or m.get("tool_calls") and m.get("content") is None):
            raise RowError("every message needs a string role and a string content (or, an assistant's, "
                           "tool_calls)")
    return value


def sampling_params(base: SamplingParams, overrides: Mapping[str, Any]) -> SamplingParams:
    """The job's sampling settings (`base`, JobSpec.sampling), the row's own (RowOptions.sampling) over them."""
    if not overrides:
        return base
    try:
        return replace(base, **overrides)
    except (TypeError, ValueError) as e:
        raise RowError(f"bad sampling parameters: {e}") from None
