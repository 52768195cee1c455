"""OLMo 2: post-norm blocks and an RMSNorm over the whole q and k projections.

    x -> x + post_attn_norm(attn(x)) -> x + post_ff_norm(mlp(x))       (no norm before a block)

The q/k norms span all heads (weights [Hq * D] and [Hk * D]), before the heads are split and rotated.
Under tensor parallelism a rank holds some heads: their norm sums the squares over the ranks
(a KV head kept by several ranks counted once).
"""
from __future__ import annotations

import torch
from torch import nn

from jobrunner.engine.config.model_config import ModelConfig
from jobrunner.engine.models.base import CausalLM
from jobrunner.engine.models.layers import Attention, GatedMLP, RMSNorm


class Olmo2Attention(Attention):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps)
        self.full_q, self.full_kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.kv_copies = self.num_kv_heads * self.tp.size // cfg.num_kv_heads     # ranks holding each KV head

    def project(self, x):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self._norm(q, self.q_norm, self.full_q, 1)
        k = self._norm(k, self.k_norm, self.full_kv, self.kv_copies)
        return (q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim),
                v.view(t, self.num_kv_heads, self.head_dim))

    def _norm(self, x, norm: RMSNorm, width: int, copies: int):
        """RMSNorm over `width` features of which this rank holds x's (each held by `copies` ranks)."""
        if self.tp.size == 1:
            return norm(x)[0]
        squares = self.tp.all_reduce(x.float().square().sum(-1, keepdim=True)) / copies
        return norm.weight * (x.float() * torch.rsqrt(squares / width + norm.eps)).to(x.dtype)    # as kernels' rms_norm


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
