"""The engine's loop: schedule, launch, collect, update. One engine per device.

    engine = Engine(EngineConfig(...))
    outputs = engine.generate(requests)        # same order as requests
    # or: engine.add_request(r); while engine.has_unfinished(): done = engine.step()

Requests, their sequences and their outputs are the output processor's
(engine/core/output_processor.py); this module only moves steps through the pipeline.

With async scheduling (the default) a step is processed one call later: step() schedules
and launches batch k, then waits for batch k-1 and processes it, so the host's scheduling,
input building and output processing overlap the device's forward. Batch k is scheduled
before k-1's samples are known: each sequence sampling in k-1 holds a placeholder token
(engine/schedule/sequence.py) whose input id the runner takes on the device. A sequence that stops
at k-1 has computed one token in k for nothing; its output is dropped. A sample that ends
a sequence by length, forks it (n > 1) or branches it (candidates) gets no placeholder:
that sequence sits out step k instead.

Structured output (engine/sample/constraints.py): a step with constrained rows launches its forward and
logits, and samples only once the host has filled the grammar bitmask, which needs every earlier
token: with async scheduling, after step k-1 is processed while step k's forward runs.

Speculative decoding (engine/spec): before each schedule the speculator drafts for the rows whose every
token is known; while some row's drafts pay, each step is processed in the call that launched it
(no step left in flight: the next drafts need the tokens this one keeps).
"""
from __future__ import annotations

import time
import weakref
from collections import deque
from typing import NamedTuple

from jobrunner.engine.config.engine_config import EngineConfig
from jobrunner.engine.sample.constraints import Grammars
from jobrunner.engine.api.counters import EngineCounters
from jobrunner.engine.api.errors import EngineFailure
from jobrunner.engine.schedule.prompt_images import VisionSpec
from jobrunner.engine.api.info import EngineInfo, Tokenizer
from jobrunner.engine.schedule.kv_manager import KVCacheManager
from jobrunner.engine.run.model_runner import ModelRunner
from jobrunner.engine.run.step_results import LaunchedStep, RunnerOutput
from jobrunner.engine.core.output_processor import OutputProcessor
from jobrunner.engine.parallel.channel import StepChannel
from jobrunner.engine.run import process_settings
from jobrunner.engine.api.request import Request, RequestOutput
from jobrunner.engine.run.runtime import EngineRuntime, build_runtime
from jobrunner.engine.schedule.scheduler import Scheduler, SchedulerOutput
from jobrunner.engine.schedule.sequence import Status
from jobrunner.engine.core.draft_model import speculator
from jobrunner.engine.core.stop import StopChecker


class Engine:
    """Also a context manager: `with Engine(config) as engine:` closes it at the end (close())."""

    def __init__(self, config: EngineConfig, runtime: EngineRuntime | None = None):
        try:
            self._build(config, runtime)
        except BaseException:
            process_settings.restore_if_idle()      # what building the runtime changed, if no engine is open
            raise
        heap = process_settings.hold(cpu=self.rt.device.type == "cpu")
        # gives the settings back once, at close() or when an unclosed engine is collected; the finalizer holds no
        # reference to the engine, and does nothing at exit
        self._release_settings = weakref.finalize(self, process_settings.release, heap)
        self._release_settings.atexit = False

    def _build(self, config: EngineConfig, runtime: EngineRuntime | None) -> None:
        self.config = config
        self.rt = runtime or build_runtime(config)
        self.tokenizer: Tokenizer = self.rt.tokenizer
        self.image_processor = self.rt.image_processor    # engine.vision's, for a vision-language model; else None
        self.kv = KVCacheManager(self.rt.num_blocks, config.block_size, config.enable_prefix_caching)
        loras = self.rt.loras
        self.scheduler = Scheduler(self.kv, self.rt.max_num_seqs, self.rt.max_num_batched_tokens,
                                   max_loras=loras.num_slots if loras.num_slots < len(loras.names) else None)
        channel = StepChannel(self.rt.tp, self.rt.device) if self.rt.tp.size > 1 else None
        self.runner = ModelRunner(self.rt.model, self.rt.num_blocks, config.block_size, self.rt.kv_dtype,
                                  self.rt.device, self.rt.eos_token_ids, channel=channel, loras=self.rt.loras)
        self.max_model_len = self.rt.max_model_len(config.block_size)
        self.graph_capture_s = 0.0
        if config.cuda_graphs and self.rt.device.type == "cuda" and not config.loras:   # LoRA steps run eagerly
            self.graph_capture_s = self.runner.enable_graphs(self.rt.max_num_seqs, self.max_model_len)
        self.stop_checker = StopChecker(self.tokenizer, self.rt.eos_token_ids)
        self._counters = EngineCounters()     # this engine's own: a step adds its figures
        self.info = engine_info(self.rt, config, self.max_model_len)
        self.grammars = Grammars(self.tokenizer, self.rt.eos_token_ids, self.rt.model_config.vocab_size,
                                 config.grammar_timeout_s)
        self.spec = speculator(config, self.tokenizer, Engine)     # engine/spec and draft_model.py; None: off
        self.outputs = OutputProcessor(self.scheduler, self.kv, self.stop_checker, self.rt.model_config,
                                       self.max_model_len, config.seed, self.grammars, lora_names=loras.names,
                                       vision=vision_spec(self.rt.model), spec=self.spec)
        self._in_flight: deque[tuple[SchedulerOutput, LaunchedStep]] = deque()   # launched, not yet processed
        self._depth = 1 if config.async_scheduling else 0                          # steps left in flight

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
        return self.outputs.num_requests

    def has_unfinished(self) -> bool:
        return self.outputs.has_finished or bool(self._in_flight) or self.scheduler.has_unfinished()

    def counters(self) -> EngineCounters:
        """The totals so far, a frozen snapshot: subtract an earlier one for what ran since."""
        return self._counters

    def reset_counters(self) -> None:
        """Start the totals from zero, e.g. after a warm-up."""
        self._counters = EngineCounters()

    def add_request(self, req: Request) -> None:
        self.outputs.add(req)

    def set_threads(self, n: int) -> None:
        """The CPU compute threads of the steps that follow (torch's intra-op pool; a process-wide
        setting, as EngineConfig.num_threads). Nothing on a GPU, nor under tensor parallelism, whose
        ranks each keep their share."""
        if self.rt.device.type == "cpu" and self.rt.followers is None and n >= 1:
            process_settings.set_threads(n)      # the count before the first engine comes back at the last close

    def close(self) -> None:
        """Ends the other ranks of a tensor-parallel group (at exit otherwise) and, the last engine open, gives
        the process the settings engines changed back (engine/run/process_settings.py). Closing twice is a no-op."""
        if self.rt.followers is not None:
            self.rt.followers.close()
        if self.spec is not None:
            self.spec.close()       # a draft model's engine
        self._release_settings()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def step(self) -> list[RequestOutput]:
        """Launches one batch and processes the oldest one beyond the pipeline's depth (the one
        before, with async scheduling; this one, without). Returns the requests that finished.
        EngineFailure when a rank of its tensor-parallel group is lost."""
        followers = self.rt.followers
        if followers is None:
            return self._step()
        followers.step_since = time.monotonic()
        try:
            return self._step()
        except RuntimeError as e:
            lost = followers.lost(wait_s=5.0)     # the closed connection may be seen before the exit
            if lost is None:
                raise
            followers.close(abort=True)
            raise EngineFailure(lost) from e
        finally:
            followers.step_since = None

    def _step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        drafted_before = (self.spec.drafted, self.spec.accepted) if self.spec is not None else (0, 0)
        if self.spec is not None:
            self.spec.propose(self.scheduler.running, self.max_model_len)
        sched = self.scheduler.schedule()
        scheduled = time.perf_counter()
        launched = self.runner.launch(sched)
        launched_at = time.perf_counter()
        self.scheduler.finish_step(sched)
        cached, computed = self.outputs.on_scheduled(sched, start)
        if sched.chunks:
            self._in_flight.append((sched, launched))
        done = self._complete_oldest() if self._oldest_is_due(sched) else _NOTHING_DONE
        while self._in_flight and self.spec is not None and self.spec.active:
            done = done.plus(self._complete_oldest())   # drafting needs every token known: no step left in flight
        mask_s = done.mask_s
        if self._in_flight and self._in_flight[-1][1].awaits_mask:
            mask_s += self._sample_masked(self._in_flight[-1][1])
        if self._left_in_flight(sched):
            self._expect_tokens(sched)
        out = done.out
        self._counters += EngineCounters(
            steps=1, tokens_computed=sched.num_tokens, prompt_tokens_computed=computed, prompt_tokens_cached=cached,
            generated_tokens=done.generated, preemptions=len(sched.preempted), graph_steps=int(launched.out.graphed),
            schedule_s=scheduled - start, prepare_s=out.prepare_s, forward_s=out.forward_s, sample_s=out.sample_s,
            wait_s=out.wait_s, mask_s=mask_s,
            images_encoded=launched.out.images_encoded, images_reused=launched.out.images_reused,
            draft_tokens=self.spec.drafted - drafted_before[0] if self.spec is not None else 0,
            accepted_tokens=self.spec.accepted - drafted_before[1] if self.spec is not None else 0,
            process_s=time.perf_counter() - launched_at - out.wait_s)    # all bookkeeping after the launch
        if self.spec is not None and _decodes_only(sched):
            drafted = sum(len(c.draft) for c in sched.chunks)
            self.spec.timed(len(sched.chunks), drafted, time.perf_counter() - start)
        return self.outputs.take_finished()

    # --- the pipeline ------------------------------------------------------------------------

    def _oldest_is_due(self, sched: SchedulerOutput) -> bool:
        """Whether the oldest launched step must be processed now: more steps are in flight than the
        pipeline's depth, or the step just scheduled launched nothing: there is no forward to overlap
        with, and what the next schedule needs (samples not yet read, blocks not yet freed) comes
        from processing the steps in flight, so the pipeline drains."""
        return bool(self._in_flight) and (len(self._in_flight) > self._depth or not sched.chunks)

    def _left_in_flight(self, sched: SchedulerOutput) -> bool:
        """Whether the step just launched stays in flight past this call (async scheduling): then the
        next schedule runs before its samples are known."""
        return bool(self._in_flight) and self._in_flight[-1][0] is sched

    def _complete_oldest(self) -> _Done:
        """Waits for the oldest launched step and processes its results."""
        sched, launched = self._in_flight.popleft()
        mask_s = self._sample_masked(launched) if launched.awaits_mask else 0.0   # without async: the step just launched
        out = self.runner.collect(launched)
        generated = self.outputs.process(sched, out)
        return _Done(out, generated, mask_s)

    def _sample_masked(self, launched: LaunchedStep) -> float:
        """Fills the grammar bitmask of a launched step's rows (every earlier step is processed, so each
        matcher has seen its sequence's tokens) and lets the runner sample. Rows that stopped since
        their launch get no mask: their token is dropped; nor do rows still reasoning (the
        constraint is on the answer). Returns the seconds the mask took."""
        t0 = time.perf_counter()
        _, seqs, ahead, _ = launched.masked
        mask = self.grammars.fill(_row_matchers(seqs, ahead))
        mask_s = time.perf_counter() - t0
        self.runner.sample_masked(launched, mask)
        return mask_s

    def _expect_tokens(self, sched: SchedulerOutput) -> None:
        """A placeholder for each sequence sampling in the step in flight that goes on after its
        sample with one token (see the module docstring for those that don't)."""
        for chunk in sched.chunks:
            seq = chunk.seq
            if (chunk.completes and seq.samples_one_token and seq.status is Status.RUNNING
                    and self.stop_checker.may_continue(seq, self.max_model_len)):
                seq.expect_token()

class _Done(NamedTuple):
    """A processed step: the runner's figures, the tokens it generated, the seconds its mask took."""
    out: RunnerOutput
    generated: int
    mask_s: float

    def plus(self, other: _Done) -> _Done:
        """Two steps processed in one call (a verify step and the one before it): their times summed."""
        a, b = self.out, other.out
        out = RunnerOutput(prepare_s=a.prepare_s + b.prepare_s, forward_s=a.forward_s + b.forward_s,
                           sample_s=a.sample_s + b.sample_s, wait_s=a.wait_s + b.wait_s)
        return _Done(out, self.generated + other.generated, self.mask_s + other.mask_s)


def _row_matchers(seqs, ahead: list[int]) -> list:
    """Each logits row's grammar matcher (None: unconstrained, or stopped since its launch): a sequence's own
    for its next token; for a drafted position `ahead` past it, a copy advanced over the drafts before it."""
    out, prev = [], {}
    for seq, j in zip(seqs, ahead):
        if seq.matcher is None or seq.status is Status.FINISHED or not seq.constrained_from(seq.num_tokens):
            out.append(None)
            continue
        m = seq.matcher if j == 0 else prev[seq.seq_id].deep_copy()
        if j:
            m.consume_token(seq.draft[j - 1])
        prev[seq.seq_id] = m
        out.append(m)
    return out


def _decodes_only(sched: SchedulerOutput) -> bool:
    """A step of one-token decodes and verify chunks only (no prompt): what speculation's cost model fits."""
    return bool(sched.chunks) and all(c.draft for c in sched.chunks[sched.num_decodes:])


_NOTHING_DONE = _Done(RunnerOutput(), 0, 0.0)


def engine_info(rt: EngineRuntime, config: EngineConfig, max_len: int) -> EngineInfo:
    mc = rt.model_config
    return EngineInfo(source=rt.source, device=str(rt.device), device_type=rt.device.type, dtype=str(rt.dtype),
                      kv_dtype=str(rt.kv_dtype), max_model_len=max_len, max_num_seqs=rt.max_num_seqs,
                      max_num_batched_tokens=rt.max_num_batched_tokens, num_blocks=rt.num_blocks,
                      block_size=config.block_size, weight_bytes=rt.weight_bytes, load_s=rt.load_s,
                      hidden_size=mc.hidden_size, vocab_size=mc.vocab_size, pooling=rt.pooling,
                      generation=rt.generation, quantization=getattr(rt.model, "quantization", "none"),
                      vision=rt.image_processor is not None,
                      packed_weights=getattr(rt.model, "packed_weights", False),
                      batch_invariant=getattr(rt.model, "batch_invariant", False))


def vision_spec(model) -> VisionSpec | None:
    """What a vision-language model (engine/models/vision_language.py) says of its prompts; None for a text model."""
    if not hasattr(model, "encode_images"):
        return None
    mrope = (model.spatial_merge_size, model.vision_start_token_id) if model.uses_mrope else None
    return VisionSpec(model.image_token_id, mrope)

