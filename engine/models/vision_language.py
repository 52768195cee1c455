"""VisionLanguageModel: a decoder (CausalLM) whose prompt's image tokens take a vision tower's embeddings.

    encode_images(pixels, grids) -> per image [num_tokens, hidden]: one tower forward over all the images
        given, whatever their sizes (attention never crosses from one image to another: segment_attention)
    forward(input_ids, positions, kv_caches, meta, image_rows, image_embeds): the decoder, with the token
        embeddings of the flat batch's rows image_rows replaced by image_embeds

The families (qwen2_vl.py, llava.py) build their tower and say how its checkpoint names map to it. Their
checkpoints come in two layouts, both read: transformers 5's (`model.language_model.*`, `model.visual.*`,
`model.vision_tower.*`, `model.multi_modal_projector.*`, `lm_head.*`) and the older shipped one's
(`model.*` or `language_model.model.*` and `language_model.lm_head.*` for the decoder, `visual.*`,
`vision_tower.*` (or `vision_tower.vision_model.*`), `multi_modal_projector.*`). No tensor parallelism:
the tower is not split, and the decoder is built whole.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import torch
import torch.nn.functional as F

from jobrunner.engine.config.model_config import ModelConfig
from jobrunner.engine.models.base import CausalLM
from jobrunner.kernels.ops import AttentionMetadata

# checkpoint prefix -> ours, tried in order (the first that matches renames)
_RENAMES = (
    ("model.language_model.", ""), ("language_model.model.", ""), ("language_model.lm_head.", "lm_head."),
    ("model.visual.", "visual."), ("model.vision_tower.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."), ("model.multi_modal_projector.", "multi_modal_projector."),
)


class VisionLanguageModel(CausalLM):
    vision_prefixes: tuple[str, ...] = ()      # our parameter names of the tower's side ("visual.", ...)
    uses_mrope = False                         # positions may be [3, T] (Qwen2-VL's multimodal rotary)

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        if self.tp.size > 1:
            raise ValueError("tensor parallelism does not split a vision-language model; run it on one device")
        vision = cfg.vision
        self.image_token_id = vision.image_token_id
        self.spatial_merge_size = vision.spatial_merge_size
        self.vision_start_token_id = vision.vision_start_token_id

    @property
    def dtype(self) -> torch.dtype:
        """The model's float dtype (the final norm's: never quantized, unlike the embedding)."""
        return self.norm.weight.dtype

    def encode_images(self, pixels: list[torch.Tensor], grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Each image's embeddings, [num_tokens_i, hidden] in the model's dtype, from one tower forward."""
        raise NotImplementedError

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata,
                image_rows: torch.Tensor | None = None, image_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T]; positions [T] or, for multimodal rotary, [3, T]; image_rows [R] rows of the batch
        whose embeddings image_embeds [R, hidden] replace -> hidden states [T, hidden]."""
        x = self.embed(input_ids)
        if image_rows is not None and image_rows.numel():
            x.index_copy_(0, image_rows, image_embeds.to(x.dtype))
        return self.run_layers(x, positions, kv_caches, meta)

    # --- weights ---------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The decoder's tensors through CausalLM.load_weights, the tower's through load_vision_weight."""
        vision_filled: set[str] = set()
        params = dict(self.named_parameters())

        def decoder_weights():
            for name, tensor in weights:
                name = checkpoint_name(name)
                if name.startswith(self.vision_prefixes):
                    vision_filled.update(self.load_vision_weight(name, tensor, params))
                else:
                    yield name, tensor

        return super().load_weights(decoder_weights()) | vision_filled

    def load_vision_weight(self, name: str, tensor: torch.Tensor, params: dict) -> set[str]:
        """Copies one tower-side tensor (our name) in; returns the names filled. Families override it for
        tensors stored in another shape (a convolution's kernel is our linear's rows) or left unused."""
        if name not in params:
            raise KeyError(f"unexpected weight {name!r}")
        with torch.no_grad():
            params[name].data.copy_(tensor.reshape(params[name].shape))
        return {name}


def checkpoint_name(name: str) -> str:
    """A checkpoint tensor's name in our layout: the decoder's as CausalLM reads them, the tower's under
    its prefix (see the module doc)."""
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int],
                      scale: float) -> torch.Tensor:
    """Bidirectional attention within each segment [bounds[i], bounds[i + 1]) of the rows, none across.
    q, k, v: [N, H, D] -> [N, H, D]. Segments of one length go through one batched call."""
    n, heads, dim = q.shape
    starts = defaultdict(list)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi > lo:
            starts[hi - lo].append(lo)
    if len(starts) == 1 and len(next(iter(starts.values()))) == 1:      # one segment: the whole batch
        o = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), scale=scale)
        return o[0].transpose(0, 1)
    out = torch.empty_like(q)
    for length, firsts in starts.items():
        rows = (torch.tensor(firsts)[:, None] + torch.arange(length)).to(q.device)          # [B, L]
        o = F.scaled_dot_product_attention(*(t[rows].transpose(1, 2) for t in (q, k, v)), scale=scale)
        out[rows] = o.transpose(1, 2)
    return out
