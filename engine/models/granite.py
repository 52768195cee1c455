"""Granite (3.x): Llama's decoder with four multipliers from config.json.

embedding_multiplier (on the embeddings) and logits_scaling (logits divided by it) are applied by
CausalLM; attention_multiplier is the attention scale itself (layers.Attention); residual_multiplier
scales each block's output before it joins the residual stream, here.
"""
from __future__ import annotations

from jobrunner.engine.config.model_config import ModelConfig
from jobrunner.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        self.residual_multiplier = cfg.residual_multiplier

    def forward(self, x, residual, cos, sin, kv_cache, meta):
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta) * self.residual_multiplier
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h) * self.residual_multiplier, residual


class GraniteForCausalLM(LlamaForCausalLM):
    layer_class = GraniteDecoderLayer


Model = GraniteForCausalLM
