"""classify: score each candidate label as the assistant's reply; no free text is generated.

A label's tokens are the tokenizer's encoding of the delimiter and the label (--label-delimiter, a
space by default, as lm-eval's target_delimiter: "Sentiment:" scores " positive", not "positive"),
appended to the prompt's tokens. The delimiter is left out under the chat template (the label is the
assistant's reply) and, when it is whitespace, after a prompt that already ends in whitespace.
A label's score is the sum (or, with --normalize mean, the mean) of its tokens' logprobs.
Probabilities are a softmax over the scores of the row's labels. `label_probs` and `label_logprobs`
are dicts label -> number in the row's label order; the writer stores each as a list of structs
({label, prob} and {label, logprob}: jobrunner.output.values KNOWN_COLUMNS), so both read the same way.
"""
from __future__ import annotations

import json
import math

from jobrunner.engine import Request, RequestOutput, SamplingParams
from jobrunner.jobs.base import RowError, uses_chat
from jobrunner.jobs.metrics import ClassificationMetrics
from jobrunner.jobs.row import NO_NOTES, NO_OPTIONS, RowNotes, RowOptions
from jobrunner.jobs.spec import JobSpec


class ClassifyJob:
    name = "classify"
    # every column it may write, and its kind (jobrunner.output.values): the output schema declares them all
    result_columns = {"label": "string", "label_probs": "label_probs", "label_logprobs": "label_logprobs",
                      "confidence": "float", "correct": "bool"}

    def __init__(self, spec: JobSpec, tokenizer):
        self.spec = spec.classify
        self.evaluation = spec.evaluation
        self.tokenizer = tokenizer
        self._encoded: dict[str, list[int]] = {}      # delimiter + label -> its tokens
        chat = uses_chat(spec, tokenizer) or spec.prompt.messages_column is not None
        self.delimiter = "" if chat else self.spec.delimiter
        self.metrics = ClassificationMetrics(spec.evaluation.match, self.spec.labels) \
            if spec.evaluation.enabled else None

    def labels(self, data: dict) -> list[str]:
        if self.spec.labels:
            return list(self.spec.labels)
        value = data.get(self.spec.labels_column)
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.lstrip().startswith("[") else value.split(",")
            except json.JSONDecodeError:
                raise RowError(f"labels column {self.spec.labels_column!r} is not a list") from None
        if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, str) and v for v in value):
            raise RowError(f"labels column {self.spec.labels_column!r} must hold a non-empty list of strings")
        labels = [v.strip() for v in value]
        if len(set(labels)) != len(labels):
            raise RowError("duplicate labels in this row")
        return labels

    def encode(self, label: str, delimiter: str = "") -> list[int]:
        text = delimiter + label
        if text not in self._encoded:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if not ids:
                raise RowError(f"label {label!r} encodes to no tokens")
            self._encoded[text] = ids
        return self._encoded[text]

    def delimiter_after(self, prompt_ids: list[int]) -> str:
        """The delimiter this prompt's labels get: none for a whitespace one after whitespace."""
        if self.delimiter.isspace() and prompt_ids:
            last = self.tokenizer.decode(prompt_ids[-1:], skip_special_tokens=False)
            if last[-1:].isspace():
                return ""
        return self.delimiter

    def request(self, row_id: str, prompt_ids: list[int], data: dict,
                options: RowOptions = NO_OPTIONS) -> tuple[Request, RowNotes]:
        delimiter = self.delimiter_after(prompt_ids)
        cands = [self.encode(label, delimiter) for label in self.labels(data)]
        return Request(row_id, prompt_ids, SamplingParams(max_tokens=0), candidates=cands), NO_NOTES

    def columns(self, out: RequestOutput, data: dict, options: RowOptions = NO_OPTIONS,
                notes: RowNotes = NO_NOTES) -> list[dict]:
        if out.error is not None:
            return [{"output": None, "finish_reason": "error", "completion_tokens": 0}]
        labels = self.labels(data)
        sums = [sum(lp) for lp in out.candidate_logprobs]
        scores = sums if self.spec.normalize == "sum" else [
            s / len(lp) for s, lp in zip(sums, out.candidate_logprobs)]
        top = max(scores)
        exp = [math.exp(s - top) for s in scores]
        total = sum(exp)
        probs = [e / total for e in exp]
        best = max(range(len(labels)), key=lambda i: scores[i])
        row = {
            "output": labels[best], "label": labels[best], "finish_reason": "stop", "completion_tokens": 0,
            "label_probs": dict(zip(labels, probs)),
            "label_logprobs": dict(zip(labels, sums)),
            "confidence": probs[best],
        }
        if self.metrics is not None:
            row["correct"] = self.metrics.add(labels[best], data.get(self.evaluation.reference_column))
        return [row]
