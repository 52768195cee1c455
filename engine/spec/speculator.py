"""Drafts for the engine's running rows, before each schedule; the verify results after. No torch.

    spec.propose(scheduler.running, max_model_len)   # sets seq.draft where a row speculates
    ... the step runs: a drafting row's chunk computes its last token and its drafts (k + 1 rows
        of logits, each sampled as the plain engine would: engine/run/model_runner.py) ...
    spec.verified(drafted, accepted)                  # the output processor, per row
    spec.timed(tokens, seconds)                       # the engine, per pure decode/verify step

A row drafts only where its next step is one plain decode with every token known (no placeholder of
an async step in flight), one draw and no logits processing (penalties would need each drafted
position's own history): other rows decode as without speculation. A constrained row's draft is cut
where its grammar would refuse a token; each drafted position samples under the grammar's mask after
the drafts before it (engine.Engine._sample_masked), and the matcher itself advances over kept tokens only.
"""
from __future__ import annotations

from typing import Protocol

from jobrunner.engine.config.engine_config import SPECULATIVE_MODES
from jobrunner.engine.schedule.sequence import Sequence, Status
from jobrunner.engine.spec.ngram import NgramDrafter
from jobrunner.engine.spec.switch import SpeculationSwitch


class Drafter(Protocol):
    """Guesses rows' next tokens: NgramDrafter, or a draft model (engine/core/draft_model.py). A costly
    drafter (a model's forward per proposal) is asked, under auto, only for the rows the switch lets draft:
    no shadow drafts, so a row's acceptance is learned from its verified drafts alone."""
    costly: bool

    def propose_rows(self, rows: list[tuple[int, list[int], int]], k: int) -> dict[int, list[int]]:
        """{seq_id: up to k guessed tokens after tokens[:known]} for each (seq_id, tokens, known)."""

    def forget(self, seq_id: int) -> None: ...

    def close(self) -> None: ...


class Speculator:
    def __init__(self, mode: str, num_tokens: int, drafter: Drafter | None = None):
        if mode not in SPECULATIVE_MODES[1:]:
            raise ValueError(f"speculative mode must be one of {', '.join(SPECULATIVE_MODES)}, not {mode!r}")
        self.drafter = drafter or NgramDrafter()
        self.switch = SpeculationSwitch(mode, num_tokens)
        self.ask_planned = mode == "auto" and getattr(self.drafter, "costly", False)
        self.drafted = self.accepted = 0        # verified drafted tokens, and those accepted
        self.active = False                     # the last proposal found drafts that pay

    def propose(self, running: list[Sequence], max_model_len: int) -> None:
        """Sets each row's draft for the next step: empty where it does not speculate, and for every row
        whose last token is still being sampled (an async step in flight). Sets `active`: some row's
        drafts pay, so the engine runs its steps one at a time (drafting needs every token known)."""
        rows = []
        for seq in running:
            seq.draft = []
            if _may_guess(seq):
                tokens, known = seq.token_ids, seq.num_known_tokens     # not copied: a row may hold thousands
                self.switch.row(seq.seq_id).check(tokens, known)
                rows.append((seq, tokens, known))
        asked = rows
        if self.ask_planned:        # a costly drafter: only the rows that would draft, were their drafts at hand
            ahead = self.switch.plan([seq.seq_id for seq, _, _ in rows], len(running), explore_untried=True)
            asked = [r for r in rows if r[0].seq_id in ahead]
        proposals = self.drafter.propose_rows([(seq.seq_id, t, known) for seq, t, known in asked],
                                              self.switch.k) if asked else {}
        guesses = {}
        for seq, _, known in rows:
            guess = proposals.get(seq.seq_id, [])
            self.switch.row(seq.seq_id).hold(guess, known)
            if seq.matcher is not None and not seq.awaiting_token:     # only what the grammar allows from here
                guess = guess[:seq.matcher.validate_tokens(guess)]
            if guess:
                guesses[seq.seq_id] = (seq, guess)
        plan = self.switch.plan(list(guesses), len(running), explore_untried=self.ask_planned)
        self.active = bool(plan)
        for seq_id, k in plan.items():
            seq, guess = guesses[seq_id]
            if seq.awaiting_token or seq.num_pending != 1 or seq.in_prefill:
                continue        # its next step computes a token not yet known, or its prompt
            room = min(seq.sampling.max_tokens - seq.num_completion_tokens, max_model_len - seq.num_tokens) - 1
            seq.draft = guess[:max(min(k, room), 0)]

    def verified(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted

    def timed(self, rows: int, drafted: int, seconds: float) -> None:
        self.switch.timed(rows, drafted, seconds)

    def forget(self, seq: Sequence) -> None:
        self.drafter.forget(seq.seq_id)
        self.switch.forget(seq.seq_id)

    def close(self) -> None:
        self.drafter.close()


def _may_guess(seq: Sequence) -> bool:
    """Rows whose next token may be guessed: generating one token at a time, no logits processing, and a
    grammar (if any) over every token from here (not a reasoning model's answer-only constraint)."""
    grammar_ok = seq.matcher is None or seq.matcher_sees_reasoning or seq.sampling.reasoning_markers is None
    return (seq.status is Status.RUNNING and seq.samples_one_token and grammar_ok
            and not seq.sampling.adjusts_logits and seq.num_completion_tokens > 0)
