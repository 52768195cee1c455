"""Qwen2-VL and Qwen2.5-VL: a ViT over an image's patches, merged m x m into tokens of a Qwen2 decoder
with multimodal rotary positions (layers.Rotary's mrope_section; engine/vision/positions.py).

The tower, over the rows of all images at once (pixels from engine/vision/processor.py: [h * w, C * t * p * p]
per image, rows in merge-block order):
    patch_embed   Conv3d with kernel = stride = (t, p, p), here the linear over a flattened patch it equals
    blocks        pre-norm attention with a 2-D rotary over each patch's (row, column), then an MLP.
                  Qwen2-VL: LayerNorm, fc1 -> quick_gelu -> fc2; Qwen2.5-VL: RMSNorm, a SwiGLU MLP with
                  biases, and attention within windows (window_size pixels square) except in the blocks
                  of fullatt_block_indexes, which see the whole image
    merger        the norm, each m x m block of rows concatenated, Linear -> GELU -> Linear to the decoder
Attention never crosses images (segments of the flat rows). Qwen2.5-VL's windows are contiguous after a
reorder of the merged blocks (window_order), undone after the merger.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from jobrunner.engine.config.model_config import ModelConfig
from jobrunner.engine.models.layers import RMSNorm
from jobrunner.engine.models.llama import LlamaDecoderLayer
from jobrunner.engine.models.vision_language import VisionLanguageModel, segment_attention


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTIVATIONS = {"quick_gelu": quick_gelu, "gelu": nn.functional.gelu, "silu": nn.functional.silu,
                "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh")}


def activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported vision activation {name!r}; supported: {', '.join(sorted(_ACTIVATIONS))}")
    return _ACTIVATIONS[name]


class _VisionRMSNorm(RMSNorm):
    """RMSNorm returning the normed tensor alone (the tower adds its residuals itself)."""

    def forward(self, x, residual=None):
        return super().forward(x)[0]


def _norm(kind: str, dim: int) -> nn.Module:
    return _VisionRMSNorm(dim, 1e-6) if kind == "qwen2_5_vl" else nn.LayerNorm(dim, eps=1e-6)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, cos, sin, bounds: list[int]):
        """x [N, dim]; cos, sin [N, head_dim] float32; bounds: the segments attention stays within."""
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        return self.proj(segment_attention(q, k, v, bounds, self.head_dim ** -0.5).reshape(x.shape[0], -1))


def _rotate(x, cos, sin):
    """Rotate-half rotary in float32, back in x's dtype (as HF's apply_rotary_pos_emb_vision)."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class VisionMLP(nn.Module):
    """Qwen2-VL's and CLIP's (LLaVA): fc2(act(fc1(x)))."""

    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(dim, hidden), nn.Linear(hidden, dim), activation(act)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class VisionGatedMLP(nn.Module):
    """Qwen2.5-VL: down(act(gate(x)) * up(x)), with biases."""

    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, hidden), nn.Linear(dim, hidden)
        self.down_proj, self.act = nn.Linear(hidden, dim), activation(act)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, vision):
        super().__init__()
        self.norm1, self.norm2 = _norm(vision.kind, vision.hidden_size), _norm(vision.kind, vision.hidden_size)
        self.attn = VisionAttention(vision.hidden_size, vision.num_heads)
        mlp = VisionGatedMLP if vision.kind == "qwen2_5_vl" else VisionMLP
        self.mlp = mlp(vision.hidden_size, vision.intermediate_size, vision.hidden_act)

    def forward(self, x, cos, sin, bounds):
        x = x + self.attn(self.norm1(x), cos, sin, bounds)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """norm, m x m consecutive rows as one, Linear -> GELU -> Linear (checkpoint names mlp.0, mlp.2)."""

    def __init__(self, vision):
        super().__init__()
        width = vision.hidden_size * vision.spatial_merge_size ** 2
        self.ln_q = _norm(vision.kind, vision.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, vision.out_hidden_size))

    def forward(self, x):
        return self.mlp(self.ln_q(x).reshape(-1, self.mlp[0].in_features))


class VisionTransformer(nn.Module):
    def __init__(self, vision):
        super().__init__()
        self.config = vision
        patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Linear(patch, vision.hidden_size, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(vision) for _ in range(vision.depth))
        self.merger = PatchMerger(vision)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixels [N, patch] of all images, grids their (t, h, w) -> merged tokens [N / m^2, out_hidden]."""
        vision, device = self.config, pixels.device
        unit = vision.spatial_merge_size ** 2
        x = self.patch_embed.proj(pixels.to(self.patch_embed.proj.weight.dtype))
        cos, sin = self._rotary(grids, device)
        frames = _bounds([h * w for t, h, w in grids for _ in range(t)])       # each frame attends to itself
        order, windows = None, frames
        if vision.kind == "qwen2_5_vl":
            order, windows = window_order(grids, vision.spatial_merge_size, vision.window_size, vision.patch_size)
            blocks = torch.from_numpy(order).to(device)
            x, cos, sin = (t.view(-1, unit, t.shape[-1])[blocks].view(-1, t.shape[-1]) for t in (x, cos, sin))
        for i, block in enumerate(self.blocks):
            full = order is None or i in vision.fullatt_block_indexes
            x = block(x, cos, sin, frames if full else windows)
        merged = self.merger(x)
        if order is not None:
            merged = merged[torch.from_numpy(np.argsort(order)).to(device)]
        return merged

    def _rotary(self, grids, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, head_dim] float32 of each patch's (row, column): of each rotate-half half of a
        head, the first half turns by the row and the second by the column (HF's 2-D vision rotary)."""
        vision = self.config
        spatial = vision.hidden_size // vision.num_heads // 2          # half a head turns by each coordinate
        inv_freq = 1.0 / (vision.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        rows_cols = torch.from_numpy(patch_positions(grids, vision.spatial_merge_size))       # [N, 2]
        freqs = (rows_cols[..., None].float() * inv_freq).flatten(1)                           # [N, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1).to(device)
        return emb.cos(), emb.sin()


def patch_positions(grids, merge: int) -> np.ndarray:
    """[N, 2] (row, column) of every patch row of the images, in merge-block order, each frame alike."""
    def merge_order(a: np.ndarray) -> np.ndarray:
        h, w = a.shape
        return a.reshape(h // merge, merge, w // merge, merge).transpose(0, 2, 1, 3).reshape(-1)

    out = []
    for t, h, w in grids:
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        out.append(np.tile(np.stack([merge_order(rows), merge_order(cols)], axis=-1), (t, 1)))
    return np.concatenate(out)


def window_order(grids, merge: int, window_size: int, patch_size: int) -> tuple[np.ndarray, list[int]]:
    """Qwen2.5-VL's windows: the merged blocks' order that makes each window contiguous (window by
    window, row-major within; a window at the right or bottom edge may be smaller), and the row bounds
    of the windows in that order (HF's get_vision_window_index)."""
    side = window_size // merge // patch_size           # a window's side in merged blocks
    unit = merge * merge
    order, bounds, base = [], [0], 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        index = np.arange(t * gh * gw).reshape(t, gh, gw)
        for frame in index:
            for r in range(0, gh, side):
                for c in range(0, gw, side):
                    window = frame[r:r + side, c:c + side].reshape(-1)
                    order.append(window + base)
                    bounds.append(bounds[-1] + window.size * unit)
        base += t * gh * gw
    return np.concatenate(order), bounds


def _bounds(lengths: list[int]) -> list[int]:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(int).tolist()


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    layer_class = LlamaDecoderLayer
    vision_prefixes = ("visual.",)
    uses_mrope = True

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.visual = VisionTransformer(cfg.vision)

    def encode_images(self, pixels, grids):
        grids = [tuple(int(n) for n in g) for g in grids]
        merged = self.visual(torch.cat(list(pixels)), grids)
        unit = self.config.vision.spatial_merge_size ** 2
        return list(merged.to(self.dtype).split([t * h * w // unit for t, h, w in grids]))


Model = Qwen2VLForConditionalGeneration
