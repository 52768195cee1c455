"""Request lifecycle: requests become sequences, a step's results become RequestOutputs.

The engine's loop (engine/core/engine.py) schedules, launches and collects steps; everything about
requests goes through here:

    outputs.add(request)                  # check it, make its first sequence, queue it
    outputs.on_scheduled(sched, t)        # per-request timing and prompt token counts
    outputs.process(sched, runner_out)    # samples, forks, candidate branches, scores, stops
    outputs.take_finished()               # -> RequestOutputs of requests whose last sequence ended

A request lives as long as one of its sequences does (engine/schedule/sequence.py has their kinds):

    generate      GENERATE ──first sample, n > 1──> + n-1 GENERATE forks (sharing the prompt's KV)
    classify      CANDIDATES ──prompt's logits──> one SCORE child per candidate longer than a token
    score         SCORE
    embed         EMBED (one per input: the prompt, then Request.more_inputs), each freeing its blocks
                  as soon as its vector is pooled

Each finished sequence leaves its part in the request's state (a completion, prompt logprobs,
a candidate's logprobs); the request's output is assembled when its last one ends.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from jobrunner.engine.sample.constraints import Grammars, advance, grammar_error
from jobrunner.engine.schedule.prompt_images import PromptImages, VisionSpec
from jobrunner.engine.schedule.kv_manager import KVCacheManager
from jobrunner.engine.run.step_results import RunnerOutput
from jobrunner.engine.api.request import Completion, Request, RequestOutput, TokenLogprob
from jobrunner.engine.schedule.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from jobrunner.engine.spec.speculator import Speculator
from jobrunner.engine.schedule.sequence import SeqKind, Sequence, Status
from jobrunner.engine.core.stop import StopChecker



@dataclass
class _RequestState:
    request: Request
    seed: int
    arrival: float
    first_scheduled: float | None = None
    prefill_done: float | None = None
    live: int = 0                                   # sequences not yet finished
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completions: dict[int, Completion] = field(default_factory=dict)
    candidate_logprobs: list[list[float] | None] | None = None
    candidate_greedy: list[list[bool] | None] | None = None
    prompt_logprobs: list[float] | None = None
    prompt_greedy: list[bool] | None = None
    embeddings: list[list[float] | None] | None = None
    error: str | None = None
    drafted: int = 0                                # speculative decoding: tokens drafted and verified,
    accepted: int = 0                               # and those kept


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, kv: KVCacheManager, stop_checker: StopChecker, model_config,
                 max_model_len: int, seed: int, grammars: Grammars | None = None, lora_names: tuple[str, ...] = (),
                 vision: VisionSpec | None = None, spec: Speculator | None = None):
        self.scheduler, self.kv, self.stop_checker = scheduler, kv, stop_checker
        self.vision = vision                              # a vision-language model's (engine/schedule/prompt_images.py), else None
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.seed = seed
        self.grammars = grammars
        self.spec = spec                                  # speculative decoding's drafts and tallies (engine/spec)
        self.lora_names = tuple(lora_names)               # the engine's LoRA adapters: 1-based on sequences
        self._states: dict[str, _RequestState] = {}       # by request id, until its output is taken
        self._seq_state: dict[int, _RequestState] = {}    # by seq_id, while the sequence lives
        self._finished: list[RequestOutput] = []

    # --- the engine's calls -----------------------------------------------------------------

    @property
    def num_requests(self) -> int:
        """Requests added and not yet taken."""
        return len(self._states) + len(self._finished)

    @property
    def has_finished(self) -> bool:
        return bool(self._finished)

    def take_finished(self) -> list[RequestOutput]:
        finished, self._finished = self._finished, []
        return finished

    def add(self, req: Request) -> None:
        """Checks a request and queues its first sequence; a bad request finishes at once with an error."""
        if req.id in self._states:
            raise ValueError(f"request id {req.id!r} is already in the engine")
        p = req.sampling
        seed = p.seed if p.seed is not None else _stable_hash(req.id) ^ self.seed
        state = _RequestState(req, seed, time.perf_counter(), prompt_tokens=len(req.prompt_token_ids))
        self._states[req.id] = state
        error = self._check(req)
        if error:
            return self._fail(state, error)
        images = self.vision.prompt_images(req) if req.images else None
        if req.embed is not None:
            return self._add_embedding(req, state, images)
        seq = self._first_sequence(req, state)
        if seq is not None:
            seq.images = images
        if seq is not None and req.constraint is not None:
            try:
                seq.matcher = self.grammars.compile(req.constraint).deep_copy()
                seq.matcher_sees_reasoning = req.constraint.reasoning is not None
            except ValueError as e:         # a ConstraintError, or the library's own
                return self._fail(state, str(e))
        if seq is None:
            state.completions[0] = Completion(0, [], "", "length")
            return self._finish_request(state)
        self._track(seq, state)
        self.scheduler.add(seq)

    def on_scheduled(self, sched: SchedulerOutput, step_start: float) -> tuple[int, int]:
        """A step was launched: its requests' first scheduling time. Returns its prompt tokens found
        cached and computed."""
        cached = computed = 0
        # decodes change neither: their sequence was scheduled before, and they are past its prompt
        for chunk in sched.chunks[sched.num_decodes:]:
            seq = chunk.seq
            state = self._seq_state[seq.seq_id]
            if state.first_scheduled is None:
                state.first_scheduled = step_start
                state.cached_tokens = seq.num_cached_tokens
                cached += seq.num_cached_tokens
            computed += max(0, min(chunk.end, state.prompt_tokens) - chunk.start)
        return cached, computed

    def process(self, sched: SchedulerOutput, out: RunnerOutput) -> int:
        """Applies a collected step's results to the sequences it ran. Changes sequences, the scheduler's
        queues and the KV blocks (finishes, forks, branches). Returns the tokens it generated."""
        now, generated = time.perf_counter(), 0
        for chunk in sched.chunks:
            seq = chunk.seq
            if seq.status is Status.FINISHED:     # stopped by the step before (async): this token is dropped
                continue
            state = self._seq_state[seq.seq_id]
            if seq.seq_id in out.token_logprobs:
                seq.record_token_logprobs(chunk.start, out.token_logprobs[seq.seq_id], out.token_greedy[seq.seq_id])
            if not chunk.completes:
                continue
            if state.prefill_done is None and chunk.end >= state.prompt_tokens:
                state.prefill_done = now
            if seq.kind is SeqKind.SCORE:
                self._finish_scoring(seq, state)
            elif seq.kind is SeqKind.EMBED:
                self._finish_embedding(seq, state, out.embeddings[seq.seq_id])
            elif seq.kind is SeqKind.CANDIDATES:
                self._branch_candidates(seq, state, out.candidate_first[seq.seq_id],
                                        out.candidate_first_greedy[seq.seq_id])
            elif chunk.draft:
                generated += self._verify(seq, state, chunk, out.sampled[seq.seq_id], out.sample_logprobs[seq.seq_id])
            else:
                generated += self._sampled(seq, state, out.sampled[seq.seq_id], out.sample_logprobs[seq.seq_id])
        return generated

    # --- sequences ----------------------------------------------------------------------------

    def _first_sequence(self, req: Request, state: _RequestState) -> Sequence | None:
        """The sequence a request starts as; None when there is nothing to compute."""
        p, prompt = req.sampling, list(req.prompt_token_ids)
        if req.score_from is not None:
            return Sequence(req.id, prompt, len(prompt), p, kind=SeqKind.SCORE,
                            logprobs_from=max(req.score_from, 1), seed=state.seed)
        if req.candidates is not None:
            state.candidate_logprobs = [None] * len(req.candidates)
            state.candidate_greedy = [None] * len(req.candidates)
            return Sequence(req.id, prompt, len(prompt), p, kind=SeqKind.CANDIDATES,
                            candidate_first_tokens=[c[0] for c in req.candidates], seed=state.seed)
        if p.max_tokens == 0 and not p.prompt_logprobs:
            return None
        return Sequence(req.id, prompt, len(prompt), p, logprobs_from=1 if p.prompt_logprobs else 0,
                        draws=p.n, seed=state.seed)

    def _add_embedding(self, req: Request, state: _RequestState, images: PromptImages | None) -> None:
        """One EMBED sequence per input (the images are the first input's); the request ends when the
        last one is pooled."""
        inputs = [list(req.prompt_token_ids), *(list(x) for x in req.more_inputs or ())]
        state.embeddings = [None] * len(inputs)
        state.prompt_tokens = sum(map(len, inputs))
        seqs = [Sequence(req.id, ids, len(ids), req.sampling, kind=SeqKind.EMBED, embed=req.embed, sample_index=i,
                         seed=state.seed) for i, ids in enumerate(inputs)]
        seqs[0].images = images
        for seq in seqs:        # all tracked first: the request must not end before its last input is queued
            self._track(seq, state)
        for seq in seqs:
            self.scheduler.add(seq)

    def _finish_embedding(self, seq: Sequence, state: _RequestState, vector: list[float]) -> None:
        """Its vector is pooled: the sequence ends and its blocks go back to the pool (cached for reuse)."""
        state.embeddings[seq.sample_index] = vector
        self.scheduler.finish(seq, "stop")
        self._untrack(seq, state)

    def _sampled(self, seq: Sequence, state: _RequestState, tokens: list[int],
                 logprobs: list[TokenLogprob | None]) -> int:
        """A GENERATE sequence's draws: the first is its own; the others (n > 1, first event only) fork.
        Returns the tokens appended."""
        forks = 0
        if seq.draws > 1:
            forks = self._fork_samples(seq, state, tokens[1:], logprobs[1:])
            seq.draws = 1
        self._append(seq, state, tokens[0], logprobs[0])
        return 1 + forks

    def _verify(self, seq: Sequence, state: _RequestState, chunk: ScheduledChunk, tokens: list[int],
                logprobs: list[TokenLogprob | None]) -> int:
        """A drafting row's samples, one per position from its last token on: it keeps them up to and with the
        first that differs from its draft (each later one followed a wrong guess), or up to its stop. Its K and
        V hold through the last draft kept; the positions after are written again when computed. Returns the
        tokens appended."""
        known, draft, kept, accepted = seq.num_tokens, chunk.draft, 0, 0
        state.drafted += len(draft)
        for j, token in enumerate(tokens):
            right = j < len(draft) and token == draft[j]
            accepted += right
            state.accepted += right         # before the append that may end the request
            self._append(seq, state, token, logprobs[j])
            kept += 1
            if seq.status is Status.FINISHED or not right:
                break
        self.spec.verified(len(draft), accepted)
        if seq.status is not Status.FINISHED:
            seq.num_computed_tokens = chunk.known_end + kept - 1    # the drafts kept were computed; the last sample not
            self.kv.register_accepted(seq, known)
        return kept

    def _append(self, seq: Sequence, state: _RequestState, token: int, logprob: TokenLogprob | None) -> None:
        if seq.append_token(token):
            self.kv.register_resolved(seq)      # the block that token completes can be hashed now
        if logprob is not None:
            seq.logprobs.append(logprob)
        reason = self._grammar_end(seq, token) or self.stop_checker.check(seq, self.max_model_len)
        if reason == "error":       # a finish_reason "error" always comes with the request's error
            state.error = state.error or grammar_error(seq.matcher)
        if reason:
            self._finish_generating(seq, state, reason)

    @staticmethod
    def _grammar_end(seq: Sequence, token: int) -> str | None:
        """A constrained sequence ends where its grammar does (EOS only where the grammar accepts:
        the bitmask allows nothing else). A reasoning model's constraint is on its answer: the
        reasoning and its closing marker are not fed to the matcher, unless its grammar covers them."""
        if seq.matcher is None or not seq.constrained_from(seq.num_tokens - 1) or not advance(seq.matcher, token):
            return None
        return "error" if seq.matcher.is_error() else "stop"

    def _finish_generating(self, seq: Sequence, state: _RequestState, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        text, ids = self.stop_checker.final_text(seq)
        state.completions[seq.sample_index] = Completion(
            seq.sample_index, ids, text, reason, seq.logprobs if seq.sampling.logprobs is not None else None,
            seq.num_reasoning_tokens if seq.sampling.reasoning_markers is not None else None,
            constrained=seq.matcher is not None)
        if seq.logprobs_from:                   # prompt logprobs
            state.prompt_logprobs, state.prompt_greedy = list(seq.token_logprobs), list(seq.token_greedy)
        self._untrack(seq, state)

    def _finish_scoring(self, seq: Sequence, state: _RequestState) -> None:
        if state.request.score_from is not None:
            state.prompt_logprobs, state.prompt_greedy = list(seq.token_logprobs), list(seq.token_greedy)
        else:                                   # a candidate's tokens after its first
            state.candidate_logprobs[seq.sample_index] += seq.token_logprobs
            state.candidate_greedy[seq.sample_index] += seq.token_greedy
        self.scheduler.finish(seq, "stop")
        self._untrack(seq, state)

    def _branch_candidates(self, parent: Sequence, state: _RequestState, first: list[float],
                           first_greedy: list[bool]) -> None:
        """Every candidate continues from the prompt's cached KV; the prompt is never recomputed."""
        for i, (cand, lp, greedy) in enumerate(zip(state.request.candidates, first, first_greedy)):
            state.candidate_logprobs[i], state.candidate_greedy[i] = [lp], [greedy]
            if len(cand) > 1:
                self._spawn(parent, parent.candidate_child(cand, i), state)
        self.scheduler.finish(parent, "stop")
        self._untrack(parent, state)

    def _fork_samples(self, parent: Sequence, state: _RequestState, tokens, logprobs) -> int:
        """A child for each further draw, holding it; returns how many."""
        k = 0
        for k, (tok, lp) in enumerate(zip(tokens, logprobs), start=1):
            child = parent.fork(parent.sample_index + k)
            if parent.matcher is not None:     # the parent has not taken its own draw yet
                child.matcher = parent.matcher.deep_copy()
            self._spawn(parent, child, state)
            self._append(child, state, tok, lp)
        return k

    def _spawn(self, parent: Sequence, child: Sequence, state: _RequestState) -> None:
        self._track(child, state)
        # a parent preempted since its sample holds no blocks; no free block for the copy: either
        # way the child is recomputed later, mostly from the prefix cache
        copies = self.kv.fork(parent, child) if parent.status is Status.RUNNING else None
        if copies is None:
            self.scheduler.add(child)
        else:
            self.scheduler.add_running(child, copies)

    # --- requests -----------------------------------------------------------------------------

    def _track(self, seq: Sequence, state: _RequestState) -> None:
        adapter = state.request.adapter       # every sequence of a request runs under its adapter
        seq.lora = 0 if adapter is None else self.lora_names.index(adapter) + 1
        self._seq_state[seq.seq_id] = state
        state.live += 1

    def _untrack(self, seq: Sequence, state: _RequestState) -> None:
        del self._seq_state[seq.seq_id]
        if self.spec is not None:
            self.spec.forget(seq)
        state.live -= 1
        if state.live == 0:
            self._finish_request(state)

    def _check(self, req: Request) -> str | None:
        ids = req.prompt_token_ids
        if not ids:
            return "empty prompt"
        if req.adapter is not None and req.adapter not in self.lora_names:
            return f"unknown LoRA adapter {req.adapter!r}" + (f" (this engine has {', '.join(self.lora_names)})"
                                                               if self.lora_names else " (this engine has none)")
        if req.images:
            if self.vision is None:
                return "this model takes no images (it has no vision tower)"
            error = self.vision.check(req)
            if error:
                return error
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            return f"prompt has token ids outside the vocabulary (0..{vocab - 1})"
        if any(not 0 <= t < vocab for t, _ in req.sampling.logit_bias):
            return f"logit_bias has token ids outside the vocabulary (0..{vocab - 1})"
        too_long = req.context_error(self.model_config.max_position_embeddings)
        if too_long:
            return too_long
        longest = req.tokens_needed
        blocks = self.kv.blocks_for(longest)
        if blocks > self.kv.num_blocks:
            return (f"prompt of {longest} tokens needs {blocks} KV blocks but the cache has {self.kv.num_blocks}; "
                    f"raise --kv-cache-memory")
        if req.constraint is not None and (req.candidates is not None or req.score_from is not None):
            return "a constraint applies to generated text only (not to classify or score)"
        if req.candidates is not None and (not req.candidates or any(not c for c in req.candidates)):
            return "every candidate must have at least one token"
        if req.score_from is not None and not 1 <= req.score_from < len(ids):
            return "nothing to score: the scored text is empty"
        dims = req.embed.dimensions if req.embed is not None else None
        if dims is not None and dims > self.model_config.hidden_size:
            return f"dimensions {dims} exceeds the model's embedding size {self.model_config.hidden_size}"
        for more in req.more_inputs or ():
            if not more:
                return "empty input"
            if min(more) < 0 or max(more) >= vocab:
                return f"input has token ids outside the vocabulary (0..{vocab - 1})"
        return None

    def _fail(self, state: _RequestState, error: str) -> None:
        state.error = error
        state.completions[0] = Completion(0, [], "", "error")
        self._finish_request(state)

    def _finish_request(self, state: _RequestState) -> None:
        now = time.perf_counter()
        first = state.first_scheduled or now
        prefill_done = state.prefill_done or now
        comps = [state.completions[k] for k in sorted(state.completions)]
        self._finished.append(RequestOutput(
            id=state.request.id, completions=comps, prompt_tokens=state.prompt_tokens,
            cached_tokens=state.cached_tokens, completion_tokens=sum(len(c.token_ids) for c in comps),
            queue_s=first - state.arrival, prefill_s=max(prefill_done - first, 0.0),
            decode_s=max(now - prefill_done, 0.0), error=state.error,
            prompt_logprobs=state.prompt_logprobs, candidate_logprobs=state.candidate_logprobs,
            prompt_greedy=state.prompt_greedy, candidate_greedy=state.candidate_greedy,
            embeddings=state.embeddings, computed=state.first_scheduled is not None,
            draft_tokens=state.drafted, accepted_tokens=state.accepted))
        del self._states[state.request.id]


def _stable_hash(text: str) -> int:
    """A seed from the request id that is the same in every process (unlike hash())."""
    import hashlib
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
