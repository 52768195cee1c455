"""Gemma 2 and Gemma 3 (text): a sandwich-norm decoder with Gemma's own switches.

    x -> x + post_attn_norm(attn(input_norm(x))) -> x + post_ff_norm(mlp(pre_ff_norm(x)))

Every RMSNorm scales by (1 + weight) (GemmaRMSNorm); embeddings are scaled by sqrt(hidden_size)
(ModelConfig.embedding_multiplier); the MLP is GELU-tanh; the attention scale comes from
query_pre_attn_scalar. Layers alternate between a sliding window and global attention by
layer_types (Gemma 2: every other layer; Gemma 3: five sliding, then one global). Gemma 2 caps
attention scores and final logits (c * tanh(x / c)); Gemma 3 norms each head of q and k
(qk_norm) and gives its sliding layers their own rope base (rope_local_theta), while the global
layers keep rope_theta and its scaling.
"""
from __future__ import annotations

from torch import nn

from jobrunner.engine.config.model_config import ModelConfig
from jobrunner.engine.models.base import CausalLM
from jobrunner.engine.models.layers import Attention, GatedMLP, GemmaRMSNorm, Rotary


class GemmaDecoderLayer(nn.Module):
    """The residual add is fused into the norm that follows it, as in Llama's layer."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, norm_class=GemmaRMSNorm)
        self.mlp = GatedMLP(cfg)
        norm = lambda: GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)   # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        # Gemma 3's sliding layers rotate with the local rope base
        self.local_rope = cfg.rope_local_theta is not None and self.self_attn.sliding

    def forward(self, x, residual, cos, sin, kv_cache, meta):
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta)
        h, _ = self.post_attention_layernorm(h)
        h, residual = self.pre_feedforward_layernorm(h, residual)
        h, _ = self.post_feedforward_layernorm(self.mlp(h))
        return h, residual


class GemmaForCausalLM(CausalLM):
    layer_class = GemmaDecoderLayer

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.local_rotary = Rotary(cfg, theta=cfg.rope_local_theta) if cfg.rope_local_theta else None

    def init_buffers(self) -> None:
        super().init_buffers()
        if self.local_rotary is not None:
            self.local_rotary.inv_freq = self.local_rotary.frequencies().to(self.local_rotary.inv_freq.device)

    def forward(self, input_ids, positions, kv_caches, meta):
        """As CausalLM.forward, with each layer's rope: the local one for Gemma 3's sliding layers."""
        x = self.embed(input_ids)
        rope = self.rotary(positions, x.dtype)
        local = self.local_rotary(positions, x.dtype) if self.local_rotary is not None else rope
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, *(local if layer.local_rope else rope), kv_cache, meta)
        x, _ = self.norm(x, residual)
        return x


Model = GemmaForCausalLM
