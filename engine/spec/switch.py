"""Which rows speculate this step, and how far: on where it pays, by measurement. No torch.

A row's drafts pay when the tokens they are expected to add are worth more than the time they add to the
step. Both sides are measured as the job runs:

  * each row's acceptance: every proposal is checked against the tokens the row went on to get,
    whether it was verified or not (a shadow draft), so a row's rate is known before it speculates;
  * the step's time: seconds = fixed + per_row * rows + when_drafting + per_draft * drafted tokens, fitted
    over the recent decode and verify steps (least squares with forgetting). A verified token is priced
    apart from a decoded row (it runs through the chunk path), and speculating at all apart from its
    tokens (such a step is processed at once, not overlapped with the next).

With acceptance a (drafts kept one after another with probability a), j drafted tokens add a + a^2 + ...
+ a^j tokens; a token is worth the seconds a plain step takes per row it advances. Each row drafts the j
that maximizes gain - per_draft * j; the step speculates if the rows' net gains together pay
`when_drafting`. Until the fit is determined, rows whose shadow drafts have proven right explore for a
few verify steps (in batches of at most EXPLORE_MAX_ROWS rows), then plain steps run and are timed.
"""
from __future__ import annotations

import numpy as np

PRIOR_ACCEPT, PRIOR_WEIGHT = 0.3, 2.0   # a row's acceptance before its drafts were checked
ACCEPT_MEMORY = 0.8                     # weight of a row's earlier rate at each check
COST_MEMORY = 0.97                      # forgetting factor of the step-time fit (about 30 steps)
STALE_DRAFTING = 0.2                    # verify steps' weight under which the fit is stale: explore again
                                        # (3 verify steps decay to it in about 90 steps)
EXPLORE_ACCEPT = 0.5                    # shadow acceptance that makes a row worth a measured try
EXPLORE_TOKENS = 2                      # drafts a row verifies while the cost is being measured
EXPLORE_STEPS = 3                       # verify steps timed before plain ones are (the fit needs both)
EXPLORE_MAX_ROWS = 16                   # batches explored at, at most: a large batch's verify tokens are its
                                        # step's arithmetic (at 100 rows, bfloat16, exploring cost 6-16% of a
                                        # job); speculation pays in the tail and small batches, measured there


class StepCost:
    """seconds ~ c . (1, rows, drafting, drafted) over recent decode/verify steps (weighted least squares)."""

    def __init__(self):
        self.xx = np.zeros((4, 4))
        self.xy = np.zeros(4)
        self.drafting_steps = 0.0       # weight of the verify steps in the fit

    def add(self, rows: int, drafted: int, seconds: float) -> None:
        x = np.array([1.0, rows, float(drafted > 0), drafted])
        self.xx = COST_MEMORY * self.xx + np.outer(x, x)
        self.xy = COST_MEMORY * self.xy + x * seconds
        self.drafting_steps = COST_MEMORY * self.drafting_steps + (drafted > 0)

    def coefficients(self) -> np.ndarray | None:
        """(fixed, per_row, when_drafting, per_draft) seconds; None until both plain and verify steps were
        timed, and again once the verify steps are long past. A small ridge keeps the fit defined when the batch size has not varied: its split between
        fixed and per-row time is then arbitrary, but their sum at the sizes seen (what plan() uses) is not."""
        if self.drafting_steps < STALE_DRAFTING or self.xx[0, 0] - self.drafting_steps < 1.5:
            return None
        ridge = 1e-6 * np.trace(self.xx) / 4
        return np.maximum(np.linalg.solve(self.xx + ridge * np.eye(4), self.xy), 0.0)


class RowAcceptance:
    """A row's acceptance rate, from its checked drafts; and its one draft awaiting a check."""
    __slots__ = ("rate", "weight", "draft", "at")

    def __init__(self):
        self.rate, self.weight = PRIOR_ACCEPT, PRIOR_WEIGHT
        self.draft: list[int] = []
        self.at = 0

    def check(self, tokens: list[int], end: int) -> None:
        """Scores the pending draft against tokens[:end] that followed it, once they settle it."""
        if not self.draft:
            return
        got = tokens[self.at:min(self.at + len(self.draft), end)]
        n = 0
        while n < len(got) and got[n] == self.draft[n]:
            n += 1
        if n < len(got) or n == len(self.draft):          # a mismatch, or every drafted token came
            tried = min(n + 1, len(self.draft))             # tokens past the first mismatch were never in play
            self.rate = (ACCEPT_MEMORY * self.weight * self.rate + n) / (ACCEPT_MEMORY * self.weight + tried)
            self.weight = ACCEPT_MEMORY * self.weight + tried
            self.draft = []

    @property
    def untried(self) -> bool:
        return self.weight == PRIOR_WEIGHT

    def hold(self, draft: list[int], at: int) -> None:
        if not self.draft:
            self.draft, self.at = list(draft), at


class SpeculationSwitch:
    """mode 'ngram': every row with a draft speculates k tokens; 'auto': where it pays (module docstring).
    Per step: plan(rows with a draft, batch size) -> {seq_id: tokens to draft}; timed(...) after it ran."""

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

    def plan(self, candidates: list[int], batch_rows: int, explore_untried: bool = False) -> dict[int, int]:
        """Drafted tokens for each candidate row (seq ids with a draft at hand) in a step of batch_rows rows.
        explore_untried: rows whose drafts were never checked try too while the cost is measured (a costly
        drafter makes no shadow drafts, so no row's guesses have proven right before it tries)."""
        if self.mode != "auto":
            return dict.fromkeys(candidates, self.k)
        c = self.cost.coefficients()
        if c is None:       # not measured yet: rows whose guesses have proven right try; then plain steps run
            if self.cost.drafting_steps >= EXPLORE_STEPS - 0.5 or batch_rows > EXPLORE_MAX_ROWS:
                return {}
            return {s: min(EXPLORE_TOKENS, self.k) for s in candidates
                    if self.row(s).rate >= EXPLORE_ACCEPT or (explore_untried and self.row(s).untried)}
        fixed, per_row, when_drafting, per_draft = c
        worth = (fixed + per_row * batch_rows) / max(batch_rows, 1)     # seconds a plain step spends per token
        plan, total = {}, 0.0
        for s in candidates:
            j, net = self._best(self.row(s).rate, worth, per_draft)
            if j:
                plan[s], total = j, total + net
        return plan if total > when_drafting else {}

    def _best(self, rate: float, worth: float, per_draft: float) -> tuple[int, float]:
        gain, best, best_net = 0.0, 0, 0.0
        for j in range(1, self.k + 1):
            gain += rate ** j
            net = gain * worth - per_draft * j
            if net > best_net:
                best, best_net = j, net
        return best, best_net

    def timed(self, rows: int, drafted: int, seconds: float) -> None:
        """A pure decode or verify step of `rows` rows and `drafted` verified drafts took `seconds`."""
        self.cost.add(rows, drafted, seconds)
