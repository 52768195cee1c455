"""Llama 2/3, Mistral and SmolLM2: pre-norm decoder layers, attention then a gated MLP.

Mistral's sliding window and Llama 3's rope scaling are ModelConfig values the shared layers and
the attention metadata read; SmolLM2 is a Llama with tied embeddings.
"""
from __future__ import annotations

from torch import nn

from jobrunner.engine.config.model_config import ModelConfig
from jobrunner.engine.models.base import CausalLM
from jobrunner.engine.models.layers import Attention, GatedMLP, RMSNorm


class LlamaDecoderLayer(nn.Module):
    """x -> x + attn(norm(x)) -> x + mlp(norm(x)); the residual add is fused into the next norm."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = GatedMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos, sin, kv_cache, meta):
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(CausalLM):
    layer_class = LlamaDecoderLayer


Model = LlamaForCausalLM
