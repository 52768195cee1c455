"""When a generating sequence stops, and the text it returns."""
from __future__ import annotations

from jobrunner.engine.schedule.sequence import Sequence

# A stop string that has just appeared ends in the newest token's text and starts at most
# len(stop) characters back, so within the last len(stop) tokens (a token adds at least one
# character once its bytes complete one); the slack covers tokens that add none (partial UTF-8,
# skipped specials) and the cut at the window's start.
STOP_WINDOW_SLACK = 16


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids)

    def check(self, seq: Sequence, max_model_len: int) -> str | None:
        """Finish reason after the token just appended, or None to go on."""
        p, last = seq.sampling, seq.token_ids[-1]
        if seq.num_completion_tokens < p.min_tokens and not _at_length(seq, max_model_len):
            return None     # too short to stop (its end-of-sequence tokens were masked, engine/sample/logits_process.py)
        if (last in self.eos and not p.ignore_eos) or last in p.stop_token_ids:
            return "stop"
        if p.stop and self._stop_in_tail(seq):
            return "stop"
        if _at_length(seq, max_model_len):
            return "length"
        return None

    def may_continue(self, seq: Sequence, max_model_len: int) -> bool:
        """Whether the sequence can go on after its next token, as far as check()'s length limits go."""
        return not _at_length(seq, max_model_len, extra=1)

    def _stop_in_tail(self, seq: Sequence) -> bool:
        """Decodes only the completion's last tokens each step (the whole completion each step
        is quadratic); a hit there is confirmed on the whole text."""
        stops = [s for s in seq.sampling.stop if s]
        window = max(map(len, stops), default=0) + STOP_WINDOW_SLACK
        tail = seq.token_ids[max(seq.num_prompt_tokens, len(seq.token_ids) - window):]
        text = self.tokenizer.decode(tail)
        return any(s in text for s in stops) and self._stop_string_at(seq) is not None

    def final_text(self, seq: Sequence) -> tuple[str, list[int]]:
        ids = seq.token_ids[seq.num_prompt_tokens:]
        text = self.tokenizer.decode(ids) if self.tokenizer is not None else ""
        cut = self._stop_string_at(seq, text) if seq.sampling.stop else None
        return (text[:cut] if cut is not None else text), ids

    def _stop_string_at(self, seq: Sequence, text: str | None = None) -> int | None:
        """Index of the earliest stop string in the completion's text (the stop string is not returned)."""
        if text is None:
            text = self.tokenizer.decode(seq.token_ids[seq.num_prompt_tokens:])
        hits = [i for i in (text.find(s) for s in seq.sampling.stop if s) if i >= 0]
        return min(hits) if hits else None


def _at_length(seq: Sequence, max_model_len: int, extra: int = 0) -> bool:
    """The length limits, with `extra` tokens more than the sequence holds."""
    return (seq.num_completion_tokens + extra >= seq.sampling.max_tokens
            or seq.num_tokens + extra >= max_model_len)
