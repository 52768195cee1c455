"""Continuous batching in tokens, not phases. No torch.

Each step has a token budget. Running sequences go first (a decode costs one token, an
unfinished prefill continues with a chunk), then waiting sequences are admitted in order
with prefill chunks, all in one mixed batch. When blocks run out, the most recently admitted
running sequence is preempted: its blocks are released and it is recomputed later (its
full blocks usually come back from the prefix cache). No request is ever dropped.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from jobrunner.engine.schedule.kv_manager import WAIT, KVCacheManager
from jobrunner.engine.schedule.sequence import Sequence, Status


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int                  # first position computed in this chunk
    num_tokens: int             # positions computed, drafted ones included
    # Speculative decoding (engine/spec): tokens guessed past the sequence's last, computed after it in
    # this chunk and sampled at each position; the sequence keeps those the samples confirm.
    draft: tuple[int, ...] = ()
    # The sequence reaches its next event (sampling, or the end of scoring) after this chunk.
    # Fixed when scheduled: by the time the step's results are processed the sequence may
    # already hold a placeholder for the next one.
    completes: bool = field(init=False)

    def __post_init__(self):
        self.completes = self.known_end == self.seq.compute_target

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def known_end(self) -> int:
        """The end of the sequence's own tokens in this chunk (its drafts come after)."""
        return self.end - len(self.draft)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)   # decodes first, then prefill chunks
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    num_decodes: int = 0        # the first num_decodes chunks are decodes (one token, past the prompt)

    @property
    def drafts(self) -> bool:
        """Whether a chunk verifies drafted tokens (the engine then processes the step at once)."""
        return any(c.draft for c in self.chunks[self.num_decodes:])

    @property
    def num_tokens(self) -> int:
        return self.num_decodes + sum(c.num_tokens for c in self.chunks[self.num_decodes:])


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_loras: int | None = None):
        self.kv = kv
        self.max_loras = max_loras      # LoRA adapters among the running sequences at most (None: no bound)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.pending_copies: list[tuple[int, int]] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence, copies: list[tuple[int, int]]) -> None:
        """A forked sequence that already holds blocks."""
        seq.status = Status.RUNNING
        self.running.append(seq)
        self.pending_copies.extend(copies)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(block_copies=self.pending_copies)
        self.pending_copies = []
        budget = self.max_num_batched_tokens
        decodes, prefills = [], []

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_pending, budget)
            if n == 0:
                i += 1
                continue
            # drafts ride only on a one-token decode, and leave a token of budget for each row after it
            room = budget - n - (len(self.running) - i - 1)
            draft = tuple(seq.draft[:max(room, 0)]) if n == 1 and seq.draft else ()
            if draft and not self.kv.allocate(seq, n + len(draft)):
                draft = ()          # no blocks for them: a plain decode (nothing is preempted for drafts)
            # Sequences after i are not scheduled yet: preempt from the back until seq fits.
            while not draft and not self.kv.allocate(seq, n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                chunk = ScheduledChunk(seq, seq.num_computed_tokens, n + len(draft), draft)
                (decodes if n == 1 and not draft and not seq.in_prefill else prefills).append(chunk)
                n += len(draft)
                budget -= n
                i += 1

        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._adapter_fits(seq):
                break
            if not seq.block_table:
                match = self.kv.match_prefix(seq, seq.max_cacheable_prefix)
                if match is WAIT:
                    break
                if not self.kv.can_admit(seq, match, budget):
                    break
                out.block_copies.extend(self.kv.admit(seq, match))
            n = min(seq.num_pending, budget)
            if not self.kv.allocate(seq, n):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            prefills.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n

        out.chunks = decodes + prefills
        out.num_decodes = len(decodes)
        return out

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Whether seq's adapter is resident-able: already running, or fewer than max_loras running."""
        if self.max_loras is None or not seq.lora:
            return True
        running = {s.lora for s in self.running if s.lora}
        return seq.lora in running or len(running) < self.max_loras

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def finish_step(self, out: SchedulerOutput) -> None:
        """After the forward: advance computed counts and mark written blocks computed."""
        for chunk in out.chunks:        # drafted positions count once accepted (OutputProcessor)
            chunk.seq.num_computed_tokens = chunk.known_end
        self.kv.end_step()

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends a sequence (stop, length, error) and releases its blocks."""
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
