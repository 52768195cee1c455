"""The vision tower's outputs for a step's images, computed once per image.

A step's chunks may cover image positions of many sequences; the images whose embeddings are not
at hand go through the tower together (one batched call), and the results stay, by image key, in a
least-recently-used store of bounded size: a chunked prefill that splits an image, and every other
row with the same image but another prefix (another system prompt, say), takes them from there.
An image whose positions all come from the prefix cache never reaches the tower.

In the batch-invariant mode (engine/run/batch_invariance.py) each image goes through the tower alone, so
its embeddings are the same bits whatever other images share its step: the tower's attention then sees
one image (no batched call over images of one size), and its linears, packed in the invariant form,
give each row its bits at any row count. Its attention runs torch's math path (matmuls, softmax):
the CPU flash kernel's blocks follow the thread count and the batch (a 17-patch CLIP image gave other
bits at 1 and 2 threads), the math path's did not; it holds heads x patches^2 floats per call.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from jobrunner.engine.api.request import ImageInput

DEFAULT_BUDGET_BYTES = 256 << 20


class ImageEmbeds:
    def __init__(self, model, device: torch.device, budget_bytes: int = DEFAULT_BUDGET_BYTES):
        self.model, self.device, self.budget = model, device, budget_bytes
        self.one_at_a_time = getattr(model, "batch_invariant", False)
        self._store: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self.encoded = 0            # images run through the tower
        self.reused = 0             # chunks' images served from the store (one a chunk and image)

    def splice(self, spans: list[tuple[int, ImageInput, int, int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """spans: (first flat row, image, first, last + 1 of its rows) -> (flat rows [R], embeddings [R, hidden]),
        or None without spans."""
        if not spans:
            return None
        wanted = {image.key: image for _, image, _, _ in spans}
        missing = [image for key, image in wanted.items() if key not in self._store]
        fresh = dict(zip((image.key for image in missing), self._encode(missing)))
        rows, parts = [], []
        for row, image, lo, hi in spans:
            embeds = fresh.get(image.key)
            if embeds is None:
                self.reused += 1
                embeds = self._store[image.key]
                self._store.move_to_end(image.key)
            rows.append(torch.arange(row, row + hi - lo))
            parts.append(embeds[lo:hi])
        for key, embeds in fresh.items():
            self._keep(key, embeds)
        return torch.cat(rows).to(self.device), torch.cat(parts)

    def _encode(self, images: list[ImageInput]) -> list[torch.Tensor]:
        if not images:
            return []
        self.encoded += len(images)
        pixels = [torch.from_numpy(image.pixels).to(self.device) for image in images]
        if self.one_at_a_time:
            with sdpa_kernel(SDPBackend.MATH):
                return [self.model.encode_images([p], [image.grid])[0] for p, image in zip(pixels, images)]
        return self.model.encode_images(pixels, [image.grid for image in images])

    def _keep(self, key: int, embeds: torch.Tensor) -> None:
        size = embeds.numel() * embeds.element_size()
        if size > self.budget:
            return
        self._store[key] = embeds
        self._bytes += size
        while self._bytes > self.budget:
            _, old = self._store.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()
