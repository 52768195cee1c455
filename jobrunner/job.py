"""Runs one job: dataset rows -> job kind -> planner -> engine -> writer, with stats.

Every row read ends as exactly one output row (n > 1: one per sample), with its output or
its error. Rows already in the output are skipped, so running the same job again resumes it.
"""
from __future__ import annotations

import logging
import signal
from array import array
from dataclasses import dataclass, replace

from engine import EngineCounters, EngineFailure
from jobrunner.columns import input_names, reserved_columns
from jobrunner.config import JobConfig, JobConfigError
from jobrunner.exit_codes import (  # noqa: F401 (the codes: imported from here too)
    EXIT_CONFIG, EXIT_ERROR_RATE, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_STORAGE, empty_verdict, rows_verdict)
from jobrunner.job_manifest import job_manifest
from jobrunner.idset import IdSet
from jobrunner.planner import PlanItem, PrefixStats, WorkUnit, plan, prefix_stats
from jobrunner.planner.window import split_windows
from jobrunner.preload import finish_done
from jobrunner.progress import Progress
from jobrunner.stats import JobStats

log = logging.getLogger("jobrunner")

# A planning window: rows read, tokenized and ordered together. Rows bound it for usual prompts
# (~80 MB at 50,000 rows); tokens bound it for long ones (~8 bytes a token while a row waits:
# its encoding for the planner and its packed request; ~0.5 GB at 64M tokens).
WINDOW_ROWS = 50_000
WINDOW_TOKENS = 64_000_000
# Rows held back for one batch lookup in the result cache are not packed yet (Python int lists, ~36
# bytes a token): long prompts end a batch before its row count does.
HELD_TOKENS = 4_000_000


def _open_cache(cfg: JobConfig):
    """The result cache's store (None without --cache); a URL that cannot be opened exits 2."""
    from jobrunner.cache import open_store
    try:
        return open_store(cfg.cache)
    except ValueError as e:
        raise JobConfigError(str(e)) from None


@dataclass
class JobResult:
    exit_code: int
    stats: dict
    output: str
    error: str | None = None        # why the job could not finish (exit 1) or failed (exit 3), in one line


class _Interrupted(Exception):
    pass


class Job:
    """One worker's share of a job. Alone (world 1) it runs every row. In a data-parallel job every
    worker reads and plans the same dataset identically, runs only the work units `claim(index)`
    grants it, and writes its own parts; only rank 0 writes rows that never reach the planner."""

    max_in_flight: int | None = None    # requests queued in the engine ahead of it; None: max(2 * max_num_seqs, 64)
    progress_factory = Progress         # data-parallel workers report to their coordinator instead

    def __init__(self, cfg: JobConfig, rank: int = 0, world: int = 1, claim=None):
        self.cfg = cfg
        self.rank, self.world = rank, world
        self.claim = claim or (lambda index: True)
        self.stop_requested = False

    # --- set-up: everything that can fail fails here, before any work ------------------------

    def prepare(self, engine=None) -> None:
        from jobrunner import checks, preload
        from jobrunner.output import ResultWriter

        cfg = self.cfg
        cfg.validate()
        self.fmt, self.columns = checks.check_dataset(cfg)
        self.template = checks.check_template(cfg, self.columns)
        checks.check_constraint(cfg)
        preload.check_sampling(cfg)         # --n > 1 at the checkpoint's greedy default
        self.cache = _open_cache(cfg)
        preload.check_empty(cfg, self.fmt)  # --fail-on-empty: exit 2 before the output directory exists
        checks.check_output(cfg)            # before the model: loading one can take minutes
        self.rows_done = None if engine is not None or self.world > 1 else preload.rows_all_done(cfg, self.fmt)
        if self.rows_done is not None:      # a rerun with nothing left to do: no model (run: finish_done)
            self.engine = None
            return
        self.engine = engine or checks.load_engine(cfg)
        checks.check_dimensions(cfg, self.engine.info)
        from jobrunner.openai_kinds import job_for
        from jobs import PromptBuilder
        # unset sampling options: the checkpoint's; the context: for truncation
        spec = replace(cfg.job_spec(self.engine.info.generation.sampling), context=self.engine.info.max_model_len)
        try:        # an OpenAI batch file: each line's url picks its kind (jobs.routed)
            self.job = job_for(self.fmt, cfg, spec, self.engine.tokenizer, self.engine.info.pooling, self.engine.config.model)
        except ValueError as e:         # embed: a checkpoint pooling we don't reproduce
            raise JobConfigError(str(e)) from None
        self.builder = PromptBuilder(spec, self.engine.tokenizer, self.template)
        self.reserved = reserved_columns(self.job.result_columns)
        self._input_names: dict[tuple, dict[str, str]] = {}
        prefix = "part" if self.world == 1 else f"part-r{self.rank}"
        self.manifest = job_manifest(cfg, self.engine.info, self.engine.config.model, self.fmt, self.rank)
        checks.check_same_commit(cfg, self.manifest)
        self.writer = checks.open_writer(cfg, self.manifest, ResultWriter, prefix, self.job, self.engine)

    # --- the run ------------------------------------------------------------------------------

    def run(self) -> JobResult:
        cfg, engine = self.cfg, self.engine
        if engine is None:                  # every row is in the output already (prepare)
            return finish_done(self)
        self.stats = JobStats()
        self.prefix = PrefixStats(block_size=cfg.block_size)
        # row id -> (row, request): rows inside the planner or the engine. While a row waits in the planner
        # its request's token ids are packed as uint32 bytes (4 bytes a token, not ~36 in a list of ints),
        # unpacked when it goes to the engine; see _items and _submit.
        self.pending: dict[str, tuple] = {}
        self._sampling = None                   # the last request's SamplingParams, shared by equal ones
        self.seen = IdSet()                     # ids read in this run, bar those done at open (writer.done_ids)
        self.progress = self.progress_factory(total=self._total_rows(), counters=engine.counters)
        self.reuse = self._reuse()
        counters_before = engine.counters()   # an engine may serve several jobs
        lost = None
        try:
            interrupted = self._run_units()
        except EngineFailure as e:          # a tensor-parallel rank died: the engine is gone, its rows with it
            lost, interrupted = e, False
        finally:
            self.reuse.close()
        self.writer.flush()                 # the rows that did finish are kept: a rerun skips them
        self.progress.close()
        if lost is not None:
            return self._lost(lost, counters_before)
        run = self._run_record(counters_before, interrupted)
        if self.world > 1:      # a data-parallel worker: its coordinator sums the runs and marks the job complete
            if not interrupted:
                self.writer.close()
            return JobResult(EXIT_INTERRUPTED if interrupted else EXIT_OK, run, cfg.output_url)
        from jobrunner.summary import job_summary
        summary = job_summary(cfg.output_url, cfg.fingerprint_fields(), run)     # every row in the output
        if interrupted:
            self.writer.write_stats(summary)
            log.warning("interrupted: %d rows written; run the same command again to resume", self.stats.rows)
            return JobResult(EXIT_INTERRUPTED, summary, cfg.output_url)
        self.writer.close(summary)
        if cfg.output_format == "openai-batch":     # its files, their line counts in the summary
            from jobrunner.openai_batch import finish_openai_output
            finish_openai_output(cfg.output_url, summary)
        code, why = self._exit_code(summary)
        return JobResult(code, summary, cfg.output_url, error=why)

    def _lost(self, failure: Exception, counters_before: EngineCounters) -> JobResult:
        """The engine failed mid-job (EngineFailure): the rows written so far stay, the job ends with
        EXIT_FAILED and the result's `error` says why (the CLI prints it). A data-parallel worker re-raises, so that its process ends and its coordinator
        hands the rows it had not written to the workers left."""
        if self.world > 1:
            raise failure
        from jobrunner.summary import job_summary
        run = self._run_record(counters_before, interrupted=False)     # as for lost data-parallel workers
        summary = job_summary(self.cfg.output_url, self.cfg.fingerprint_fields(), run)
        self.writer.write_stats(summary)
        rows = self.stats.rows
        message = (f"{failure}; the {rows} row{'s' if rows != 1 else ''} this run finished "
                   f"{'are' if rows != 1 else 'is'} written and kept: run the same command again to resume")
        return JobResult(EXIT_FAILED, summary, self.cfg.output_url, error=message)

    def _run_units(self) -> bool:
        """Submit the units this worker claims and step the engine until all are done; True if interrupted."""
        engine = self.engine
        max_in_flight = self.max_in_flight or max(2 * engine.info.max_num_seqs, 64)
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            for index, unit in enumerate(self._units()):
                if not self.claim(index):
                    for key in unit.items:
                        del self.pending[key]
                        self.reuse.drop(key)
                    continue
                cached = self.reuse.take(unit.items)     # data-parallel: hits held for the claiming worker
                for key in unit.items:
                    if key in cached:
                        self._finish(self.pending.pop(key)[0], cached[key], from_cache=True)
                    else:
                        self._submit(self.pending[key][1])
                while engine.num_in_flight >= max_in_flight:
                    self._step()
            while engine.has_unfinished():
                self._step()
        except _Interrupted:
            return True
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        return False

    def _run_record(self, counters_before: EngineCounters, interrupted: bool) -> dict:
        """This run's own figures (time, throughput, engine counters, cost)."""
        cfg, engine, info = self.cfg, self.engine, self.engine.info
        return self.stats.summary(
            device=info.device, devices=cfg.tensor_parallel, model_weight_bytes=info.weight_bytes,
            quantization=engine.config.quantization, prefix=self.prefix,      # as resolved (auto)
            engine_counters=(engine.counters() - counters_before).as_dict(),
            device_hourly_cost=cfg.device_hourly_cost, load_s=info.load_s, interrupted=interrupted)

    def _exit_code(self, summary: dict) -> tuple[int, str | None]:
        """(code, why not ok) over every row of the output (exit_codes.rows_verdict); an empty dataset warns."""
        code, why = rows_verdict(self.cfg, summary, self.cfg.output_url, self.stats.rows)
        if not self.stats.rows and not self.stats.rows_skipped:     # no row read: an empty dataset
            code = empty_verdict(self.cfg, code)
        return code, why

    def _on_signal(self, signum, frame):
        if self.stop_requested:          # a second Ctrl-C: stop at once
            raise KeyboardInterrupt
        self.stop_requested = True
        log.warning("signal %d: finishing what is written, then exiting", signum)

    def _total_rows(self) -> int | None:
        from jobrunner.dataset import count_rows
        try:
            n = count_rows(self.cfg.dataset, self.fmt)
        except Exception:
            return None
        return min(n, self.cfg.limit) if (n is not None and self.cfg.limit) else n

    # --- rows in ---------------------------------------------------------------------------------

    def _items(self):
        """Rows -> plan items; rows that can't run become error rows at once."""
        from jobrunner.dataset import read_rows
        from jobs import RowError

        cfg, read, show = self.cfg, 0, self.cfg.show_prompt     # show: --show-prompt, until one is logged
        held, held_tokens = [], 0       # rows waiting for a batch lookup in the result cache (_past_cache)
        for batch in read_rows(cfg.dataset, self.fmt, id_column=cfg.id_column, batch_rows=1024):
            if cfg.limit is not None:
                batch = batch[:max(0, cfg.limit - read)]
            read += len(batch)
            # An id done at open is skipped, however often it appears (its rows are all written);
            # otherwise its first row runs and each later one becomes a duplicate error row.
            if self.writer.done_ids:
                done = self.writer.done_ids.contains_many([row.id for row in batch])
                batch = [row for row, d in zip(batch, done) if not d]
                self.stats.rows_skipped += len(done) - len(batch)
            repeats = self.seen.add_new([row.id for row in batch])
            ready = []
            for row, repeat in zip(batch, repeats):
                if repeat:
                    self.stats.duplicate_ids += 1
                    self._write_error(row, f"duplicate id {row.id!r}: an earlier row has the same id")
                    continue
                if row.error is not None:
                    self._write_error(row, row.error)
                    continue
                try:
                    text, special = self.builder.render(row.data)
                except RowError as e:
                    self._write_error(row, str(e))
                    continue
                if show:
                    log.info("first prompt (row %s), exactly as the tokenizer gets it:\n%s", row.id, text)
                    show = False
                ready.append((row, text, special))
            for (row, _, _), ids in zip(ready, self._encode(ready)):
                try:
                    req = self.job.request(row.id, ids, row.data)
                except RowError as e:
                    self._write_error(row, str(e))
                    continue
                runs, result = self.reuse.admit(row, req)
                if not runs:        # a copy of an earlier row: it gets that row's result, now or when it is done
                    if result is not None:
                        self._emit_output(row, result, reused=True)
                    continue
                held.append((row, req))
                held_tokens += len(req.prompt_token_ids)
            if len(held) >= self.reuse.batch_rows or held_tokens >= HELD_TOKENS:
                yield from self._past_cache(held)
                held, held_tokens = [], 0
            if self.stop_requested:
                raise _Interrupted
            if cfg.limit is not None and read >= cfg.limit:
                break
        yield from self._past_cache(held)

    def _past_cache(self, held: list):
        """Rows (row, request) past the result cache, looked up together (a lookup's cost is per bucket
        and shard touched, so a large batch amortizes it). A hit is done at once, unless data-parallel:
        then every worker must plan the same rows, so a hit waits in the planner like any row and is
        served when its unit is claimed. The rest go on to the planner."""
        found = self.reuse.fetch([row.id for row, _ in held])
        for row, req in held:
            out = found.get(row.id)
            if out is not None and self.world == 1:
                self._finish(row, out, from_cache=True)
                continue
            if out is not None:
                self.reuse.hold(row.id, out)
            if req.sampling == self._sampling:      # usually every row's: keep one object, not one a row
                req.sampling = self._sampling
            self._sampling = req.sampling
            tokens, req.prompt_token_ids = req.prompt_token_ids, array("I", req.prompt_token_ids).tobytes()
            self.pending[row.id] = (row, req)
            yield PlanItem(row.id, self.cfg.lora.plan_tokens(req.adapter, tokens))     # grouped by LoRA adapter

    def _submit(self, req) -> None:
        tokens = array("I")
        tokens.frombytes(req.prompt_token_ids)
        req.prompt_token_ids = tokens.tolist()      # the engine takes a list
        self.engine.add_request(req)

    def _encode(self, ready) -> list[list[int]]:
        """Batch tokenization (all cores), grouped by whether special tokens are added."""
        tok, out = self.engine.tokenizer, [None] * len(ready)
        for special in (True, False):
            idx = [i for i, r in enumerate(ready) if r[2] == special]
            if idx:
                for i, ids in zip(idx, tok.encode_batch([ready[i][1] for i in idx], add_special_tokens=special)):
                    out[i] = ids
        return out

    def _units(self):
        cfg = self.cfg
        if cfg.plan:
            yield from plan(self._items(), window_rows=WINDOW_ROWS, block_size=cfg.block_size, stats=self.prefix,
                            window_tokens=WINDOW_TOKENS)
            return
        # unplanned: dataset order; stats still measured per window
        for window in split_windows(self._items(), WINDOW_ROWS, WINDOW_TOKENS, lambda it: len(it.tokens)):
            self.prefix.merge(prefix_stats([it.tokens for it in window], block_size=cfg.block_size))
            for i, it in enumerate(window, 1):
                yield WorkUnit([it.key], len(it.tokens), len(it.tokens), window_end=i == len(window))

    # --- rows out ----------------------------------------------------------------------------

    def _step(self) -> None:
        if self.stop_requested:
            raise _Interrupted
        for out in self.engine.step():
            self._finish(self.pending.pop(out.id)[0], out)
        self.writer.maybe_flush()       # rows that finished a while ago reach a part even when few come
        self.progress.update(self.stats)

    def _finish(self, row, out, from_cache: bool = False) -> None:
        """A row's result (from the engine or the cache), and the same result for its waiting copies."""
        copies = self.reuse.finished(row.id, out, from_cache)
        self._emit_output(row, out, reused=from_cache)
        for copy in copies:
            self._emit_output(copy, out, reused=True)

    def _emit_output(self, row, out, reused: bool) -> None:
        if out.id != row.id:            # a copy: the kind keys its per-row state (truncation) by the row's id
            out = replace(out, id=row.id)
        base = self._base(row)
        base.update(prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens, queue_s=out.queue_s,
                    prefill_s=out.prefill_s, decode_s=out.decode_s, error=out.error, reused=reused)
        if reused:      # not computed here: no prefix-cache hits, no timings (null, not the original's)
            base.update(dict.fromkeys(("cached_tokens", "queue_s", "prefill_s", "decode_s")))
        rows = []
        for cols in self.job.columns(out, row.data):
            r = dict(base)
            r.update(cols)
            if r["error"] is None and r.get("finish_reason") == "error":     # every failed row says why
                r["error"] = "the row ended in an error that gave no message"
            if r["error"] is not None:
                r["finish_reason"] = "error"
            rows.append(r)
        self._emit(rows)

    def _reuse(self):
        from jobrunner.reuse import Reuse
        cfg, model = self.cfg, None
        if self.cache is not None:
            from jobrunner.cache import job_model_key
            model = job_model_key(self.engine.config.model, self.engine.info, self.engine.config.quantization,
                                  cfg.kv_cache_dtype)
        return Reuse(self.stats, cfg.kind, dedup=cfg.dedup, window_rows=WINDOW_ROWS, store=self.cache,
                     mode=cfg.cache_mode, model=model, adapters=cfg.lora.content_hashes())

    def _base(self, row) -> dict:
        """The id and the row's input columns, renamed where a result column takes the name."""
        data = row.data or {}
        keys = tuple(k for k in data if k != self.cfg.id_column)
        names = self._input_names.get(keys)
        if names is None:       # JSONL rows may differ in their keys; most share one set
            names = self._input_names[keys] = input_names(keys, self.reserved)
        base = {"id": row.id if row.id_value is None else row.id_value}     # the id as the input types it
        base.update((names[k], data[k]) for k in keys)
        return base

    def _write_error(self, row, message: str) -> None:
        if self.rank != 0:
            return
        line = (row.data or {}).get("line") if self.fmt == "openai-batch" else None
        if line is not None and not message.startswith("line "):    # as the reader's own errors name it
            message = f"line {line}: {message}"
        r = self._base(row)
        r.update(output=None, finish_reason="error", prompt_tokens=0, cached_tokens=0, completion_tokens=0,
                 queue_s=0.0, prefill_s=0.0, decode_s=0.0, error=message, reused=False)
        self._emit([r])

    def _emit(self, rows: list[dict]) -> None:
        self.stats.add_row(rows[0])
        for extra in rows[1:]:
            self.stats.add_sample(extra)
        self.writer.write(rows)
