"""OLMo 2: post-norm blocks and an RMSNorm over the whole q and k projections.

    x -> x + post_attn_norm(attn(x)) -> x + post_ff_norm(mlp(x))       (no norm before a block)

The q/k norms span all heads (weights [Hq * D] and [Hk * D]), before the heads are split and rotated.
"""
from __future__ import annotations

from torch import nn

from engine.model_config import ModelConfig
from engine.models.base import CausalLM
from engine.models.layers import Attention, GatedMLP, RMSNorm


class Olmo2Attention(Attention):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps)

    def project(self, x):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, _ = self.q_norm(q)
        k, _ = self.k_norm(k)
        return (q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim),
                v.view(t, self.num_kv_heads, self.head_dim))


class Olmo2DecoderLayer(nn.Module):
    """(x, residual) in and out as the other families pass them: the block's input is their sum."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0):
        super().__init__()
        self.self_attn = Olmo2Attention(cfg, layer_idx)
        self.mlp = GatedMLP(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos, sin, kv_cache, meta):
        h = x if residual is None else x + residual
        a, _ = self.post_attention_layernorm(self.self_attn(h, cos, sin, kv_cache, meta))
        h = h + a
        m, _ = self.post_feedforward_layernorm(self.mlp(h))
        return m, h


class Olmo2ForCausalLM(CausalLM):
    layer_class = Olmo2DecoderLayer


Model = Olmo2ForCausalLM
