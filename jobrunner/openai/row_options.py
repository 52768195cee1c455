"""An OpenAI batch line's row as the job kinds read it: its body's request as RowOptions (jobs.row), so
that jobs/ knows nothing of OpenAI's wire format. The row's data keeps the parsed line's columns
(openai_batch.parse_record: messages, params, model, prompt, input, endpoint, line), which the output
holds and the OpenAI output files are built from; the kinds read the options.

    chat           data["messages"]                -> RowOptions.messages (the chat template renders them; image_url
                                                      parts kept: the intake reads their images, jobrunner/images)
    completions    data["prompt"]                  -> RowOptions.prompt (raw text)
    embeddings     data["prompt"], data["input"]   -> prompt, kind "embed", texts (an input list), dimensions
    score, rerank  data["input"]                   -> kind "pairs", pairs (query, document), prompt (the first query)
    every line     params' sampling keys, chat_template_kwargs, response_format, schema_mode, tools,
                   reasoning_effort; body.model
"""
from __future__ import annotations

from jobrunner.jobs.row import RowOptions
from jobrunner.openai.embeddings import ENDPOINT as EMBEDDINGS
from jobrunner.openai.request import response_format_constraint
from jobrunner.openai.scores import ENDPOINTS as PAIRS, pairs
from jobrunner.openai.tools import row_tool_request

# The body parameters (openai_request.body_params' names) that set SamplingParams fields of the same name.
SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "ignore_eos", "n",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                 "logprobs")


def row_options(data: dict) -> RowOptions:
    """The options of one parsed line's row (its body checked already: openai_request, openai_embeddings)."""
    params = data.get("params") or {}
    model = data.get("model")
    if data.get("endpoint") == EMBEDDINGS:
        texts = data.get("input")
        return RowOptions(prompt=data.get("prompt"), kind="embed", dimensions=params.get("dimensions"),
                          texts=tuple(texts) if isinstance(texts, list) else None, model=model)
    if data.get("endpoint") in PAIRS:
        return RowOptions(prompt=data.get("prompt"), kind="pairs", pairs=pairs(data), model=model)
    rf = params.get("response_format")
    messages = data.get("messages")
    return RowOptions(messages=messages, prompt=data.get("prompt") if messages is None else None,
                      sampling=sampling_overrides(params), chat_template_kwargs=params.get("chat_template_kwargs") or {},
                      constraint=None if rf is None else response_format_constraint(rf),
                      schema_mode=params.get("schema_mode"), model=model, tools=row_tool_request(params),
                      reasoning_effort=params.get("reasoning_effort"))


def sampling_overrides(params: dict) -> dict:
    """The line's SamplingParams fields, in their types (stop strings and logit_bias pairs as tuples)."""
    out = {}
    for key in SAMPLING_KEYS:
        value = params.get(key)
        if value is None:
            continue
        if key == "stop":
            value = tuple([value] if isinstance(value, str) else value)
        elif key == "logit_bias":
            value = tuple((int(t), float(b)) for t, b in value)
        out[key] = value
    return out
