"""Row intake: dataset rows -> PendingRows, each row's prompt built, tokenized and made a request once.
A kind whose prompt is token ids the row holds (`prompt_ids_column`, jobs/tokens.py) gets that column's
value instead: its rows are neither rendered nor tokenized.

On the way a row may end before it reaches the planner, written by the emitter: a row already in
the output is skipped (by its id's occurrence: output/done.py, so a duplicate's error row never makes
its id done), a repeated id or a row that fails to build is an error row, a copy of an
earlier row (dedup) gets that row's result, a result-cache hit is written at once (or held for the
worker that claims its unit: `hits_now` false).

A row's images (its --image-column values, its messages' image parts: jobs.base.PromptBuilder.prompt) are
fetched, decoded and prepared by the model's image processor in a thread pool (jobrunner/images): rows
are staged a batch at a time (rendered, tokenized), their images submitted to the pool a bounded number
ahead, and each row is made a request, in dataset order, once its images are ready: the tokens expanded
at each image token (processor.expand), the request's engine.ImageInputs placed on them. A bad image (not
found, not decodable, too large, a URL that fails after its retries) is that row's error; the job goes on."""
from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import wait
from dataclasses import replace
from typing import TYPE_CHECKING, Iterator

from jobrunner.images import NO_PIXELS, ImageError, RowImages, column_images, image_inputs
from jobrunner.pipeline.pending import Interrupted, PendingRow, plan_tokens
from jobrunner.output.done import Occurrences, duplicate_error, repeat_key
from jobrunner.jobs import RowError
from jobrunner.jobs.messages import has_images

if TYPE_CHECKING:
    import threading

    from jobrunner.engine import Tokenizer
    from jobrunner.cache.reuse import Reuse
    from jobrunner.common.idset import IdSet
    from jobrunner.common.run_stats import JobStats
    from jobrunner.images import ImagePrep
    from jobrunner.jobs import PromptBuilder
    from jobrunner.jobs.kind import JobKind
    from jobrunner.pipeline.emit import Emitter

log = logging.getLogger("jobrunner")

# Rows held back for one batch lookup in the result cache are not packed yet (Python int lists, ~36
# bytes a token): long prompts end a batch before its row count does.
HELD_TOKENS = 4_000_000
NO_IMAGES_MODEL = "this model takes no images"
STOP_POLL_S = 0.2           # how often a wait for a row's images looks at the job's stop flag


class _Staged:
    """A row read, its prompt rendered and tokenized, its images (`values`) perhaps being prepared."""
    __slots__ = ("row", "ids", "values", "future")

    def __init__(self, row, ids, values=(), future=None):
        self.row, self.ids, self.values, self.future = row, ids, values, future


class Intake:
    """The rows a job runs. `reader()` gives batches of dataset Rows; `done_ids` / `failed_ids` /
    `done_repeats` are the output's at open (IdSets, or empty: output/done.py); `limit` is --limit;
    `show_prompt` logs the first prompt; `context`: the engine's, past which a request is an error row.
    image_column: --image-column; images: the job's jobrunner.images.ImagePrep (None: the model takes
    no images, and a row with one is an error row)."""

    def __init__(self, reader, *, builder: PromptBuilder, kind: JobKind, tokenizer: Tokenizer, reuse: Reuse,
                 emit: Emitter, stats: JobStats, done_ids: IdSet | None = None, failed_ids: IdSet | None = None,
                 done_repeats: IdSet | None = None, limit: int | None = None, show_prompt: bool = False, hits_now: bool = True,
                 stop: threading.Event | None = None, image_column: str | None = None, images: ImagePrep | None = None,
                 context: int | None = None):
        self.reader, self.builder, self.kind, self.tokenizer = reader, builder, kind, tokenizer
        self.reuse, self.emit, self.stats = reuse, emit, stats
        self.done_ids, self.failed_ids, self.done_repeats = done_ids, failed_ids, done_repeats
        self.limit, self.show_prompt, self.hits_now, self.stop = limit, show_prompt, hits_now, stop
        self.occurrences = Occurrences()    # each row's occurrence of its id, every row read counted
        # the column holding the prompt's token ids, for a kind that takes them from the row; else None
        self.ids_column = getattr(kind, "prompt_ids_column", None)
        self.image_column, self.images = image_column, images
        self.context = context      # the engine's: a longer request is refused here, never planned (its rule)
        self.image_token = getattr(getattr(images, "processor", None), "image_token_id", None)
        # images prepared at once at most (the pool's threads, each a few ahead); staged ones to submit
        self.ahead = 4 * images.workers if images is not None else 0
        self._to_submit: deque[_Staged] = deque()
        self._in_flight = 0

    def rows(self) -> Iterator[PendingRow]:
        """The rows that go on to the planner, in dataset order; the others are written on the way."""
        read, held, held_tokens = 0, [], 0     # held: rows waiting for a batch lookup in the result cache
        staged: deque[_Staged] = deque()       # rows read whose requests are not made yet (their images)
        try:
            for batch in self.reader():
                if self.limit is not None:
                    batch = batch[:max(0, self.limit - read)]
                read += len(batch)
                staged.extend(self._stage(*self._not_done(batch)))
                for made in self._requests(staged, final=False):
                    held.append(made)
                    held_tokens += len(made[1].prompt_token_ids)
                if len(held) >= self.reuse.batch_rows or held_tokens >= HELD_TOKENS:
                    yield from self._past_cache(held)
                    held, held_tokens = [], 0
                if self.stop is not None and self.stop.is_set():
                    raise Interrupted
                if self.limit is not None and read >= self.limit:
                    break
            held.extend(self._requests(staged, final=True))
            yield from self._past_cache(held)
        finally:
            if self.images is not None:     # images not started are dropped; interrupted: downloads cut
                self.images.close(stopping=self.stop is not None and self.stop.is_set())

    def _not_done(self, batch: list) -> tuple[list, list[int]]:
        """(the batch's rows not in the output at open, each one's occurrence of its id): an id's own row is
        done when written, a duplicate's error row when that occurrence's is (output/done.py)."""
        ids = [row.id for row in batch]
        numbers = self.occurrences.number(ids)
        if not self.done_ids and not self.done_repeats:
            return batch, numbers
        done = self.done_ids.contains_many(ids) if self.done_ids else [False] * len(ids)
        repeats_done = self.done_repeats or ()
        done = [d if k == 1 else repeat_key(id, k) in repeats_done for id, k, d in zip(ids, numbers, done)]
        own = [id for id, k, d in zip(ids, numbers, done) if d and k == 1]
        repeats = sum(1 for k, d in zip(numbers, done) if d and k > 1)
        self.stats.rows_skipped += len(own) + repeats
        self.stats.rows_skipped_failed += repeats       # a duplicate's row is an error row
        if own and self.failed_ids:
            self.stats.rows_skipped_failed += sum(self.failed_ids.contains_many(own))
        kept = [i for i, d in enumerate(done) if not d]
        return [batch[i] for i in kept], [numbers[i] for i in kept]

    def _stage(self, batch: list, numbers: list[int]) -> list[_Staged]:
        """The batch's rows that go on, each with its prompt's ids and image values; an id's first row goes
        on, each later one (`numbers`: its occurrence) is a duplicate error row; a row whose prompt fails is
        an error row."""
        ready = []
        for row, k in zip(batch, numbers):
            if k > 1:
                self.stats.duplicate_ids += 1
                self.emit.error(row, duplicate_error(row.id))
            elif row.error is not None:
                self.emit.error(row, row.error)
            elif (prompt := self._prompt(row)) is not None:
                ready.append((row, *prompt))
        staged = [_Staged(row, ids, values) for (row, _, _, values), ids in zip(ready, self._prompt_ids(ready))]
        self._to_submit.extend(s for s in staged if s.values)
        return staged

    def _requests(self, staged: deque, final: bool):
        """(row, request, notes, RowImages or None) of the staged rows that run, in order, as far as their
        images are ready (final: all, waiting for them); a copy of an earlier row (dedup) gets its result,
        now or when it is done. Rows whose images are still being prepared, with none left to submit
        behind them, wait for the next batch (the pool is kept busy meanwhile)."""
        while staged:
            self._submit()
            head = staged[0]
            if head.values and not final and not head.future.done() and not self._to_submit:
                return
            staged.popleft()
            prepared = None
            if head.values:
                self._in_flight -= 1
                try:
                    prepared = self._images_of(head)
                except ImageError as e:
                    self.stats.image_errors += 1
                    self.emit.error(head.row, str(e))
                    continue
            made = self._request(head.row, head.ids, head.values, prepared)
            if made is not None:
                yield made

    def _images_of(self, staged: _Staged) -> list:
        """A staged row's prepared images, waited for while the job is not stopped: SIGTERM during a slow
        download interrupts the job at once (Interrupted), not after the download."""
        while not wait([staged.future], timeout=STOP_POLL_S).done:
            if self.stop is not None and self.stop.is_set():
                raise Interrupted
        return staged.future.result()

    def _submit(self) -> None:
        """Rows' images to the pool, up to `ahead` being prepared at once."""
        while self._to_submit and self._in_flight < self.ahead:
            s = self._to_submit.popleft()
            s.future = self.images.submit(s.values)
            self._in_flight += 1

    def _request(self, row, ids, values, prepared):
        """(row, request, notes, RowImages or None) of a row that runs, or None: written already (an error, a
        copy's result)."""
        offsets = ()
        try:
            if prepared:
                ids, offsets = self._expanded(ids, prepared)
            elif self.image_token is not None and self.ids_column is None and self.image_token in ids:
                raise RowError(f"the prompt holds the image token ({self.images.processor.image_token}) but the "
                               f"row gives no image")
            req, notes = self.kind.request(row.id, ids, row.data, row.options)
            if prepared:
                req = _with_images(req, notes, ids, image_inputs(prepared, offsets))
        except RowError as e:
            self.emit.error(row, str(e))
            return None
        too_long = req.context_error(self.context) if self.context else None
        if too_long:        # its prompt_tokens as the engine would count them; no work: not computed (stats.py)
            self.emit.error(row, too_long, prompt_tokens=notes.pair_prompt_tokens or len(req.prompt_token_ids))
            return None
        if prepared:
            self.stats.images += len(prepared)
            self.stats.image_tokens += sum(im.length for im in req.images)
        runs, result = self.reuse.admit(row, req, notes)
        if not runs:
            if result is not None:
                self.emit.output(row, notes, result, reused=True)
            return None
        if not prepared:
            return row, req, notes, None
        images = RowImages.kept(self.images, values, prepared, self.image_token)
        return row, replace(req, images=tuple(replace(im, pixels=NO_PIXELS) for im in req.images)), notes, images

    def _expanded(self, ids: list[int], prepared) -> tuple[list[int], list[int]]:
        """The prompt's ids with each image token repeated for its image's tokens, and each run's offset."""
        processor = self.images.processor
        try:
            return processor.expand(ids, [p.image for p in prepared])
        except ValueError as e:
            found = sum(1 for t in ids if t == processor.image_token_id)
            raise RowError(f"images: the prompt holds {found} image tokens ({processor.image_token}) for its "
                           f"{len(prepared)} images ({e}); a raw prompt (no chat template) writes the token "
                           f"once per image itself") from None

    def _prompt(self, row) -> tuple[str, bool, tuple] | tuple[object, None, tuple] | None:
        """(text, whether special tokens are added, image values), or None: the row's error is written. For a
        kind that takes its prompt ids from the row: (the ids column's value as the row holds it, None, ()),
        nothing rendered (the kind checks the value)."""
        if self.ids_column is not None:
            return (row.data or {}).get(self.ids_column), None, ()
        if self.stop is not None and self.stop.is_set():
            raise Interrupted       # SIGTERM waits for one render at most (engine.load.chat_template.MAX_SECONDS)
        try:
            column = column_images((row.data or {}).get(self.image_column)) if self.image_column else ()
        except ImageError as e:
            self.emit.error(row, f"--image-column {self.image_column!r}: {e}")
            return None
        if self.images is None and (why := images_refused(row, column, self.image_column,
                                                          self.builder.spec.messages_column)):
            self.emit.error(row, why)
            return None
        try:
            if self.images is None:     # a text model (a row with images failed above): the prompt as always
                text, special, values = *self.builder.render(row.data, row.options), ()
            else:
                p = self.builder.prompt(row.data, row.options, column)
                text, special, values = p.text, p.special, p.images
        except RowError as e:
            self.emit.error(row, str(e))
            return None
        if self.show_prompt:        # --show-prompt: the first prompt only
            log.info("first prompt (row %s), exactly as the tokenizer gets it:\n%s", row.id, text)
            self.show_prompt = False
        return text, special, values

    def _prompt_ids(self, ready) -> list:
        """Each ready row's prompt ids: the row's own (nothing tokenized), else its text's, batch-tokenized."""
        if self.ids_column is not None:
            return [ids for _, ids, _, _ in ready]
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
        claimed). The rest go on, their token ids packed (planner ids at image positions: job/pending.py)."""
        found = self.reuse.fetch([row.id for row, _, _, _ in held])
        sampling = None
        for row, req, notes, images in held:
            out = found.get(row.id)
            if out is not None and self.hits_now:
                if images is not None:
                    images.release()        # the row never runs
                self.emit.finish(row, notes, out, from_cache=True)
                continue
            if out is not None:
                self.reuse.hold(row.id, out)
            if req.sampling == sampling:        # usually every row's: keep one object, not one a row
                req = replace(req, sampling=sampling)
            sampling = req.sampling
            yield PendingRow(row, plan_tokens(req.prompt_token_ids, req.images), replace(req, prompt_token_ids=[]),
                             notes, images)


def images_refused(row, column: tuple, image_column: str | None, messages_column: str | None) -> str | None:
    """Why a row cannot run on a model that takes no images (it has some: `column`, its --image-column
    values, or image parts in the messages the prompt is made of), or None."""
    if column:
        return f"--image-column {image_column!r}: {NO_IMAGES_MODEL}"
    options, data = row.options, row.data or {}
    msgs = options.messages if options.messages is not None else \
        data.get(messages_column) if messages_column and options.prompt is None else None
    if isinstance(msgs, list) and has_images(msgs):
        kind = next(p["type"] for m in msgs if isinstance(m, dict) and isinstance(m.get("content"), list)
                    for p in m["content"] if isinstance(p, dict) and p.get("type") in ("image", "image_url"))
        return f"message content part of type {kind!r}: {NO_IMAGES_MODEL}"
    return None


def _with_images(req, notes, ids: list[int], images: tuple):
    """req with its images, placed on its prompt as the kind left it (ids: the prompt before the kind): a
    prompt --truncate-prompt cut keeps its images only where their runs are whole (a left cut moves them)."""
    if notes.truncated_tokens:
        kept = req.prompt_token_ids
        left = len(ids) - len(kept)
        if kept == ids[left:]:                  # its start was cut: the runs move with it
            images = tuple(replace(im, offset=im.offset - left) for im in images)
        if any(im.offset < 0 or im.offset + im.length > len(kept) for im in images):
            raise RowError(f"--truncate-prompt would cut the prompt's images ({notes.truncated_tokens} tokens "
                           f"dropped): images are kept whole or the row fails; raise the context or lower "
                           f"--max-tokens")
    return replace(req, images=images)
