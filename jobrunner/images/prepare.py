"""A row's images made ready for the engine: fetched (sources.py), decoded (decode.py) and prepared by the
model's image processor (engine.ImageProcessor: resized, normalized, cut into patches), in a thread pool
off the engine's thread, and their pixels kept until their row is submitted.

    prep = ImagePrep(processor, limits, dataset=cfg.input.dataset)
    future = prep.submit(values)            # a row's image values -> [Prepared, ...] (or ImageError)
    ids, offsets = processor.expand(ids, [p.image for p in prepared])
    inputs = image_inputs(prepared, offsets)            # engine.ImageInput each: pixels, grid, key, offset, length

Memory: a prepared image is float32 patches, ~19 KB per image token for Qwen2-VL (~20 MB for a 1024x768
photo), and a row waits in its planning window (up to 50,000 rows) before it runs. So a waiting row
(job/pending.PendingRow) keeps its images as `RowImages`: their values (already in the row's data, or a
URL) and their keys, the pixels in a `PixelStore` of bounded size shared by the job's rows. A row whose
pixels the store let go prepares them again when it is submitted (the loop's thread: correct, slower).
"""
from __future__ import annotations

import hashlib
import queue
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from jobrunner import engine
from jobrunner.engine import ImageInput
from jobrunner.images.decode import decode
from jobrunner.images.sources import Fetcher, ImageError, ImageLimits, source_of
from jobrunner.common.threads import available_cores

if TYPE_CHECKING:
    from jobrunner.engine import PreparedImage

PIXEL_BUDGET = 4 << 30          # bytes of prepared pixels kept for waiting rows; past it the oldest go
NO_PIXELS = np.zeros(0, np.float32)     # a waiting row's ImageInput.pixels (RowImages holds the real ones)


@dataclass(frozen=True, eq=False)
class Prepared:
    """One prepared image (engine.PreparedImage: pixels, grid, num_tokens; a test's fake processor's
    likeness) and its key (engine.image_key)."""
    image: PreparedImage
    key: int

    @property
    def num_tokens(self) -> int:
        return self.image.num_tokens


def image_key(prepared) -> int:
    """engine.image_key (63 bits of blake2b over the grid and the pixels); the same rule here while the
    engine's vision package is not there (a test's fake processor)."""
    try:
        return engine.image_key(prepared)
    except (AttributeError, ImportError):
        h = hashlib.blake2b(digest_size=8)
        h.update(np.asarray(prepared.grid, np.int64).tobytes())
        h.update(np.ascontiguousarray(prepared.pixels).tobytes())
        return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


class ImagePrep:
    """The job's image work: `processor` (the engine's ImageProcessor), a Fetcher within `limits` (relative
    paths from `dataset`'s location), and a pool of `workers` threads (default: half the cores, 1 to 8:
    decoding and resizing release the GIL, and the engine computes on the rest)."""

    def __init__(self, processor, limits: ImageLimits = ImageLimits(), dataset: str | None = None,
                 workers: int | None = None, fetcher: Fetcher | None = None, budget: int = PIXEL_BUDGET):
        self.processor, self.limits = processor, limits
        self.fetcher = fetcher or Fetcher(limits, dataset)
        self.workers = workers or max(1, min(8, available_cores() // 2))
        self.store = PixelStore(budget)
        self._pool: DaemonPool | None = None

    def submit(self, values: tuple) -> Future:
        """A row's images prepared in the pool: the future's result is [Prepared, ...] in order, or ImageError."""
        if self._pool is None:
            self._pool = DaemonPool(self.workers, "jobrunner-images")
        return self._pool.submit(self.prepared, values)

    def prepared(self, values: tuple) -> list[Prepared]:
        """A row's images prepared here; ImageError naming the first that fails ("image 2 (x.png): ...")."""
        return [self.prepare_one(v, i, len(values)) for i, v in enumerate(values)]

    def prepare_one(self, value, index: int = 0, count: int = 1) -> Prepared:
        source = None
        try:
            source = source_of(value)
            image = decode(self.fetcher.read(source), self.limits.max_pixels, source.describe())
            prepared = self.processor.prepare(image)
        except ImageError as e:
            raise ImageError(f"{_which(index, count)}{e}") from None
        except Exception as e:  # noqa: BLE001 - the processor on a strange image: that row's error
            name = f" ({source.describe()})" if source is not None else ""
            raise ImageError(f"{_which(index, count)}the image processor failed{name}: {type(e).__name__}: {e}") \
                from None
        return Prepared(prepared, image_key(prepared))

    def close(self, stopping: bool = False) -> None:
        """Stop the pool; images not started are dropped (the job ends or was interrupted). stopping: the
        job was interrupted: downloads under way end now too (a row's images are not prepared again)."""
        if stopping:
            self.fetcher.cancel()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


class DaemonPool:
    """`workers` daemon threads running submitted calls (Futures). Not concurrent.futures' pool: its
    threads are joined when the interpreter exits, so a fetch stuck on a slow server would hold an
    interrupted job past its end; these never do."""

    def __init__(self, workers: int, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, fn, *args) -> Future:
        future = Future()
        self._queue.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        """Calls not started are cancelled; the threads end after the ones they run."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in self._threads:
            self._queue.put(None)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - the caller's future holds it
                future.set_exception(e)


def _which(index: int, count: int) -> str:
    return f"image {index + 1} of {count}: " if count > 1 else "image: "


def image_inputs(prepared: list[Prepared], offsets: list[int]) -> tuple[ImageInput, ...]:
    """The engine's ImageInputs of a row's prepared images, their placeholder runs at `offsets`."""
    return tuple(ImageInput(p.image.pixels, tuple(p.image.grid), p.key, off, p.num_tokens)
                 for p, off in zip(prepared, offsets))


class PixelStore:
    """Prepared pixels by image key, for the rows waiting to be submitted: each key counts the rows that
    will take it (`put` one more, `take` one less: forgotten at none). At most `budget` bytes of pixels:
    past it the oldest are let go, and their rows prepare them again (RowImages.pixels). The loop's thread
    uses it; a lock all the same (a Ray driver ships rows from another)."""

    def __init__(self, budget: int = PIXEL_BUDGET):
        self.budget, self.bytes = budget, 0
        self._rows: dict[int, int] = {}                             # key -> rows still to take it
        self._pixels: OrderedDict[int, np.ndarray] = OrderedDict()  # key -> pixels, oldest first
        self._lock = threading.Lock()
        self.evicted = 0            # pixels let go for room (their rows prepare them again)

    def put(self, key: int, pixels: np.ndarray) -> None:
        with self._lock:
            self._rows[key] = self._rows.get(key, 0) + 1
            if key in self._pixels:
                return
            self._pixels[key] = pixels
            self.bytes += pixels.nbytes
            while self.bytes > self.budget and self._pixels:
                _, old = self._pixels.popitem(last=False)
                self.bytes -= old.nbytes
                self.evicted += 1

    def take(self, key: int) -> np.ndarray | None:
        """The pixels of `key` for one row (None: let go, or never put); one row fewer to keep them for."""
        with self._lock:
            left = self._rows.get(key, 0) - 1
            pixels = self._pixels.get(key)
            if left > 0:
                self._rows[key] = left
                return pixels
            self._rows.pop(key, None)
            if pixels is not None:
                del self._pixels[key]
                self.bytes -= pixels.nbytes
            return pixels

    def __len__(self) -> int:
        return len(self._rows)


class RowImages:
    """A waiting row's images (job/pending.PendingRow.images): their values (to prepare again where the
    store let their pixels go), their keys, and the image token id their placeholder runs hold.
    `request(req, tokens)` is the engine's request: the token id back at each run, each ImageInput's
    pixels in it. Pickled (a Ray job's shipped rows), it takes its pixels along, and no store."""
    __slots__ = ("values", "keys", "token_id", "prep", "ready")

    def __init__(self, values: tuple, keys: tuple, token_id: int, prep: ImagePrep | None,
                 ready: tuple | None = None):
        self.values, self.keys, self.token_id, self.prep, self.ready = values, keys, token_id, prep, ready

    @classmethod
    def kept(cls, prep: ImagePrep, values: tuple, prepared: list[Prepared], token_id: int) -> RowImages:
        """A row's images, their pixels in prep's store until the row takes them."""
        for p in prepared:
            prep.store.put(p.key, p.image.pixels)
        return cls(tuple(values), tuple(p.key for p in prepared), token_id, prep)

    def pixels(self) -> list[np.ndarray]:
        """Each image's pixels: those it carries, else the store's (taken), else prepared again."""
        if self.ready is not None:
            return list(self.ready)
        out = [self.prep.store.take(k) for k in self.keys]
        n = len(self.keys)
        for i, key in enumerate(self.keys):
            if out[i] is None:
                again = self.prep.prepare_one(self.values[i], i, n)
                if again.key != key:
                    raise ImageError(f"{_which(i, n)}it changed while its row waited (another image is there now)")
                out[i] = again.image.pixels
        return out

    def request(self, req, tokens):
        """The engine Request of a waiting row: `req` (its images without pixels) with its prompt's token
        ids (`tokens`: planner ids at image positions, job/pending.py) and its images' pixels."""
        ids = tokens.tolist()
        for im in req.images:
            ids[im.offset:im.offset + im.length] = [self.token_id] * im.length
        images = tuple(replace(im, pixels=p) for im, p in zip(req.images, self.pixels()))
        return replace(req, prompt_token_ids=ids, images=images)

    def release(self) -> None:
        """The row will not run (a result-cache hit): the store keeps its pixels for one row fewer."""
        if self.ready is None:
            for key in self.keys:
                self.prep.store.take(key)

    def copy(self) -> RowImages:
        """The same images for a copy of the row that runs too: one more row to keep them for."""
        if self.ready is None:
            for key in self.keys:
                pixels = self.prep.store.take(key)
                if pixels is not None:          # back, for this row and the copy
                    self.prep.store.put(key, pixels)
                    self.prep.store.put(key, pixels)
        return RowImages(self.values, self.keys, self.token_id, self.prep, self.ready)

    def __getstate__(self):
        return {"values": self.values, "keys": self.keys, "token_id": self.token_id, "ready": tuple(self.pixels())}

    def __setstate__(self, state):
        self.values, self.keys, self.token_id, self.ready = (state["values"], state["keys"], state["token_id"],
                                                             state["ready"])
        self.prep = None
