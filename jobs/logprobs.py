"""Sampled tokens' logprobs as result values: one entry per generated token, in the shape of
OpenAI's ChatCompletionTokenLogprob, so the Parquet column (jobrunner.output.values: `logprobs`)
and the OpenAI batch output (jobrunner.openai.response) read the same:

    {"token": "Paris", "logprob": -0.01, "bytes": [80, 97, 114, 105, 115],
     "top_logprobs": [{"token": "Paris", "logprob": -0.01, "bytes": [...]}, ...]}
"""
from __future__ import annotations

from jobrunner.engine import TokenLogprob


class TokenSpeller:
    """Token id -> (text, bytes), remembered: a job spells the same few thousand tokens again and again."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._seen: dict[int, tuple[str, list[int]]] = {}

    def spell(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._seen.get(token_id)
        if hit is None:
            raw = self.tokenizer.token_bytes(token_id)
            hit = self._seen[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return hit

    def entries(self, logprobs: list[TokenLogprob]) -> list[dict]:
        return [self._entry(lp.token_id, lp.logprob) | {"top_logprobs": [self._entry(t, v) for t, v in lp.top]}
                for lp in logprobs]

    def _entry(self, token_id: int, logprob: float) -> dict:
        text, raw = self.spell(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}
