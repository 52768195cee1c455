"""LLaVA: a CLIP vision tower, a two-layer projector, and a text decoder of another family (Llama,
Mistral or Qwen2: registry.text_architecture), whose layers it takes as they are.

    vision_tower            CLIP's ViT over a square image (pixels [C, S, S] from engine/vision/processor.py):
                            patch embedding (Conv2d, kernel = stride = p: here the linear over a flattened
                            patch), a CLS row in front, position embeddings, pre_layrnorm, pre-norm blocks
                            (q/k/v/out projections with biases, fc1 -> act -> fc2)
    feature layers          the hidden states after vision.feature_layers blocks (0: the embeddings), joined
                            along the width; "default" drops the CLS row. Only the blocks up to the deepest
                            one are built: a checkpoint's later blocks and post_layernorm are never read
    multi_modal_projector   linear_1 -> act -> linear_2, to the decoder's width
"""
from __future__ import annotations

import torch
from torch import nn

from jobrunner.engine.config.model_config import ModelConfig
from jobrunner.engine.models.qwen2_vl import VisionMLP, activation
from jobrunner.engine.config.architectures import model_class
from jobrunner.engine.models.vision_language import VisionLanguageModel


class CLIPAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x):
        """x [B, L, dim] -> [B, L, dim], every row attending to every row of its image."""
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, self.heads, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        o = nn.functional.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)
        return self.out_proj(o.transpose(1, 2).reshape(b, n, -1))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, vision):
        super().__init__()
        dim = vision.hidden_size
        self.layer_norm1 = nn.LayerNorm(dim, eps=vision.layer_norm_eps)
        self.self_attn = CLIPAttention(dim, vision.num_heads)
        self.layer_norm2 = nn.LayerNorm(dim, eps=vision.layer_norm_eps)
        self.mlp = VisionMLP(dim, vision.intermediate_size, vision.hidden_act)

    def forward(self, x):
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPVisionTower(nn.Module):
    def __init__(self, vision):
        super().__init__()
        self.config = vision
        dim, p = vision.hidden_size, vision.patch_size
        self.embeddings = nn.Module()
        self.embeddings.class_embedding = nn.Parameter(torch.empty(dim))
        self.embeddings.patch_embedding = nn.Linear(vision.in_channels * p * p, dim, bias=False)
        self.embeddings.position_embedding = nn.Embedding((vision.image_size // p) ** 2 + 1, dim)
        self.pre_layrnorm = nn.LayerNorm(dim, eps=vision.layer_norm_eps)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(CLIPEncoderLayer(vision) for _ in range(max(vision.feature_layers)))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, C, S, S] -> the feature layers' hidden states joined: [B, 1 + (S/p)^2, dim * layers]."""
        vision = self.config
        b, c, s, _ = pixels.shape
        p, n = vision.patch_size, s // vision.patch_size
        patches = pixels.reshape(b, c, n, p, n, p).permute(0, 2, 4, 1, 3, 5).reshape(b, n * n, c * p * p)
        emb = self.embeddings
        x = emb.patch_embedding(patches.to(emb.patch_embedding.weight.dtype))
        x = torch.cat([emb.class_embedding.expand(b, 1, -1), x], dim=1) + emb.position_embedding.weight
        states = [self.pre_layrnorm(x)]
        for layer in self.encoder.layers:
            states.append(layer(states[-1]))
        return torch.cat([states[i] for i in vision.feature_layers], dim=-1)


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, vision):
        super().__init__()
        width = vision.hidden_size * len(vision.feature_layers)
        self.linear_1 = nn.Linear(width, vision.out_hidden_size, bias=vision.projector_bias)
        self.act = activation(vision.projector_act)
        self.linear_2 = nn.Linear(vision.out_hidden_size, vision.out_hidden_size, bias=vision.projector_bias)

    def forward(self, x):
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(VisionLanguageModel):
    vision_prefixes = ("vision_tower.", "multi_modal_projector.")

    def __init__(self, cfg: ModelConfig):
        self.layer_class = model_class(cfg.vision.text_architecture).layer_class    # the decoder's family's
        super().__init__(cfg)
        vision = cfg.vision
        if (vision.image_size // vision.patch_size) ** 2 < 1 or min(vision.feature_layers) < 0 or \
                max(vision.feature_layers) > vision.depth:
            raise ValueError(f"LLaVA feature layers {vision.feature_layers} outside the tower's {vision.depth} layers")
        self.vision_tower = CLIPVisionTower(vision)
        self.multi_modal_projector = LlavaMultiModalProjector(vision)

    def encode_images(self, pixels, grids):
        side = self.config.vision.image_size
        for image in pixels:
            if tuple(image.shape[-2:]) != (side, side):
                raise ValueError(f"LLaVA's tower takes {side} x {side} images, got {tuple(image.shape[-2:])}")
        features = self.vision_tower(torch.stack(list(pixels)))
        if self.config.vision.feature_strategy == "default":
            features = features[:, 1:]
        return list(self.multi_modal_projector(features).to(self.dtype).unbind(0))

    def load_vision_weight(self, name, tensor, params):
        """A block past the deepest feature layer, and post_layernorm, are not part of our tower."""
        if name.startswith("vision_tower.post_layernorm.") or name.endswith("embeddings.position_ids"):
            return set()
        if name.startswith("vision_tower.encoder.layers."):
            if int(name.split(".")[3]) >= len(self.vision_tower.encoder.layers):
                return set()
        return super().load_vision_weight(name, tensor, params)


Model = LlavaForConditionalGeneration
