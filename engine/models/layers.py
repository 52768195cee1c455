"""Layers shared by the decoder families; what differs between families is a ModelConfig switch read here.

Tokens of all sequences in a step are flattened into one batch: [num_tokens, hidden]. Projections
are fused (qkv, gate_up), so a layer does four matmuls; base.CausalLM.load_weights slices HF's
separate q/k/v and gate/up tensors into them.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.model_config import ModelConfig
from kernels import (AttentionMetadata, apply_rotary, inverse_frequencies, paged_attention, rms_norm, rotary_cos_sin,
                     silu_and_mul, store_kv, store_kv_int8)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, residual=None):
        """Returns (normed, new residual); with a residual, x is added to it first (one fused op)."""
        return rms_norm(x, self.weight, self.eps, residual)


class Rotary(nn.Module):
    """cos/sin for a step's positions, in HF's rotate-half layout. The variant (plain, linear, llama3)
    is cfg.rope_scaling; the frequencies stay float32 whatever the model's dtype."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim, self.theta, self.scaling = cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict
        self.register_buffer("inv_freq", self.frequencies(), persistent=False)

    def frequencies(self) -> torch.Tensor:
        return inverse_frequencies(self.head_dim, self.theta, self.scaling)     # [head_dim / 2] float32

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions: [T] -> cos, sin: [T, head_dim] in dtype."""
        return rotary_cos_sin(positions, self.inv_freq, dtype)


class Attention(nn.Module):
    """Grouped-query attention over the paged KV cache. Switches: cfg.attention_bias (bias on q, k
    and v), cfg.qk_norm (RMSNorm over each head of q and k, before rotary)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)       # [T, Hq, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)    # [T, Hk, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, _ = self.q_norm(q)
            k, _ = self.k_norm(k)
        q, k = apply_rotary(q, k, cos, sin)
        if len(kv_cache) == 4:      # 8-bit cache: int8 values, a float32 scale per token and head
            k_cache, v_cache, k_scale, v_scale = kv_cache
            store_kv_int8(k, v, k_cache, v_cache, k_scale, v_scale, meta.slot_mapping)
            o = paged_attention(q, k_cache, v_cache, meta, self.scale, k_scale, v_scale)
        else:
            k_cache, v_cache = kv_cache
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            o = paged_attention(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up fused into one matmul. intermediate_size: the
    config's unless given (a MoE's shared expert has its own)."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
