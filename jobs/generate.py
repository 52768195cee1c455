"""generate: free-text completion of each row's prompt."""
from __future__ import annotations

from engine.request import Request, RequestOutput
from jobs.base import sampling_params
from jobs.constraint import row_constraint
from jobs.metrics import Accuracy
from jobs.spec import JobSpec


class GenerateJob:
    name = "generate"
    result_columns = ("sample_index", "correct", "constrained_incomplete")

    def __init__(self, spec: JobSpec, tokenizer):
        self.sampling = spec.sampling
        self.constraint, self.schema_column = spec.constraint, spec.schema_column
        self.evaluation = spec.evaluation
        self.accuracy = Accuracy(spec.evaluation.match) if spec.evaluation.enabled else None

    def request(self, row_id: str, prompt_ids: list[int], data: dict) -> Request:
        return Request(row_id, prompt_ids, sampling_params(self.sampling, data.get("params")),
                       constraint=row_constraint(self.constraint, self.schema_column, data))

    def columns(self, out: RequestOutput, data: dict) -> list[dict]:
        """One dict per sample (n > 1 gives n rows with sample_index)."""
        rows = []
        for c in out.completions:
            row = {"output": c.text, "finish_reason": c.finish_reason, "completion_tokens": len(c.token_ids)}
            if self.sampling.n > 1:
                row["sample_index"] = c.index
            if c.constrained:               # cut by max_tokens before its grammar ended
                row["constrained_incomplete"] = c.finish_reason == "length"
            if self.accuracy is not None and out.error is None:
                row["correct"] = self.accuracy.add(c.text, data.get(self.evaluation.reference_column))
            rows.append(row)
        return rows
