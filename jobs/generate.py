"""generate: free-text completion of each row's prompt."""
from __future__ import annotations

from engine.request import Request, RequestOutput
from jobs.base import sampling_params
from jobs.metrics import Accuracy


class GenerateJob:
    name = "generate"
    result_columns = ("sample_index", "correct")

    def __init__(self, cfg, tokenizer):
        self.cfg = cfg
        self.accuracy = Accuracy(cfg.match) if cfg.reference_column else None

    def request(self, row_id: str, prompt_ids: list[int], data: dict) -> Request:
        return Request(row_id, prompt_ids, sampling_params(self.cfg, data.get("params")))

    def columns(self, out: RequestOutput, data: dict) -> list[dict]:
        """One dict per sample (n > 1 gives n rows with sample_index)."""
        rows = []
        for c in out.completions:
            row = {"output": c.text, "finish_reason": c.finish_reason, "completion_tokens": len(c.token_ids)}
            if self.cfg.n > 1:
                row["sample_index"] = c.index
            if self.accuracy is not None and out.error is None:
                row["correct"] = self.accuracy.add(c.text, data.get(self.cfg.reference_column))
            rows.append(row)
        return rows

    def summary(self) -> dict:
        return self.accuracy.summary() if self.accuracy else {}
