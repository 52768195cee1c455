"""Rows that pick a LoRA adapter: the job's kind, with each request naming its row's adapter and an
`adapter` result column (null: the base model).

A row picks by the --lora-column's value (null: the base model; a name the job did not load: an
error row) or by naming the adapter as the model it asks for (RowOptions.model: an OpenAI batch
body's `model`, vLLM's convention; any other name the job's model answers to is the base model).
"""
from __future__ import annotations

from jobrunner.engine import Request, RequestOutput
from jobrunner.jobs.base import RowError
from jobrunner.jobs.kind import JobKind
from jobrunner.jobs.row import NO_NOTES, NO_OPTIONS, RowNotes, RowOptions


class LoraJob:
    def __init__(self, inner: JobKind, names: tuple[str, ...], column: str | None = None, by_model: bool = False):
        self.inner, self.names = inner, frozenset(names)
        self.column, self.by_model = column, by_model
        self.name = inner.name
        self.result_columns = {**inner.result_columns, "adapter": "string"}

    def __getattr__(self, attr):            # the rest of the kind's face (vector_size, ...) is the inner kind's
        if attr == "inner":                 # not set yet (a copy being built): no recursion
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def adapter(self, data: dict, options: RowOptions = NO_OPTIONS) -> str | None:
        """The row's adapter name, or None for the base model; RowError for a name the job lacks."""
        if self.by_model:
            return options.model if options.model in self.names else None
        if self.column is None:
            return None
        value = (data or {}).get(self.column)
        if value is None:
            return None
        if not isinstance(value, str) or value not in self.names:
            raise RowError(f"--lora-column {self.column}: {value!r} is not one of this job's adapters "
                           f"({', '.join(sorted(self.names))}); null runs the base model")
        return value

    def request(self, row_id: str, prompt_ids: list[int], data: dict,
                options: RowOptions = NO_OPTIONS) -> tuple[Request, RowNotes]:
        name = self.adapter(data, options)
        req, notes = self.inner.request(row_id, prompt_ids, data, options)
        req.adapter = name
        return req, notes

    def columns(self, out: RequestOutput, data: dict, options: RowOptions = NO_OPTIONS,
                notes: RowNotes = NO_NOTES) -> list[dict]:
        name = self.adapter(data, options)
        return [{**cols, "adapter": name} for cols in self.inner.columns(out, data, options, notes)]
