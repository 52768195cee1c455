"""A row on its way through a job: made once by the intake (jobrunner/pipeline/intake.py), held while it
waits in the planner or the engine, shipped as it is to another process (a Ray job's workers).

The planner orders rows by `PendingRow.tokens` (jobrunner/planner: a trie over uint32 ids), so two rows
share a planned prefix only where those ids are equal. A prompt's image is a run of one image token id,
the same for every image; so at image positions `tokens` holds planner ids of the image instead, derived
from its key and the position in its run (`image_plan_ids`). The id ranges never meet:

    [0, vocab)                 text token ids (every vocabulary is far below 2**31)
    [2**31, 2**32 - 2**16)     image positions: IMAGE_PLAN_BASE + hash(image key, position) % IMAGE_PLAN_SPAN
    [2**32 - 2**16, 2**32)     a LoRA adapter's mark before its rows' ids (config/lora.py: PLAN_MARK - index)

Equal images at equal offsets plan together (their KV is shared, as the engine's block hashes share it);
different images part at their first position (but for a 2**-31 chance, which costs a plan's order only:
the engine's prefix cache keys images by their whole key). `engine_request()` puts the image token id
back (images.prepare.RowImages.request); the engine never sees a planner id."""
from __future__ import annotations

from array import array
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from jobrunner.engine import Request
    from jobrunner.dataset.rows import Row
    from jobrunner.images.prepare import RowImages
    from jobrunner.jobs.row import RowNotes

IMAGE_PLAN_BASE = 2**31
IMAGE_PLAN_SPAN = 2**31 - 2**16
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def image_plan_ids(key: int, length: int) -> np.ndarray:
    """The planner ids of an image's `length` positions (uint32), from its 63-bit key (splitmix64 of key
    and position)."""
    with np.errstate(over="ignore"):
        x = np.uint64(key) + np.arange(1, length + 1, dtype=np.uint64) * _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return (x % np.uint64(IMAGE_PLAN_SPAN) + np.uint64(IMAGE_PLAN_BASE)).astype(np.uint32)


def plan_tokens(ids: list[int], images) -> array:
    """A prompt's ids as PendingRow.tokens: packed uint32, each image's run (engine.ImageInput offset and
    length) as image_plan_ids."""
    tokens = array("I", ids)
    if images:
        view = np.frombuffer(tokens, dtype=np.uint32)       # the array's own memory: written in place
        for im in images:
            view[im.offset:im.offset + im.length] = image_plan_ids(im.key, im.length)
    return tokens


class Interrupted(Exception):
    """A signal asked the job to stop: raised between steps, caught by the loop that runs it."""


@dataclass(slots=True)
class PendingRow:
    """A row inside the planner or the engine: its request's parameters and, apart, its prompt's token
    ids as uint32 (4 bytes a token, not ~36 in a list of ints) while it waits; the engine gets them as a
    list when the row is submitted. `notes` are what the kind's request step noted for its columns step
    (jobs.row.RowNotes): they go where the row goes, so no kind keeps per-row state. A row with images:
    `tokens` holds planner ids at their positions (see the module), `request.images` their keys, offsets
    and lengths but no pixels, `images` (images.prepare.RowImages) the pixels until it is submitted."""
    row: Row
    tokens: array                   # array("I"): the prompt's token ids (image positions: planner ids)
    request: Request                # its prompt_token_ids empty (they are `tokens`)
    notes: RowNotes                 # what the kind's request step noted for its columns step
    images: RowImages | None = None     # the pixels, for a request with images

    @property
    def id(self) -> str:
        return self.row.id

    def engine_request(self) -> Request:
        """The engine's Request, ready to submit (a row with images: its pixels are taken now)."""
        if self.images is None:
            return replace(self.request, prompt_token_ids=self.tokens.tolist())
        return self.images.request(self.request, self.tokens)

    def keyed_request(self) -> Request:
        """The request as jobrunner/cache/key.py keys it: its token ids, its images' keys, offsets and
        lengths (no pixels taken)."""
        ids = self.tokens.tolist()
        for im in self.request.images:
            ids[im.offset:im.offset + im.length] = [self.images.token_id] * im.length
        return replace(self.request, prompt_token_ids=ids)

    def for_copy(self, row: Row, notes: RowNotes | None) -> PendingRow:
        """A copy of this row (the same request) that runs itself: its leader's result is written, its own not."""
        return PendingRow(row, self.tokens, replace(self.request, id=row.id), notes if notes is not None else self.notes,
                          None if self.images is None else self.images.copy())


@dataclass(slots=True)
class ShippedUnit:
    """A work unit planned in another process, its rows with it: the leaders as planned, in the unit's
    order, and the copies (dedup) each leader's result is written for, as (row, notes)."""
    rows: list[PendingRow]
    copies: dict[str, list[tuple[Row, RowNotes]]]

    @property
    def items(self) -> list[str]:
        return [p.id for p in self.rows]

    @property
    def size(self) -> int:
        """Its rows to write: the leaders and their copies."""
        return len(self.rows) + sum(map(len, self.copies.values()))
