"""The coordinator of a data-parallel job, in the launcher or in a thread of torchrun's rank 0.

A round is one pass over the rows not yet in the output. The finished-units set is the output
directory itself: a row is done when a part file holding it exists (parts appear by atomic rename).
When a worker dies, the units it claimed but had not written are lost for that round; the
coordinator then runs another round with the survivors (launcher mode, `retry`), whose plans cover
exactly the rows still missing, so every id is written exactly once. Under torchrun a lost rank
ends the job instead (see torchrun.py).
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from functools import partial

from jobrunner.config.job import JobConfigError
from jobrunner.config.sections import EngineOptions, InputOptions, OutputOptions, ParallelOptions

from jobrunner.pipeline.ending import JobResult, verdict, write_ending
from jobrunner.pipeline.exit_codes import EXIT_CONFIG, EXIT_INTERRUPTED, EXIT_OK, EXIT_STORAGE
from jobrunner.pipeline.progress import progress_line
from jobrunner.output import OutputError, prepare_output
from jobrunner.output.summary import job_summary
from jobrunner.parallel import protocol
from jobrunner.parallel.protocol import EXIT_FAILED
from jobrunner.parallel.merged_stats import merge_stats

log = logging.getLogger("jobrunner")

MAX_ROUNDS = 4                  # launcher mode: passes over the remaining rows after workers died


class Coordinator:
    """Opens rounds, hands nothing out itself (the counter does), notices lost workers, and at the end
    merges the workers' stats, writes _stats.json and marks the manifest complete. Of the job's options
    it reads the output's (`output`, at `output_url`), the dataset's (`input`: an empty one's verdict),
    and those its merged record names (`engine`, `parallel`: merge_stats')."""

    def __init__(self, input: InputOptions, output: OutputOptions, output_url: str, engine: EngineOptions,
                 parallel: ParallelOptions, *, store, world: int, alive, retry: bool, fingerprint: dict):
        self.input, self.output, self.output_url = input, output, output_url
        self.engine, self.parallel = engine, parallel
        self.store, self.world, self.alive, self.retry = store, world, alive, retry
        self.fingerprint = fingerprint      # cfg.fingerprint_fields(resolved.adapter_hashes)
        self.stopping = False
        self.local_done = False
        self.result: JobResult | None = None
        self.error: Exception | None = None
        self.bar = None
        self.last_log = self.last_progress = self.started = time.time()

    def run_in_thread(self) -> None:
        try:
            self.result = self.run()
        except Exception as e:  # noqa: BLE001 - handed to the main thread by raise_or
            self.error = e
            self._abort(EXIT_CONFIG if isinstance(e, JobConfigError) else EXIT_FAILED)

    def raise_or(self, result: JobResult | None) -> JobResult:
        if self.error is not None:
            raise self.error
        return result

    def run(self) -> JobResult:

        url = self.output_url
        loaded = self._gather(partial(protocol.get_loaded, self.store), range(self.world))
        self._config_errors(loaded)
        if not loaded:
            self._abort(EXIT_FAILED)
            return self._fail("no worker started; see the workers' logs above")
        try:
            prepare_output(url, {"config": self.fingerprint}, overwrite=self.output.overwrite)
        except OutputError as e:
            self._abort(EXIT_CONFIG)
            raise JobConfigError(str(e)) from None
        members, results, lost, complete, start, manifest, rounds = sorted(loaded), [], [], False, None, {}, 0
        for r in range(MAX_ROUNDS if self.retry else 1):
            if self.stopping:
                break
            rounds = r + 1
            protocol.open_round(self.store, r, {k: i for i, k in enumerate(members)})
            ready = self._gather(partial(protocol.get_ready, self.store, r), members)
            self._config_errors(ready)
            manifest = next(iter(ready.values()), manifest)
            start = start or time.time()
            protocol.set_go(self.store, r)
            done = self._gather(partial(protocol.get_result, self.store, r), sorted(ready), progress=r)
            results += done.values()
            gone = [k for k in members if k not in done]
            lost += gone
            members = sorted(done)
            codes = {v["exit_code"] for v in done.values()}
            if self.stopping or codes & {EXIT_INTERRUPTED, EXIT_STORAGE, EXIT_CONFIG}:
                break
            if not gone:
                complete = True
                break
            log.warning("worker%s %s stopped before finishing; %s", "s" if len(gone) > 1 else "",
                        ", ".join(map(str, gone)), "the rows they had not written go to the workers left"
                        if self.retry and members else "the job ends unfinished: run it again to resume")
            if not members:
                break
        if self.bar is not None:
            self.bar.close()
        run = merge_stats(results, self.engine, self.parallel, self.output,
                          wall_s=time.time() - (start or time.time()), devices=self.world,
                          rounds=rounds, lost=lost)
        code = self._exit_code(results, run, complete)
        run["interrupted"] = run["interrupted"] or code == EXIT_INTERRUPTED
        summary = job_summary(url, self.fingerprint, run)     # as one worker's job does
        why = None
        if code == EXIT_OK:         # over every row of the output, as one worker's job does
            code, why = verdict(self.input, self.output, url, summary, run["rows"])
        self._finish(summary, manifest, complete, code, rounds)
        return JobResult(code, summary, url, error=why)

    # -- steps

    def _gather(self, read, ranks, progress: int | None = None) -> dict[int, dict]:
        """Each rank's value (`read(rank)`, None while unset: a protocol.get_*), until all have one or are
        gone (dead, or its heart stopped)."""
        waiting, got, poll = set(ranks), {}, 0.02
        while waiting:
            for k in sorted(waiting):
                value = read(k)
                if value is not None:
                    got[k] = value
                    waiting.discard(k)
                elif not self.alive(k) and read(k) is None:    # nor did it answer just before it went
                    waiting.discard(k)
            if progress is not None and time.time() - self.last_progress >= 1.0:
                self.last_progress = time.time()
                self._progress(progress, list(got) + list(waiting))
            if waiting:
                time.sleep(poll)
                poll = min(poll * 1.5, 0.1)
        return got

    def _config_errors(self, replies: dict) -> None:
        errors = [v["error"] for v in replies.values() if v.get("error")]
        if errors:
            self._abort(EXIT_CONFIG)
            raise JobConfigError(errors[0])

    def _abort(self, code: int) -> None:
        try:
            protocol.set_abort(self.store, code)
        except Exception:  # noqa: BLE001 - the store is gone: nobody is waiting
            pass

    def _fail(self, message: str) -> JobResult:
        log.error("%s", message)
        return JobResult(EXIT_FAILED, {}, self.output_url)

    def _progress(self, r: int, ranks: list[int]) -> None:
        rows = skipped = failed = tokens = 0
        total = None
        for k in ranks:
            p = protocol.get_progress(self.store, r, k)
            if p is not None:
                rows, failed, tokens = rows + p["rows"], failed + p["failed"], tokens + p["tokens"]
                skipped, total = max(skipped, p["skipped"]), p["total"]
        done = rows + skipped
        if self.bar is None and sys.stderr.isatty() and threading.current_thread() is threading.main_thread():
            from tqdm import tqdm       # tqdm loads only for a terminal's bar
            self.bar = tqdm(total=total, unit="row", dynamic_ncols=True)
        if self.bar is not None:
            self.bar.total = total
            self.bar.n = done
            self.bar.set_postfix_str(f"{len(ranks)} workers, {failed} errors", refresh=False)
            self.bar.refresh()
        elif time.time() - self.last_log >= 30:
            self.last_log = time.time()
            elapsed = max(time.time() - self.started, 1e-9)
            log.info("%s", progress_line(done, total, rows, elapsed, failed=failed, tokens_per_s=tokens / elapsed,
                                         more=f"{len(ranks)} workers"))

    def _exit_code(self, results: list[dict], summary: dict, complete: bool) -> int:
        codes = {v["exit_code"] for v in results}
        if EXIT_STORAGE in codes:
            return EXIT_STORAGE
        if EXIT_INTERRUPTED in codes or self.stopping:
            return EXIT_INTERRUPTED
        if not complete:
            return EXIT_FAILED
        return EXIT_OK          # the rows' verdict comes with the job's summary (run)

    def _finish(self, summary: dict, manifest: dict, complete: bool, code: int, rounds: int) -> None:
        """Stats always; the manifest marked complete only when every round's rows were written."""
        m = {"config": self.fingerprint, **{k: v for k, v in manifest.items() if k != "error"}}
        write_ending(self.output, self.output_url, summary, m, complete, interrupted=code == EXIT_INTERRUPTED, by_workers=True)
        protocol.end_rounds(self.store, rounds, code)
        # the store may live in this process (torchrun without an agent): leave only once every worker has read it
        deadline = time.time() + 60
        while protocol.exits(self.store) < len(self._members_alive()) and time.time() < deadline:
            time.sleep(0.05)

    def _members_alive(self) -> list[int]:
        return [k for k in range(self.world) if self.alive(k)]
