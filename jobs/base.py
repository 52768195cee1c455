"""What every job kind shares: turning a row into a prompt, and the row errors that stop one row only."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from engine import SamplingParams, Tokenizer
from jobs.messages import join_text_parts
from jobs.spec import JobSpec
from jobs.template import unescape


class RowError(ValueError):
    """This row cannot run; it becomes an output row with `error` set and the job goes on."""


EMBEDDINGS_ENDPOINT = "/v1/embeddings"      # the OpenAI url that kind embed serves


def is_embeddings_row(data: dict) -> bool:
    """An OpenAI batch /v1/embeddings line (jobrunner.openai_embeddings marks its rows so)."""
    return isinstance(data.get("params"), dict) and data.get("endpoint") == EMBEDDINGS_ENDPOINT


class PromptBuilder:
    """Row -> prompt token ids: a column, a template or a messages list, through the chat template or raw."""

    def __init__(self, spec: JobSpec, tokenizer: Tokenizer, template=None):
        self.spec = spec.prompt
        self.tokenizer = tokenizer
        self.template = template                     # jobs.template.PromptTemplate or None
        self.system = unescape(self.spec.system) if self.spec.system else None   # the template's escapes, \n etc.
        self.chat = uses_chat(spec, tokenizer)
        self.kind = spec.kind

    def messages(self, data: dict) -> list[dict] | None:
        """The row's chat messages, or None when the row is a plain prompt in no-chat mode."""
        if isinstance(data.get("params"), dict):          # an OpenAI batch row (its url picks the kind: jobs.routed)
            if data.get("messages") is not None:            # /v1/chat/completions
                return _check_messages(data["messages"])
            return None                                     # /v1/completions, /v1/embeddings: a raw prompt
        if self.spec.messages_column:
            return _check_messages(data.get(self.spec.messages_column))
        text = self.text(data)
        if not self.chat:
            return None
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        return msgs + [{"role": "user", "content": text}]

    def text(self, data: dict) -> str:
        if isinstance(data.get("params"), dict) and isinstance(data.get("prompt"), str):     # an OpenAI batch row
            return data["prompt"]
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

    def render(self, data: dict) -> tuple[str, bool]:
        """The prompt text, and whether the tokenizer adds its special tokens (raw text: yes;
        a rendered chat template already has them)."""
        msgs = self.messages(data)
        if msgs is None:
            text = self.text(data)
            return (f"{self.system}\n\n{text}" if self.system else text), True
        if not self.tokenizer.has_chat_template:
            raise RowError("messages need a chat template, and this model has none")
        kwargs = dict(self.spec.chat_template_kwargs)
        if isinstance(data.get("params"), dict):          # an OpenAI batch row's own chat_template_kwargs win
            kwargs.update(data["params"].get("chat_template_kwargs") or {})
        try:
            return self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, **kwargs), False
        except Exception as e:  # a template's raise_exception, or a message it rejects
            raise RowError(f"chat template failed: {e}") from None

    def build(self, data: dict) -> tuple[str, list[int]]:
        text, special = self.render(data)
        return text, self.tokenizer.encode(text, add_special_tokens=special)


def uses_chat(spec: JobSpec, tokenizer: Tokenizer) -> bool:
    """Whether a plain prompt goes through the chat template: --chat/--no-chat when given; else
    generate does when the model has one, and classify and score score raw text, as lm-eval
    (no chat template by default) and vLLM's prompt logprobs do. Messages (a --messages-column,
    an OpenAI batch chat row) always go through it: see PromptBuilder.messages."""
    if spec.prompt.chat is not None:
        return spec.prompt.chat
    return spec.kind == "generate" and tokenizer.has_chat_template


def _check_messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise RowError("messages must be a non-empty list of {role, content} objects")
    value, error = join_text_parts(value)   # content parts [{"type": "text", "text": ...}], as OpenAI lines
    if error is not None:
        raise RowError(error)
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RowError("every message needs a string role and a string content")
    return value


# The sampling parameters an OpenAI batch row's body may set, by their SamplingParams names
# (jobrunner.openai_request turns the body's names and shapes into these).
ROW_SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "ignore_eos", "n",
                     "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                     "logprobs")


def sampling_params(base: SamplingParams, overrides: dict | None = None) -> SamplingParams:
    """The job's sampling settings (`base`, JobSpec.sampling); an OpenAI batch row's own body parameters win."""
    p = {}
    for key, value in (overrides or {}).items():
        if key == "max_completion_tokens":
            key = "max_tokens"
        if key in ROW_SAMPLING_KEYS and value is not None:
            if key == "stop":
                value = tuple([value] if isinstance(value, str) else value)
            elif key == "logit_bias":
                value = tuple((int(t), float(b)) for t, b in value)
            p[key] = value
    if not p:
        return base
    try:
        return replace(base, **p)
    except (TypeError, ValueError) as e:
        raise RowError(f"bad sampling parameters: {e}") from None
