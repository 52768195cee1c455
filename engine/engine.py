"""The engine: requests in, outputs out. One engine per device.

    engine = Engine(EngineConfig(...))
    outputs = engine.generate(requests)        # same order as requests
    # or: engine.add_request(r); while engine.has_unfinished(): done = engine.step()

With async scheduling (the default) a step is processed one call later: step() schedules
and launches batch k, then waits for batch k-1 and processes it, so the host's scheduling,
input building and output processing overlap the device's forward. Batch k is scheduled
before k-1's samples are known: each sequence sampling in k-1 holds a placeholder token
(engine/sequence.py) whose input id the runner takes on the device. A sequence that stops
at k-1 has computed one token in k for nothing; its output is dropped. A sample that ends
a sequence by length, forks it (n > 1) or branches it (candidates) gets no placeholder:
that sequence sits out step k instead.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.kv_manager import KVCacheManager
from engine.model_runner import LaunchedStep, ModelRunner, RunnerOutput
from engine.request import Completion, Request, RequestOutput
from engine.runtime import EngineRuntime, build_runtime
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import PLACEHOLDER, Sequence, Status
from engine.stop import StopChecker


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
    prompt_logprobs: list[float] | None = None
    error: str | None = None


@dataclass
class EngineCounters:
    steps: int = 0
    tokens_computed: int = 0          # every token run through the model
    prompt_tokens_computed: int = 0   # tokens of requests' prompts (not candidates, not generated)
    prompt_tokens_cached: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    graph_steps: int = 0              # pure-decode steps replayed from CUDA graphs
    # host seconds per phase of a step; wait_s: waiting for the device's results
    schedule_s: float = 0.0
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    wait_s: float = 0.0
    process_s: float = 0.0


class Engine:
    def __init__(self, config: EngineConfig, runtime: EngineRuntime | None = None):
        self.config = config
        self.rt = runtime or build_runtime(config)
        self.tokenizer = self.rt.tokenizer
        self.kv = KVCacheManager(self.rt.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, self.rt.max_num_seqs, self.rt.max_num_batched_tokens)
        self.runner = ModelRunner(self.rt.model, self.rt.num_blocks, config.block_size, self.rt.kv_dtype,
                                  self.rt.device)
        self.max_model_len = min(self.rt.model_config.max_position_embeddings,
                                 self.rt.num_blocks * config.block_size)
        self.graph_capture_s = 0.0
        if config.cuda_graphs and self.rt.device.type == "cuda":
            self.graph_capture_s = self.runner.enable_graphs(self.rt.max_num_seqs, self.max_model_len)
        self.stop_checker = StopChecker(self.tokenizer, self.rt.eos_token_ids)
        self.counters = EngineCounters()
        self._states: dict[str, _RequestState] = {}
        self._seq_state: dict[int, _RequestState] = {}
        self._finished: list[RequestOutput] = []
        self._in_flight: deque[tuple[SchedulerOutput, LaunchedStep]] = deque()   # launched, not yet processed
        self._depth = 1 if config.async_scheduling else 0                          # steps left in flight
        _quiet_gc()

    # --- public ----------------------------------------------------------------------------

    def generate(self, requests: list[Request]) -> list[RequestOutput]:
        for r in requests:
            self.add_request(r)
        done: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for o in self.step():
                done[o.id] = o
        return [done[r.id] for r in requests]

    @property
    def num_in_flight(self) -> int:
        """Requests added and not yet returned."""
        return len(self._states) + len(self._finished)

    def has_unfinished(self) -> bool:
        return bool(self._finished or self._in_flight) or self.scheduler.has_unfinished()

    def add_request(self, req: Request) -> None:
        if req.id in self._states:
            raise ValueError(f"request id {req.id!r} is already in the engine")
        p = req.sampling
        seed = p.seed if p.seed is not None else _stable_hash(req.id) ^ self.config.seed
        state = _RequestState(req, seed, time.perf_counter(), prompt_tokens=len(req.prompt_token_ids))
        self._states[req.id] = state
        error = self._check(req)
        if error:
            return self._fail(state, error)
        prompt = list(req.prompt_token_ids)
        if req.score_from is not None:
            seq = Sequence(req.id, prompt, len(prompt), p, scoring=True, logprobs_from=max(req.score_from, 1))
        elif req.candidates is not None:
            seq = Sequence(req.id, prompt, len(prompt), p, candidate_first_tokens=[c[0] for c in req.candidates])
            state.candidate_logprobs = [None] * len(req.candidates)
        else:
            if p.max_tokens == 0 and not p.prompt_logprobs:
                state.completions[0] = Completion(0, [], "", "length")
                return self._finish_request(state)
            seq = Sequence(req.id, prompt, len(prompt), p, logprobs_from=1 if p.prompt_logprobs else 0,
                           fork_samples=p.n)
        seq.seed = seed
        self._track(seq, state)
        self.scheduler.add(seq)

    def step(self) -> list[RequestOutput]:
        """Launches one batch and processes the oldest one beyond the pipeline's depth (the one
        before, with async scheduling; this one, without). Returns the requests that finished."""
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        scheduled = time.perf_counter()
        launched = self.runner.launch(sched)
        launched_at = time.perf_counter()
        self.scheduler.finish_step(sched)
        self._account(sched, start, launched.out)
        if sched.chunks:
            self._in_flight.append((sched, launched))
        waited = 0.0
        if self._in_flight and (len(self._in_flight) > self._depth or not sched.chunks):
            waited = self._complete(*self._in_flight.popleft())
        if self._in_flight and self._in_flight[-1][0] is sched:
            self._expect_tokens(sched)
        c = self.counters
        c.schedule_s += scheduled - start
        c.process_s += time.perf_counter() - launched_at - waited    # all bookkeeping after the launch
        finished, self._finished = self._finished, []
        return finished

    # --- step processing -----------------------------------------------------------------

    def _complete(self, sched: SchedulerOutput, launched: LaunchedStep) -> float:
        """Waits for a launched step and processes its results; returns the seconds waited."""
        out = self.runner.collect(launched)
        self._process(sched, out)
        c = self.counters
        c.prepare_s += out.prepare_s
        c.forward_s += out.forward_s
        c.sample_s += out.sample_s
        c.wait_s += out.wait_s
        return out.wait_s

    def _expect_tokens(self, sched: SchedulerOutput) -> None:
        """A placeholder for each sequence sampling in the step in flight that goes on after its
        sample (see the module docstring for those that don't)."""
        for chunk in sched.chunks:
            seq = chunk.seq
            if (chunk.completes and not seq.scoring and seq.status is Status.RUNNING and seq.fork_samples == 1
                    and seq.candidate_first_tokens is None and self.stop_checker.may_continue(seq, self.max_model_len)):
                seq.token_ids.append(PLACEHOLDER)

    def _account(self, sched: SchedulerOutput, step_start: float, out: RunnerOutput) -> None:
        c = self.counters
        c.steps += 1
        c.graph_steps += out.graphed
        c.preemptions += len(sched.preempted)
        c.tokens_computed += sched.num_tokens
        # decodes change neither: their sequence was scheduled before, and they are past its prompt
        for chunk in sched.chunks[sched.num_decodes:]:
            seq = chunk.seq
            state = self._seq_state[seq.seq_id]
            if state.first_scheduled is None:
                state.first_scheduled = step_start
                state.cached_tokens = seq.num_cached_tokens
                c.prompt_tokens_cached += seq.num_cached_tokens
            prompt_end = state.prompt_tokens
            c.prompt_tokens_computed += max(0, min(chunk.end, prompt_end) - chunk.start)

    def _process(self, sched: SchedulerOutput, out: RunnerOutput) -> None:
        now = time.perf_counter()
        for chunk in sched.chunks:
            seq = chunk.seq
            if seq.status is Status.FINISHED:
                continue
            state = self._seq_state[seq.seq_id]
            if seq.seq_id in out.token_logprobs:
                # by position: a preempted sequence scores its recomputed tokens again
                first = max(chunk.start, seq.logprobs_from - 1) - (seq.logprobs_from - 1)
                seq.token_logprobs[first:] = out.token_logprobs[seq.seq_id]
            if not chunk.completes:
                continue
            if state.prefill_done is None and chunk.end >= state.prompt_tokens:
                state.prefill_done = now
            if seq.scoring:
                self._finish_scoring(seq, state)
            elif seq.seq_id in out.candidate_first:
                self._branch_candidates(seq, state, out.candidate_first[seq.seq_id])
            elif seq.seq_id in out.sampled:
                tokens, logprobs = out.sampled[seq.seq_id], out.sample_logprobs[seq.seq_id]
                if seq.fork_samples > 1:
                    self._fork_samples(seq, state, tokens[1:], logprobs[1:])
                    seq.fork_samples = 1
                self._append(seq, state, tokens[0], logprobs[0])

    def _append(self, seq: Sequence, state: _RequestState, token: int, logprob) -> None:
        if seq.awaiting_token:
            seq.token_ids[-1] = token
            self.kv.register_resolved(seq)
        else:
            seq.token_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        self.counters.generated_tokens += 1
        reason = self.stop_checker.check(seq, self.max_model_len)
        if reason:
            self._finish_seq(seq, state, reason)

    def _finish_seq(self, seq: Sequence, state: _RequestState, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        if not seq.scoring:
            text, ids = self.stop_checker.final_text(seq)
            state.completions[seq.sample_index] = Completion(
                seq.sample_index, ids, text, reason, seq.logprobs if seq.sampling.logprobs is not None else None)
            if seq.logprobs_from:
                state.prompt_logprobs = list(seq.token_logprobs)
        self._untrack(seq, state)

    def _finish_scoring(self, seq: Sequence, state: _RequestState) -> None:
        req = state.request
        if req.score_from is not None:
            state.prompt_logprobs = list(seq.token_logprobs)
        else:
            state.candidate_logprobs[seq.sample_index] += seq.token_logprobs
        self.scheduler.finish(seq, "stop")
        self._untrack(seq, state)

    def _branch_candidates(self, parent: Sequence, state: _RequestState, first: list[float]) -> None:
        """Every candidate continues from the prompt's cached KV; the prompt is never recomputed."""
        cands = state.request.candidates
        for i, (cand, lp) in enumerate(zip(cands, first)):
            state.candidate_logprobs[i] = [lp]
            if len(cand) > 1:
                child = Sequence(parent.request_id, parent.token_ids + list(cand), parent.num_prompt_tokens,
                                 parent.sampling, scoring=True, logprobs_from=parent.num_tokens + 1, sample_index=i)
                self._spawn(parent, child, state)
        self.scheduler.finish(parent, "stop")
        self._untrack(parent, state)

    def _fork_samples(self, parent: Sequence, state: _RequestState, tokens, logprobs) -> None:
        for k, (tok, lp) in enumerate(zip(tokens, logprobs), start=1):
            child = Sequence(parent.request_id, list(parent.token_ids), parent.num_prompt_tokens, parent.sampling,
                             sample_index=parent.sample_index + k)
            child.seed = parent.seed
            self._spawn(parent, child, state)
            self._append(child, state, tok, lp)

    def _spawn(self, parent: Sequence, child: Sequence, state: _RequestState) -> None:
        self._track(child, state)
        # a parent preempted since its sample holds no blocks; no free block for the copy: either
        # way the child is recomputed later, mostly from the prefix cache
        copies = self.kv.fork(parent, child) if parent.status is Status.RUNNING else None
        if copies is None:
            self.scheduler.add(child)
        else:
            self.scheduler.add_running(child, copies)

    # --- bookkeeping -----------------------------------------------------------------------

    def _track(self, seq: Sequence, state: _RequestState) -> None:
        self._seq_state[seq.seq_id] = state
        state.live += 1

    def _untrack(self, seq: Sequence, state: _RequestState) -> None:
        del self._seq_state[seq.seq_id]
        state.live -= 1
        if state.live == 0:
            self._finish_request(state)

    def _check(self, req: Request) -> str | None:
        ids = req.prompt_token_ids
        if not ids:
            return "empty prompt"
        vocab = self.rt.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            return f"prompt has token ids outside the vocabulary (0..{vocab - 1})"
        longest = len(ids) + max((len(c) for c in req.candidates or [[]]), default=0)
        limit = self.rt.model_config.max_position_embeddings
        if longest > limit:
            return f"prompt of {longest} tokens exceeds the model's context of {limit} tokens"
        blocks = self.kv.blocks_for(longest)
        if blocks > self.rt.num_blocks:
            return (f"prompt of {longest} tokens needs {blocks} KV blocks but the cache has {self.rt.num_blocks}; "
                    f"raise --kv-cache-memory")
        if req.candidates is not None and (not req.candidates or any(not c for c in req.candidates)):
            return "every candidate must have at least one token"
        if req.score_from is not None and not 1 <= req.score_from < len(ids):
            return "nothing to score: the scored text is empty"
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
            prompt_logprobs=state.prompt_logprobs, candidate_logprobs=state.candidate_logprobs))
        del self._states[state.request.id]


def _quiet_gc() -> None:
    """A step allocates thousands of small objects (chunks, token lists, outputs); with Python's
    default threshold (700) the cyclic collector runs every few hundred of them and, every tenth
    of those, walks older objects too: ~40% of the host time of a 1000-sequence step. Young
    collections now wait for 50,000 allocations. Process-wide and harmless: cycles are still
    freed, only later. (gc.freeze() would save more but makes nanobind report leaks at exit.)"""
    import gc
    gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(gen0, 50_000), gen1, gen2)


def _stable_hash(text: str) -> int:
    """A seed from the request id that is the same in every process (unlike hash())."""
    import hashlib
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
