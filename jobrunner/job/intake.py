"""Row intake: dataset rows -> PendingRows, each row's prompt built, tokenized and made a request once.
A kind whose prompt is token ids the row holds (`prompt_ids_column`, jobs/tokens.py) gets that column's
value instead: its rows are neither rendered nor tokenized.

On the way a row may end before it reaches the planner, written by the emitter: an id already in
the output is skipped, a repeated id or a row that fails to build is an error row, a copy of an
earlier row (dedup) gets that row's result, a result-cache hit is written at once (or held for the
worker that claims its unit: `hits_now` false)."""
from __future__ import annotations

import logging
from array import array
from dataclasses import replace
from typing import Iterator

from jobrunner.idset import IdSet
from jobrunner.job.pending import Interrupted, PendingRow
from jobs import RowError

log = logging.getLogger("jobrunner")

# Rows held back for one batch lookup in the result cache are not packed yet (Python int lists, ~36
# bytes a token): long prompts end a batch before its row count does.
HELD_TOKENS = 4_000_000


class Intake:
    """The rows a job runs. `reader()` gives batches of dataset Rows; `done_ids` / `failed_ids` are the
    output's at open (IdSets, or empty); `limit` is --limit; `show_prompt` logs the first prompt."""

    def __init__(self, reader, *, builder, kind, tokenizer, reuse, emit, stats, done_ids=None, failed_ids=None,
                 limit: int | None = None, show_prompt: bool = False, hits_now: bool = True, stop=None):
        self.reader, self.builder, self.kind, self.tokenizer = reader, builder, kind, tokenizer
        self.reuse, self.emit, self.stats = reuse, emit, stats
        self.done_ids, self.failed_ids = done_ids, failed_ids
        self.limit, self.show_prompt, self.hits_now, self.stop = limit, show_prompt, hits_now, stop
        self.seen = IdSet()                 # ids read in this run, bar those done at open
        # the column holding the prompt's token ids, for a kind that takes them from the row; else None
        self.ids_column = getattr(kind, "prompt_ids_column", None)

    def rows(self) -> Iterator[PendingRow]:
        """The rows that go on to the planner, in dataset order; the others are written on the way."""
        read, held, held_tokens = 0, [], 0     # held: rows waiting for a batch lookup in the result cache
        for batch in self.reader():
            if self.limit is not None:
                batch = batch[:max(0, self.limit - read)]
            read += len(batch)
            for row, req, notes in self._requests(self._not_done(batch)):
                held.append((row, req, notes))
                held_tokens += len(req.prompt_token_ids)
            if len(held) >= self.reuse.batch_rows or held_tokens >= HELD_TOKENS:
                yield from self._past_cache(held)
                held, held_tokens = [], 0
            if self.stop is not None and self.stop.is_set():
                raise Interrupted
            if self.limit is not None and read >= self.limit:
                break
        yield from self._past_cache(held)

    def _not_done(self, batch: list) -> list:
        """The batch less the ids done at open, however often they appear (their rows are all written)."""
        if not self.done_ids:
            return batch
        done = self.done_ids.contains_many([row.id for row in batch])
        skipped = [row.id for row, d in zip(batch, done) if d]
        self.stats.rows_skipped += len(skipped)
        if skipped and self.failed_ids:
            self.stats.rows_skipped_failed += sum(self.failed_ids.contains_many(skipped))
        return [row for row, d in zip(batch, done) if not d]

    def _requests(self, batch: list):
        """(row, request, notes) of the rows that run; an id's first row runs, each later one is a
        duplicate error row; a copy of an earlier row (dedup) gets its result, now or when it is done."""
        repeats = self.seen.add_new([row.id for row in batch])
        ready = []
        for row, repeat in zip(batch, repeats):
            if repeat:
                self.stats.duplicate_ids += 1
                self.emit.error(row, f"duplicate id {row.id!r}: an earlier row has the same id")
            elif row.error is not None:
                self.emit.error(row, row.error)
            elif (prompt := self._prompt(row)) is not None:
                ready.append((row, *prompt))
        for (row, _, _), ids in zip(ready, self._prompt_ids(ready)):
            try:
                req, notes = self.kind.request(row.id, ids, row.data, row.options)
            except RowError as e:
                self.emit.error(row, str(e))
                continue
            runs, result = self.reuse.admit(row, req, notes)
            if runs:
                yield row, req, notes
            elif result is not None:
                self.emit.output(row, notes, result, reused=True)

    def _prompt(self, row) -> tuple[str, bool] | tuple[object, None] | None:
        """(text, whether special tokens are added), or None: the row's error is written. For a kind
        that takes its prompt ids from the row: (the ids column's value as the row holds it, None),
        nothing rendered (the kind checks the value)."""
        if self.ids_column is not None:
            return (row.data or {}).get(self.ids_column), None
        try:
            text, special = self.builder.render(row.data, row.options)
        except RowError as e:
            self.emit.error(row, str(e))
            return None
        if self.show_prompt:        # --show-prompt: the first prompt only
            log.info("first prompt (row %s), exactly as the tokenizer gets it:\n%s", row.id, text)
            self.show_prompt = False
        return text, special

    def _prompt_ids(self, ready) -> list:
        """Each ready row's prompt ids: the row's own (nothing tokenized), else its text's, batch-tokenized."""
        if self.ids_column is not None:
            return [ids for _, ids, _ in ready]
        return self._encode(ready)

    def _encode(self, ready) -> list[list[int]]:
        """Batch tokenization (all cores), grouped by whether special tokens are added."""
        out = [None] * len(ready)
        for special in (True, False):
            idx = [i for i, r in enumerate(ready) if r[2] == special]
            if idx:
                texts = [ready[i][1] for i in idx]
                for i, ids in zip(idx, self.tokenizer.encode_batch(texts, add_special_tokens=special)):
                    out[i] = ids
        return out

    def _past_cache(self, held: list) -> Iterator[PendingRow]:
        """Rows past the result cache, looked up together (a lookup's cost is per bucket and shard
        touched, so a large batch amortizes it). A hit is written at once, unless every worker must plan
        the same rows (data-parallel: it waits in the plan like any row and is served when its unit is
        claimed). The rest go on, their token ids packed."""
        found = self.reuse.fetch([row.id for row, _, _ in held])
        sampling = None
        for row, req, notes in held:
            out = found.get(row.id)
            if out is not None and self.hits_now:
                self.emit.finish(row, notes, out, from_cache=True)
                continue
            if out is not None:
                self.reuse.hold(row.id, out)
            if req.sampling == sampling:        # usually every row's: keep one object, not one a row
                req = replace(req, sampling=sampling)
            sampling = req.sampling
            yield PendingRow(row, array("I", req.prompt_token_ids), replace(req, prompt_token_ids=[]), notes)
