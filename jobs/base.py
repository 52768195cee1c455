"""What every job kind shares: turning a row into a prompt, and the row errors that stop one row only."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from jobrunner.engine import SamplingParams, Tokenizer
from jobrunner.jobs.messages import IMAGE_PART, has_images, join_text_parts, template_images, text_as_parts, tool_call_messages
from jobrunner.jobs.row import NO_OPTIONS, RowOptions
from jobrunner.jobs.spec import JobSpec
from jobrunner.jobs.template import unescape


class RowError(ValueError):
    """This row cannot run; it becomes an output row with `error` set and the job goes on."""


@dataclass(frozen=True)
class Prompt:
    """A row's prompt: the text the tokenizer gets, whether the tokenizer adds its special tokens, and the
    prompt's image sources in their order (opaque values: jobrunner/images reads them). Through the chat
    template each image is one image token in the text, which the model's image processor expands."""
    text: str
    special: bool
    images: tuple = ()


class PromptBuilder:
    """Row -> prompt token ids: a column, a template or a messages list, through the chat template or raw.
    A row's images (its --image-column values, given to `prompt`, and the image parts of its messages) go
    in the messages the chat template sees as {"type": "image"} parts: a plain prompt's in its user message
    before the text; a messages list's where its image parts are (jobs.messages.template_images).
    images: the model takes images; then a chat template that reads a message's content only as a list
    of parts (LLaVA's: it renders a string content as nothing) gets every content as parts, text ones
    {"type": "text", "text": ...}, as vLLM detects a template's content format."""

    def __init__(self, spec: JobSpec, tokenizer: Tokenizer, template=None, images: bool = False):
        self.spec = spec.prompt
        self.tokenizer = tokenizer
        self.template = template                     # jobs.template.PromptTemplate or None
        self.system = unescape(self.spec.system) if self.spec.system else None   # the template's escapes, \n etc.
        self.chat = uses_chat(spec, tokenizer)
        self.kind = spec.kind
        self.tools = spec.tools                      # the job's; a row's own win (RowOptions.tools)
        self.images = images
        self._parts_only: bool | None = None          # the chat template renders only contents given as parts

    def messages(self, data: dict, options: RowOptions = NO_OPTIONS, images: tuple = ()) -> list[dict] | None:
        """The row's chat messages, or None when the row is a plain prompt in no-chat mode. images: the
        row's column images, each an {"type": "image"} part where it goes (see `prompt`)."""
        return self._messages(data, options, images)[0]

    def _messages(self, data: dict, options: RowOptions, images: tuple) -> tuple[list[dict] | None, tuple]:
        """(the messages, or None for a plain prompt in no-chat mode; the image sources in prompt order)."""
        msgs = None
        if options.messages is not None:                    # the row's own: always through the chat template
            msgs = _check_messages(options.messages)
        elif options.prompt is not None:                    # the row's own raw text: never
            return None, tuple(images)
        elif self.spec.messages_column:
            msgs = _check_messages(data.get(self.spec.messages_column))
        if msgs is not None:
            sources = ()
            if images or has_images(msgs):
                try:
                    msgs, sources = template_images(msgs, tuple(images))
                except ValueError as e:
                    raise RowError(str(e)) from None
            return self._contents(msgs), tuple(sources)
        text = self.text(data)
        # a row with images goes through the chat template unless --no-chat says not: only the template
        # places the image tokens (classify and score default to raw text)
        chat = self.chat or bool(images) and self.spec.chat is None and self.tokenizer.has_chat_template
        if not chat:
            return None, tuple(images)
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        content = [IMAGE_PART] * len(images) + [{"type": "text", "text": text}] if images else text
        return self._contents(msgs + [{"role": "user", "content": content}]), tuple(images)

    def _contents(self, msgs: list[dict]) -> list[dict]:
        """msgs, their string contents as text parts where the model takes images and its chat template
        renders only parts (found once, by rendering a probe both ways); else as they are."""
        if not self.images:
            return msgs
        if self._parts_only is None:
            self._parts_only = _renders_parts_only(self.tokenizer)
        return text_as_parts(msgs) if self._parts_only else msgs

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
        a rendered chat template already has them). A row with images: see `prompt`."""
        p = self.prompt(data, options)
        return p.text, p.special

    def prompt(self, data: dict, options: RowOptions = NO_OPTIONS, images: tuple = ()) -> Prompt:
        """The row's Prompt; `images`: its column images (--image-column's values, opaque). A raw prompt
        (no chat template) with images must write the model's image token once per image itself."""
        msgs, sources = self._messages(data, options, images)
        if msgs is None:
            if options.tools is not None or self.tools is not None:
                raise RowError("tools are offered through the chat template: a raw prompt (--no-chat, "
                               "/v1/completions) cannot offer them")
            text = self.text(data, options)
            return Prompt(f"{self.system}\n\n{text}" if self.system else text, True, sources)
        if not self.tokenizer.has_chat_template:
            raise RowError("messages need a chat template, and this model has none")
        kwargs = {**dict(self.spec.chat_template_kwargs), **options.chat_template_kwargs,     # the row's own win
                  **self._template_variables(options)}
        try:
            return Prompt(self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, **kwargs), False,
                          sources)
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


def _renders_parts_only(tokenizer: Tokenizer) -> bool:
    """Whether the chat template drops a string content that it renders given as a text part."""
    probe = "jobrunner-probe-7f3a"
    try:
        as_string = tokenizer.apply_chat_template([{"role": "user", "content": probe}], add_generation_prompt=True)
        as_parts = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": probe}]}],
                                                 add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that refuses one of them: contents stay as rows give them
        return False
    return probe not in as_string and probe in as_parts


def uses_chat(spec: JobSpec, tokenizer: Tokenizer) -> bool:
    """Whether a plain prompt goes through the chat template: --chat/--no-chat when given; else
    generate does when the model has one, and classify and score score raw text, as lm-eval
    (no chat template by default) and vLLM's prompt logprobs do; a row with images does when neither is
    given (only the template places image tokens: PromptBuilder._messages). Messages (a --messages-column,
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
                isinstance(m.get("content"), (str, list)) or m.get("tool_calls") and m.get("content") is None):
            raise RowError("every message needs a string role and a string content (or text and image parts; "
                           "or, an assistant's, tool_calls)")
    return value


def sampling_params(base: SamplingParams, overrides: Mapping[str, Any]) -> SamplingParams:
    """The job's sampling settings (`base`, JobSpec.sampling), the row's own (RowOptions.sampling) over them."""
    if not overrides:
        return base
    try:
        return replace(base, **overrides)
    except (TypeError, ValueError) as e:
        raise RowError(f"bad sampling parameters: {e}") from None
