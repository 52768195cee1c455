"""embed: each row's prompt -> one vector, its model's final hidden states pooled (engine/sample/pooling.py).

Nothing is generated: the engine runs the prompt once, pools it and frees its KV blocks at once.
The pooling, normalization and size come from EmbedSpec over the checkpoint's sentence-transformers
files. The row's `embedding` is an array('f') (4 bytes a value, not a Python float each), written as
a fixed-size float32 list column (jobrunner.output.values).

A row may set its own `dimensions` (RowOptions.dimensions), and give a list of texts (RowOptions.texts,
an OpenAI /v1/embeddings line's `input` list: jobrunner.openai.rows): then the request embeds each as
given (one EMBED sequence each) and the row gives one output row per text, `input_index` 0.., the
first carrying the request's token counts.
"""
from __future__ import annotations

from array import array
from dataclasses import replace

from jobrunner.engine import CheckpointPooling, Request, RequestOutput
from jobrunner.jobs.base import RowError
from jobrunner.jobs.row import NO_NOTES, NO_OPTIONS, RowNotes, RowOptions
from jobrunner.jobs.spec import JobSpec


class EmbedJob:
    name = "embed"
    # every column it may write, and its kind (jobrunner.output.values; "vector": float32[vector_size])
    result_columns = {"embedding": "vector", "input_index": "int"}

    def __init__(self, spec: JobSpec, tokenizer, checkpoint: CheckpointPooling | None = None):
        self.params = spec.embed.params(checkpoint)     # ValueError: the checkpoint's pooling isn't ours
        self.tokenizer = tokenizer

    def vector_size(self, hidden_size: int) -> int:
        """The size of the `embedding` column: --dimensions, else the model's hidden size (an OpenAI
        line's own `dimensions` may differ: such a vector goes to extra_json)."""
        return self.params.dimensions or hidden_size

    def request(self, row_id: str, prompt_ids: list[int], data: dict,
                options: RowOptions = NO_OPTIONS) -> tuple[Request, RowNotes]:
        params, more = self.params, None
        if options.dimensions is not None:
            try:
                params = replace(params, dimensions=options.dimensions)
            except (TypeError, ValueError) as e:
                raise RowError(f"bad dimensions: {e}") from None
        texts = options.texts
        if texts is not None and len(texts) > 1:      # each text as given, the first included
            prompt_ids, *more = self.tokenizer.encode_batch(list(texts), add_special_tokens=True)
        return Request(row_id, prompt_ids, embed=params, more_inputs=more), NO_NOTES

    def columns(self, out: RequestOutput, data: dict, options: RowOptions = NO_OPTIONS,
                notes: RowNotes = NO_NOTES) -> list[dict]:
        if out.error is not None or not out.embeddings:
            return [{"output": None, "finish_reason": "error", "completion_tokens": 0,
                     "error": out.error or "the engine returned no embedding"}]
        rows = [{"output": None, "finish_reason": "stop", "completion_tokens": 0, "embedding": array("f", v)}
                for v in out.embeddings]
        if len(rows) > 1 or options.texts is not None:
            for i, row in enumerate(rows):
                row["input_index"] = i
                if i:
                    row.update(prompt_tokens=0, cached_tokens=0)
        return rows
