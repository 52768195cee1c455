"""generate: free-text completion of each row's prompt; with tools (jobs/tool_calls.py), the calls the
reply makes in `tool_calls` ([{"name", "arguments"}], finish_reason "tool_calls") and the rest of it
in `output` (null when the reply is only calls)."""
from __future__ import annotations

from dataclasses import replace

from jobrunner.engine import Request, RequestOutput
from jobrunner.jobs.base import RowError, sampling_params
from jobrunner.jobs.constraint import requested_constraint, row_constraint
from jobrunner.jobs.logprobs import TokenSpeller
from jobrunner.jobs.metrics import Accuracy
from jobrunner.jobs.reasoning import answer_constraint, prompt_opens_reasoning, reasoning_markers, split_reasoning
from jobrunner.jobs.row import NO_NOTES, NO_OPTIONS, RowNotes, RowOptions
from jobrunner.jobs.schema_check import SchemaCheck, strict_refusal
from jobrunner.jobs.spec import JobSpec
from jobrunner.jobs.tool_calls import ToolCalls
from jobrunner.jobs.truncation import truncate_prompt


class GenerateJob:
    name = "generate"
    # every column it may write, and its kind (jobrunner.output.values): the output schema declares them all
    result_columns = {"sample_index": "int", "correct": "bool", "logprobs": "token_logprobs", "reasoning": "string",
                      "reasoning_tokens": "int", "truncated_tokens": "int", "constrained_incomplete": "bool",
                      "schema_valid": "bool", "tool_calls": "json"}

    def __init__(self, spec: JobSpec, tokenizer):
        self.spec = spec
        self.sampling = spec.sampling
        if spec.reasoning_parser:
            self.sampling = replace(self.sampling, reasoning_markers=reasoning_markers(spec.reasoning_parser, tokenizer))
        self.constraint, self.schema_column, self.schema_mode = spec.constraint, spec.schema_column, spec.schema_mode
        self.schema_check = SchemaCheck()
        self.evaluation = spec.evaluation
        self.accuracy = Accuracy(spec.evaluation.match) if spec.evaluation.enabled else None
        self.speller = TokenSpeller(tokenizer)
        self.tool_calls = ToolCalls(spec, tokenizer)

    def request(self, row_id: str, prompt_ids: list[int], data: dict,
                options: RowOptions = NO_OPTIONS) -> tuple[Request, RowNotes]:
        sampling = sampling_params(self.sampling, options.sampling)
        ids, dropped = truncate_prompt(prompt_ids, self.spec.truncate_prompt, self.spec.context, sampling.max_tokens)
        opened = bool(self.spec.reasoning_parser) and prompt_opens_reasoning(ids, self.sampling.reasoning_markers)
        notes = RowNotes(dropped, opened) if dropped or opened else NO_NOTES
        constraint = row_constraint(self.constraint, self.schema_column, data, self.schema_mode, options)
        tools = self.tool_calls.request(options)
        if tools is not None and tools.parsed:
            self.tool_calls.parser()            # a row whose calls cannot be read fails now, not after its run
        forced = self.tool_calls.constraint(tools, options.schema_mode or self.schema_mode)
        if forced is not None and constraint is not None:
            raise RowError("tool_choice required (or a named function) makes the reply tool calls: it cannot "
                           "also follow a response format or another constraint; drop one")
        constraint = answer_constraint(forced or constraint, self.spec.reasoning_parser, ids,
                                       self.sampling.reasoning_markers)
        return Request(row_id, ids, sampling, constraint=constraint), notes

    def columns(self, out: RequestOutput, data: dict, options: RowOptions = NO_OPTIONS,
                notes: RowNotes = NO_NOTES) -> list[dict]:
        """One dict per sample (n > 1 gives n rows with sample_index)."""
        rows = []
        schema = self._schema(data, options) if out.error is None else None
        tools = self.tool_calls.request(options)
        for c in out.completions:
            row = {"output": c.text, "finish_reason": c.finish_reason, "completion_tokens": len(c.token_ids)}
            if self.sampling.n > 1 or len(out.completions) > 1:
                row["sample_index"] = c.index
            if c.logprobs is not None:
                row["logprobs"] = self.speller.entries(c.logprobs)
            if self.spec.reasoning_parser:     # no reasoning in the text (no marker): none counted either
                reasoning, row["output"] = split_reasoning(self.spec.reasoning_parser, c.text, notes.reasoning_open)
                row.update(reasoning=reasoning, reasoning_tokens=(c.reasoning_tokens or 0) if reasoning else 0)
            if tools is not None and tools.parsed and out.error is None:
                row["output"], calls = self.tool_calls.parse(tools, row["output"])
                row["tool_calls"] = calls or None
                if calls and c.finish_reason == "stop":
                    row["finish_reason"] = "tool_calls"
            if self.spec.truncate_prompt != "none":
                row["truncated_tokens"] = notes.truncated_tokens
            if c.constrained:               # cut by max_tokens before its grammar ended
                row["constrained_incomplete"] = c.finish_reason == "length"
            if schema is not None:          # checked against the whole schema, whatever the grammar enforced
                row["schema_valid"] = self.schema_check.valid(schema, row["output"], c.finish_reason)
            if out.error is not None and c.finish_reason == "error":
                row["error"] = self._error(out.error, tools, options)
            if self.accuracy is not None and out.error is None:
                row["correct"] = self.accuracy.add(row["output"] or "", data.get(self.evaluation.reference_column))
            rows.append(row)
        return rows

    def _schema(self, data: dict, options: RowOptions) -> str | None:
        """The JSON schema the row's outputs are checked against, as written; None when it has none."""
        try:
            c = requested_constraint(self.constraint, self.schema_column, data, options)
        except RowError:
            return None
        return c.spec if c is not None and c.kind == "json_schema" else None

    def _error(self, error: str, tools, options: RowOptions) -> str:
        """The engine's error, a strict-mode refusal of a JSON schema said in jobrunner's terms."""
        mode = options.schema_mode or self.schema_mode
        subject = "tool parameters" if tools is not None and tools.forced else "JSON schema"
        return strict_refusal(error, subject) if mode == "strict" else error
