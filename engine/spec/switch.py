"""Which rows speculate this step, and how far: on where it pays, by measurement. No torch.

A row's drafts pay when the tokens they are expected to add are worth more than the compute they add
to the step. Both sides are measured as the job runs:

  * each row's acceptance: every proposal is checked against the tokens the row went on to get,
    whether it was verified or not (a shadow draft), so a row's rate is known before it speculates;
  * the step's cost: seconds = fixed + per_token * tokens, fitted over the recent decode and verify
    steps (exponential forgetting), so per_token reflects the batch the machine runs now.

With acceptance a (drafts accepted one after another with probability a), j drafted tokens add
a + a^2 + ... + a^j tokens; a token is worth the seconds a step takes per row it advances. A row drafts
the j that maximizes gain - cost, if that is positive. Until a verify step is timed the cost is
unknown and taken as zero: the first steps speculate and measure it.
"""
from __future__ import annotations

PRIOR_ACCEPT, PRIOR_WEIGHT = 0.3, 2.0   # a row's acceptance before its drafts were checked
ACCEPT_MEMORY = 0.8                     # weight of a row's earlier rate at each check
COST_MEMORY = 0.97                      # forgetting factor of the step-cost fit (about 30 steps)


class StepCost:
    """seconds ~ fixed + per_token * tokens over recent pure decode/verify steps (weighted least squares)."""

    def __init__(self):
        self.w = self.x = self.y = self.xx = self.xy = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        m = COST_MEMORY
        self.w, self.x, self.y = m * self.w + 1, m * self.x + tokens, m * self.y + seconds
        self.xx, self.xy = m * self.xx + tokens * tokens, m * self.xy + tokens * seconds

    @property
    def per_token(self) -> float | None:
        """Seconds a step's one more token costs; None until steps of different sizes were timed."""
        var = self.xx * self.w - self.x * self.x
        if self.w < 2 or var <= 1e-9 * max(self.xx * self.w, 1.0):
            return None
        return max((self.xy * self.w - self.x * self.y) / var, 0.0)

    def seconds(self, tokens: int) -> float | None:
        b = self.per_token
        if b is None:
            return None
        return (self.y - b * self.x) / self.w + b * tokens


class RowAcceptance:
    """A row's acceptance rate, from its checked drafts; and its one draft awaiting a check."""
    __slots__ = ("rate", "weight", "draft", "at")

    def __init__(self):
        self.rate, self.weight = PRIOR_ACCEPT, PRIOR_WEIGHT
        self.draft: list[int] = []
        self.at = 0

    def check(self, tokens: list[int]) -> None:
        """Scores the pending draft against the tokens that followed it, once they settle it."""
        if not self.draft:
            return
        got = tokens[self.at:self.at + len(self.draft)]
        n = 0
        while n < len(got) and got[n] == self.draft[n]:
            n += 1
        if n < len(got) or n == len(self.draft):          # a mismatch, or every drafted token came
            tried = min(n + 1, len(self.draft))             # tokens past the first mismatch were never in play
            self.rate = (ACCEPT_MEMORY * self.weight * self.rate + n) / (ACCEPT_MEMORY * self.weight + tried)
            self.weight = ACCEPT_MEMORY * self.weight + tried
            self.draft = []

    def hold(self, draft: list[int], at: int) -> None:
        if not self.draft:
            self.draft, self.at = list(draft), at


class SpeculationSwitch:
    """mode 'ngram': every row with a draft speculates k tokens; 'auto': where it pays (module docstring)."""

    def __init__(self, mode: str, k: int):
        self.mode, self.k = mode, k
        self.cost = StepCost()
        self.rows: dict[int, RowAcceptance] = {}

    def row(self, seq_id: int) -> RowAcceptance:
        r = self.rows.get(seq_id)
        if r is None:
            r = self.rows[seq_id] = RowAcceptance()
        return r

    def forget(self, seq_id: int) -> None:
        self.rows.pop(seq_id, None)

    def length(self, seq_id: int, batch_rows: int) -> int:
        """How many of a row's drafted tokens to verify this step, in a step of batch_rows decoding rows."""
        if self.mode != "auto":
            return self.k
        b = self.cost.per_token
        if b is None:
            return self.k
        step = self.cost.seconds(batch_rows) or 0.0
        worth = step / max(batch_rows, 1)                   # seconds a step spends per token it yields
        a, gain, best, best_net = self.row(seq_id).rate, 0.0, 0, 0.0
        for j in range(1, self.k + 1):
            gain += a ** j
            net = gain * worth - b * j
            if net > best_net:
                best, best_net = j, net
        return best

    def timed(self, tokens: int, seconds: float) -> None:
        """A pure decode or verify step of `tokens` tokens took `seconds`."""
        self.cost.add(tokens, seconds)
