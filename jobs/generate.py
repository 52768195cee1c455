"""generate: free-text completion of each row's prompt."""
from __future__ import annotations

from engine.request import Request, RequestOutput
from jobs.base import sampling_params
from jobs.metrics import Accuracy
from jobs.spec import JobSpec


class GenerateJob:
    name = "generate"
    result_columns = ("sample_index", "correct")

    def __init__(self, spec: JobSpec, tokenizer):
        self.sampling = spec.sampling
        self.evaluation = spec.evaluation
        self.accuracy = Accuracy(spec.evaluation.match) if spec.evaluation.enabled else None

    def request(self, row_id: str, prompt_ids: list[int], data: dict) -> Request:
        return Request(row_id, prompt_ids, sampling_params(self.sampling, data.get("params")))

    def columns(self, out: RequestOutput, data: dict) -> list[dict]:
        """One dict per sample (n > 1 gives n rows with sample_index)."""
        rows = []
        for c in out.completions:
            row = {"output": c.text, "finish_reason": c.finish_reason, "completion_tokens": len(c.token_ids)}
            if self.sampling.n > 1:
                row["sample_index"] = c.index
            if self.accuracy is not None and out.error is None:
                row["correct"] = self.accuracy.add(c.text, data.get(self.evaluation.reference_column))
            rows.append(row)
        return rows
