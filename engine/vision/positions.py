"""Qwen2-VL's multimodal rotary positions of a prompt (transformers' get_rope_index), in numpy.

Text tokens count on from the last position on all three rows (time, height, width). An image's run
of t * (h / m) * (w / m) tokens starts at the position after the text before it: each token takes
(start + its frame, start + its merged row, start + its merged column), in the tower's output order;
the text after it goes on from start + max(h, w) / m. A token past the prompt at index i sits at
i + delta on every row, delta = (the largest position + 1) - the prompt's length.
"""
from __future__ import annotations

import numpy as np


def mrope_positions(token_ids: list[int], images: list, spatial_merge: int,
                    vision_start_token_id: int | None = None) -> tuple[np.ndarray, int]:
    """-> ([3, len(token_ids)] int64 positions, delta). images: engine.request.ImageInput (offset, length,
    grid), their runs apart and inside the prompt. vision_start_token_id: the token the chat templates put
    before each run; the positions follow the runs themselves (as transformers 5 counts by token type),
    so it is not read."""
    n = len(token_ids)
    out = np.empty((3, n), dtype=np.int64)
    pos = end = 0                   # the next text position; where the previous run ended
    for image in sorted(images, key=lambda im: im.offset):
        t, h, w = image.grid
        gh, gw = h // spatial_merge, w // spatial_merge
        if image.length != t * gh * gw or image.offset < end or image.offset + image.length > n:
            raise ValueError(f"an image of grid {image.grid} (merge {spatial_merge}) at {image.offset} does not "
                             f"fill {image.length} tokens of a {n}-token prompt")
        out[:, end:image.offset] = np.arange(pos, pos + image.offset - end)
        pos += image.offset - end
        frames, rows, cols = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        out[:, image.offset:image.offset + image.length] = np.stack([frames, rows, cols]).reshape(3, -1) + pos
        pos += max(h, w) // spatial_merge
        end = image.offset + image.length
    out[:, end:] = np.arange(pos, pos + n - end)
    delta = int(out.max()) + 1 - n if n else 0
    return out, delta
