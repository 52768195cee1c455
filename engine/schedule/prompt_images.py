"""A prompt's images, as the scheduler's side sees them. No torch.

The KV cache keys a block by its tokens (engine/schedule/kv_manager.py); an image's placeholder tokens are all
the same id, so at their positions a sequence's key ids hold the image's own keys instead: negative
(never a token id, nor PLACEHOLDER), one per position, derived from ImageInput.key. Equal key ids
therefore mean equal text and equal pixels, and two different images never share a block.

Qwen2-VL's decoder places tokens by multimodal rotary positions (three rows: time, height, width):
an image's tokens take their patch's coordinates and text after it goes on from the largest. A
generated token at index i then sits at i + delta on all three rows, which is plain rope at that
position; so only the prompt's positions are kept, and only for sequences with images.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jobrunner.engine.api.request import ImageInput, Request

_KEY_BITS = (1 << 62) - 1


@dataclass(frozen=True)
class VisionSpec:
    """What a vision-language model says of its prompts: the image token, and for multimodal rotary
    models (mrope set) the spatial merge and the vision-start token its positions are counted by."""
    image_token_id: int
    mrope: tuple[int, int] | None = None        # (spatial_merge_size, vision_start_token_id)

    def check(self, req: Request) -> str | None:
        """Why a request's images do not fit its prompt, or None."""
        ids, end = req.prompt_token_ids, 0
        for i, image in enumerate(req.images):
            if image.offset < end or image.length < 1 or image.offset + image.length > len(ids):
                return f"image {i}: its placeholder run [{image.offset}, {image.offset + image.length}) " \
                       f"overlaps another or lies outside the prompt"
            if any(t != self.image_token_id for t in ids[image.offset:image.offset + image.length]):
                return f"image {i}: the prompt holds other tokens where its {image.length} image tokens should be"
            end = image.offset + image.length
        placed = sum(image.length for image in req.images)
        found = sum(1 for t in ids if t == self.image_token_id)
        if found != placed:
            return f"prompt has {found} image tokens but its images fill {placed}"
        return None

    def prompt_images(self, req: Request) -> PromptImages:
        positions, delta = None, 0
        if self.mrope is not None:
            from jobrunner.engine.vision.positions import mrope_positions
            merge, start = self.mrope
            positions, delta = mrope_positions(list(req.prompt_token_ids), list(req.images), merge, start)
        return PromptImages(tuple(req.images), key_ids(req.prompt_token_ids, req.images), positions, int(delta))


@dataclass(frozen=True, eq=False)
class PromptImages:
    """A sequence's images: its prompt's key ids, and (mrope) its prompt's positions [3, P]."""
    images: tuple[ImageInput, ...]
    keys: tuple[int, ...]                   # the prompt's ids, image positions keyed by their image
    positions: np.ndarray | None = None     # [3, prompt tokens] int64, multimodal rotary models only
    delta: int = 0                          # a token at index i >= prompt length sits at i + delta

    def key_ids(self, token_ids: list[int], lo: int, hi: int) -> list[int]:
        """token_ids[lo:hi] with the prompt's image positions replaced by their keys."""
        p = len(self.keys)
        if lo >= p:
            return token_ids[lo:hi]
        return list(self.keys[lo:min(hi, p)]) + token_ids[p:hi]

    def overlaps(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """(image index, first, last + 1) of the image positions within [start, end), prompt indices."""
        out = []
        for i, image in enumerate(self.images):
            lo, hi = max(start, image.offset), min(end, image.offset + image.length)
            if lo < hi:
                out.append((i, lo, hi))
        return out


def key_ids(prompt: list[int], images) -> tuple[int, ...]:
    """The prompt's ids with position j of each image replaced by -2 - hash((image key, j)) (63 bits)."""
    keys = list(prompt)
    for image in images:
        for j in range(image.length):
            keys[image.offset + j] = -2 - (hash((image.key, j)) & _KEY_BITS)
    return tuple(keys)
