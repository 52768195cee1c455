"""Runs one job: dataset rows -> job kind -> planner -> engine -> writer, with stats.

Every row read ends as exactly one output row (n > 1: one per sample), with its output or
its error. Rows already in the output are skipped, so running the same job again resumes it.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from array import array
from dataclasses import dataclass, replace

from engine import EngineFailure
from jobrunner.output.columns import input_names, reserved_columns
from jobrunner.config.job import JobConfig
from jobrunner.job.exit_codes import (  # noqa: F401 (the codes: imported from here too)
    EXIT_CONFIG, EXIT_ERROR_RATE, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_STORAGE, empty_verdict, rows_verdict)
from jobrunner.idset import IdSet
from jobrunner.threads import FixedThreads

log = logging.getLogger("jobrunner")

# Rows held back for one batch lookup in the result cache are not packed yet (Python int lists, ~36
# bytes a token): long prompts end a batch before its row count does.
HELD_TOKENS = 4_000_000
IDLE_S = 0.005          # a remote work source with nothing yet and an idle engine: the wait between looks


@dataclass
class JobResult:
    exit_code: int
    stats: dict
    output: str
    error: str | None = None        # why the job could not finish (exit 1) or failed (exit 3), in one line


@dataclass(slots=True)
class PendingRow:
    """A row inside the planner or the engine: its request's parameters and, apart, its prompt's token
    ids as uint32 (4 bytes a token, not ~36 in a list of ints) while it waits; the engine gets them as a
    list when the row is submitted. `notes` are what the kind's request step noted for its columns step
    (jobs.row.RowNotes): they go where the row goes, so no kind keeps per-row state."""
    row: object                     # jobrunner.dataset.Row
    tokens: array                   # array("I"): the prompt's token ids
    request: object                 # the engine Request, its prompt_token_ids empty (they are `tokens`)
    notes: object                   # jobs.row.RowNotes
    raw: array | None = None        # the tokenizer's ids, where the kind's request changed them (truncation),
                                    # kept only by a work source that ships its rows (the Ray driver's)

    def engine_request(self):
        return replace(self.request, prompt_token_ids=self.tokens.tolist())


@dataclass(slots=True)
class ShippedRow:
    """A row planned in another process (a Ray job's driver): the row and its tokenizer ids, from which
    the kind makes its request and notes again (None: a copy, its leader's ids); a copy carries the
    notes the driver made for it (its own truncation)."""
    row: object                     # jobrunner.dataset.Row
    ids: array | None
    notes: object = None            # jobs.row.RowNotes


@dataclass(slots=True)
class ShippedUnit:
    """A work unit planned in another process, its rows with it: the leaders, in the unit's order, and
    the copies (dedup) each leader's result is written for."""
    rows: list[ShippedRow]
    copies: dict[str, list[ShippedRow]]

    @property
    def items(self) -> list[str]:
        return [s.row.id for s in self.rows]

    @property
    def size(self) -> int:
        """Its rows to write: the leaders and their copies."""
        return len(self.rows) + sum(map(len, self.copies.values()))


class _Interrupted(Exception):
    pass


def exit_code_of(cfg: JobConfig, summary: dict, stats, where: str | None = None) -> tuple[int, str | None]:
    """(code, why not ok) over every row of the output (exit_codes.rows_verdict); an empty dataset warns.
    where: the failed rows' place, for the warning (the output directory unless the rows are in memory)."""
    code, why = rows_verdict(cfg, summary, where or cfg.output_url, stats.rows)
    if not stats.rows and not stats.rows_skipped:     # no row read: an empty dataset
        code = empty_verdict(cfg, code)
    return code, why


class Job:
    """One worker's share of a job, built whole from its parts (jobrunner/job/build.py: open_job). Its
    work source says which units it runs: alone (world 1) every one; in a data-parallel job every worker
    reads and plans the same dataset identically, runs only the units its work source claims, and writes
    its own parts; only rank 0 writes rows that never reach the planner."""

    def __init__(self, cfg: JobConfig, *, reader, kind, builder, planner, engine, reuse, writer, work, progress,
                 stats, manifest: dict, fmt: str, max_in_flight: int | None = None, stop=None, threads=None):
        self.cfg, self.fmt, self.manifest = cfg, fmt, manifest
        self.reader = reader                # () -> batches of Rows (jobrunner.dataset.read_rows, or rows in memory)
        self.kind, self.builder, self.planner = kind, builder, planner
        self.engine, self.reuse, self.writer = engine, reuse, writer
        self.work, self.progress, self.stats = work, progress, stats
        self.threads = threads or FixedThreads()     # the CPU threads, following the machine's load or fixed
        # requests queued in the engine ahead of it
        self.max_in_flight = max_in_flight or max(2 * engine.info.max_num_seqs, 64)
        self.reserved = reserved_columns(kind.result_columns)
        self.input_names: dict[tuple, dict[str, str]] = {}
        self.pending: dict[str, PendingRow] = {}   # row id -> the row, while in the planner or the engine
        self.seen = IdSet()                 # ids read in this run, bar those done at open (writer.done_ids)
        self.stop = stop if stop is not None else threading.Event()   # a signal asked the job to stop (or a Ray driver: ray_worker.py)
        self.counters_before = engine.counters()   # an engine may serve several jobs

    @property
    def rank(self) -> int:
        return self.work.rank

    # --- the run ------------------------------------------------------------------------------

    def run(self) -> JobResult:
        cfg = self.cfg
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
            return self._lost(lost)
        run = self._run_record(interrupted)
        if self.work.world > 1:     # a data-parallel worker: its coordinator sums the runs and marks the job complete
            if not interrupted:
                self.writer.close()
            return JobResult(EXIT_INTERRUPTED if interrupted else EXIT_OK, run, cfg.output_url)
        summary = self._summary(run)        # every row in the output
        if interrupted:
            self.writer.write_stats(summary)
            log.warning("interrupted: %d rows written; run the same command again to resume", self.stats.rows)
            return JobResult(EXIT_INTERRUPTED, summary, cfg.output_url)
        self.writer.close(summary)
        if cfg.output.output_format == "openai-batch" and not self._in_memory:     # its files, their line counts in the summary
            from jobrunner.openai.batch import finish_openai_output
            finish_openai_output(cfg.output_url, summary)
        code, why = exit_code_of(cfg, summary, self.stats, "the results" if self._in_memory else None)
        return JobResult(code, summary, cfg.output_url, error=why)

    def _lost(self, failure: Exception) -> JobResult:
        """The engine failed mid-job (EngineFailure): the rows written so far stay, the job ends with
        EXIT_FAILED and the result's `error` says why (the CLI prints it). A data-parallel worker re-raises, so that its process ends and its coordinator
        hands the rows it had not written to the workers left."""
        if self.work.world > 1:
            raise failure
        run = self._run_record(interrupted=False)     # as for lost data-parallel workers
        summary = self._summary(run)
        self.writer.write_stats(summary)
        rows = self.stats.rows
        message = (f"{failure}; the {rows} row{'s' if rows != 1 else ''} this run finished "
                   f"{'are' if rows != 1 else 'is'} written and kept: run the same command again to resume")
        return JobResult(EXIT_FAILED, summary, self.cfg.output_url, error=message)

    def _run_units(self) -> bool:
        """Submit the units this worker claims and step the engine until all are done; True if interrupted."""
        engine = self.engine
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            units = self.planner.units(self._items())
            for unit, mine in self.work.units(units, lambda key: self.pending[key].tokens):
                if unit is None:        # a remote work source has nothing yet: run what is in flight
                    self._idle()
                    continue
                if not mine:
                    for key in unit.items:
                        del self.pending[key]
                        self.reuse.drop(key)
                    continue
                if isinstance(unit, ShippedUnit):
                    self._adopt(unit)
                cached = self.reuse.take(unit.items)     # data-parallel: hits held for the claiming worker
                for key in unit.items:
                    if key in cached:
                        p = self.pending.pop(key)
                        self._finish(p.row, p.notes, cached[key], from_cache=True)
                    else:
                        engine.add_request(self.pending[key].engine_request())
                while engine.num_in_flight >= self.max_in_flight:
                    self._step()
            while engine.has_unfinished():
                self._step()
        except _Interrupted:
            return True
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        return False

    @property
    def _in_memory(self) -> bool:
        """The writer keeps the rows in memory (output.RowSink): no output directory."""
        return getattr(self.writer, "in_memory", False)

    def _summary(self, run: dict) -> dict:
        """The summary of every row of the output (its parts and earlier runs; or the RowSink's rows)."""
        from jobrunner.output.summary import job_summary, summary_of
        if self._in_memory:
            return summary_of(self.writer.tables, self.manifest["config"], [run])
        return job_summary(self.cfg.output_url, self.manifest["config"], run)

    def _idle(self) -> None:
        if self.engine.has_unfinished():
            self._step()
        else:
            if self.stop.is_set():
                raise _Interrupted
            self.progress.update(self.stats)
            time.sleep(IDLE_S)

    def _adopt(self, unit: ShippedUnit) -> None:
        """A shipped unit's rows become this job's: each leader's request and notes (made again from the
        tokenizer's ids, as the driver made them), its copies waiting for its result with their own notes."""
        for s in unit.rows:
            row = s.row
            req, notes = self.kind.request(row.id, s.ids.tolist(), row.data, row.options)
            notes = s.notes or notes        # a copy running alone (its leader's result was written) keeps its own
            self.reuse.adopt(row, req, [(c.row, c.notes) for c in unit.copies.get(row.id, ())])
            self.pending[row.id] = PendingRow(row, array("I", req.prompt_token_ids), replace(req, prompt_token_ids=[]),
                                              notes)

    def _run_record(self, interrupted: bool) -> dict:
        """This run's own figures (time, throughput, engine counters, cost)."""
        cfg, engine, info = self.cfg, self.engine, self.engine.info
        return self.stats.summary(
            device=info.device, devices=cfg.parallel.tensor_parallel, model_weight_bytes=info.weight_bytes,
            quantization=engine.config.quantization, prefix=self.planner.prefix,      # as resolved (auto)
            engine_counters=(engine.counters() - self.counters_before).as_dict(),
            device_hourly_cost=cfg.output.device_hourly_cost, load_s=info.load_s, interrupted=interrupted)

    def _on_signal(self, signum, frame):
        if self.stop.is_set():          # a second Ctrl-C: stop at once
            raise KeyboardInterrupt
        self.stop.set()
        log.warning("signal %d: finishing what is written, then exiting", signum)

    # --- rows in ---------------------------------------------------------------------------------

    def _items(self):
        """Rows -> plan items; rows that can't run become error rows at once."""
        from jobs import RowError

        cfg, read, show = self.cfg, 0, self.cfg.prompt.show_prompt     # show: --show-prompt, until one is logged
        held, held_tokens = [], 0       # rows waiting for a batch lookup in the result cache (_past_cache)
        for batch in self.reader():
            if cfg.input.limit is not None:
                batch = batch[:max(0, cfg.input.limit - read)]
            read += len(batch)
            # An id done at open is skipped, however often it appears (its rows are all written);
            # otherwise its first row runs and each later one becomes a duplicate error row.
            if self.writer.done_ids:
                done = self.writer.done_ids.contains_many([row.id for row in batch])
                skipped = [row.id for row, d in zip(batch, done) if d]
                batch = [row for row, d in zip(batch, done) if not d]
                self.stats.rows_skipped += len(skipped)
                if skipped and self.writer.failed_ids:
                    self.stats.rows_skipped_failed += sum(self.writer.failed_ids.contains_many(skipped))
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
                    text, special = self.builder.render(row.data, row.options)
                except RowError as e:
                    self._write_error(row, str(e))
                    continue
                if show:
                    log.info("first prompt (row %s), exactly as the tokenizer gets it:\n%s", row.id, text)
                    show = False
                ready.append((row, text, special))
            for (row, _, _), ids in zip(ready, self._encode(ready)):
                try:
                    req, notes = self.kind.request(row.id, ids, row.data, row.options)
                except RowError as e:
                    self._write_error(row, str(e))
                    continue
                runs, result = self.reuse.admit(row, req, notes)
                if not runs:        # a copy of an earlier row: it gets that row's result, now or when it is done
                    if result is not None:
                        self._emit_output(row, notes, result, reused=True)
                    continue
                # the tokenizer's ids go along only to be shipped (a worker makes the request again from them)
                raw = ids if not self.work.runs_rows and req.prompt_token_ids != ids else None
                held.append((row, req, notes, raw))
                held_tokens += len(req.prompt_token_ids) + (len(raw) if raw is not None else 0)
            if len(held) >= self.reuse.batch_rows or held_tokens >= HELD_TOKENS:
                yield from self._past_cache(held)
                held, held_tokens = [], 0
            if self.stop.is_set():
                raise _Interrupted
            if cfg.input.limit is not None and read >= cfg.input.limit:
                break
        yield from self._past_cache(held)

    def _past_cache(self, held: list):
        """Rows (row, request, notes, the tokenizer's ids where a shipped row's request changed them) past
        the result cache, looked up together (a lookup's cost is per bucket and shard touched, so a large
        batch amortizes it). A hit is done at once, unless the work source says otherwise (SharedUnits:
        every worker must plan the same rows, so a hit waits in the planner like any row and is served
        when its unit is claimed). The rest go on to the planner."""
        found = self.reuse.fetch([row.id for row, *_ in held])
        sampling = None
        for row, req, notes, raw in held:
            out = found.get(row.id)
            if out is not None and self.work.hits_now:
                self._finish(row, notes, out, from_cache=True)
                continue
            if out is not None:
                self.reuse.hold(row.id, out)
            if req.sampling == sampling:        # usually every row's: keep one object, not one a row
                req = replace(req, sampling=sampling)
            sampling = req.sampling
            tokens = array("I", req.prompt_token_ids)
            raw = array("I", raw) if raw is not None else None
            self.pending[row.id] = PendingRow(row, tokens, replace(req, prompt_token_ids=[]), notes, raw)
            yield self.planner.item(row.id, req.adapter, req.prompt_token_ids)    # grouped by LoRA adapter

    def _encode(self, ready) -> list[list[int]]:
        """Batch tokenization (all cores), grouped by whether special tokens are added."""
        tok, out = self.engine.tokenizer, [None] * len(ready)
        for special in (True, False):
            idx = [i for i, r in enumerate(ready) if r[2] == special]
            if idx:
                for i, ids in zip(idx, tok.encode_batch([ready[i][1] for i in idx], add_special_tokens=special)):
                    out[i] = ids
        return out

    # --- rows out ----------------------------------------------------------------------------

    def _step(self) -> None:
        if self.stop.is_set():
            raise _Interrupted
        for out in self.engine.step():
            p = self.pending.pop(out.id)
            self._finish(p.row, p.notes, out)
        self.writer.maybe_flush()       # rows that finished a while ago reach a part even when few come
        self.progress.update(self.stats)
        self.threads.tick()

    def _finish(self, row, notes, out, from_cache: bool = False) -> None:
        """A row's result (from the engine or the cache), and the same result for its waiting copies
        (each with its own notes)."""
        copies = self.reuse.finished(row.id, out, from_cache)
        self._emit_output(row, notes, out, reused=from_cache)
        for copy, copy_notes in copies:
            self._emit_output(copy, copy_notes, out, reused=True)

    def _emit_output(self, row, notes, out, reused: bool) -> None:
        """The row's output rows: its own columns and notes (a copy's, not its leader's) over `out`."""
        base = self._base(row)
        base.update(prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens, queue_s=out.queue_s,
                    prefill_s=out.prefill_s, decode_s=out.decode_s, error=out.error, reused=reused)
        if reused:      # not computed here: no prefix-cache hits, no timings (null, not the original's)
            base.update(dict.fromkeys(("cached_tokens", "queue_s", "prefill_s", "decode_s")))
        rows = []
        for cols in self.kind.columns(out, row.data, row.options, notes):
            r = dict(base)
            r.update(cols)
            if r["error"] is None and r.get("finish_reason") == "error":     # every failed row says why
                r["error"] = "the row ended in an error that gave no message"
            if r["error"] is not None:
                r["finish_reason"] = "error"
            rows.append(r)
        self._emit(rows)

    def _base(self, row) -> dict:
        """The id and the row's input columns, renamed where a result column takes the name."""
        data = row.data or {}
        keys = tuple(k for k in data if k != self.cfg.input.id_column)
        names = self.input_names.get(keys)
        if names is None:       # JSONL rows may differ in their keys; most share one set
            names = self.input_names[keys] = input_names(keys, self.reserved)
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
