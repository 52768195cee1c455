"""Layers shared by the decoder families; what differs between families is a ModelConfig switch read here.

Tokens of all sequences in a step are flattened into one batch: [num_tokens, hidden]. Projections
are fused (qkv, gate_up), so a layer does four matmuls; base.CausalLM.load_weights slices HF's
separate q/k/v and gate/up tensors into them.

Tensor parallelism (engine/parallel): built under a group of several ranks, a layer holds its rank's
heads and MLP columns (shards.ShardPlan) and sums the ranks' partial outputs after o_proj and
down_proj (one all-reduce each); with one rank the shapes are the model's and the sums no-ops.
"""
from __future__ import annotations

import torch
from torch import nn

from jobrunner.engine.config.model_config import ModelConfig
from jobrunner.engine.parallel.group import current as current_group
from jobrunner.engine.parallel.shards import ShardPlan
from jobrunner.kernels.ops import AttentionMetadata, apply_rotary, attention_factor, gelu_tanh_and_mul, inverse_frequencies, paged_attention, rms_norm, rotary_cos_sin, silu_and_mul, store_kv, store_kv_int8


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, residual=None):
        """Returns (normed, new residual); with a residual, x is added to it first (one fused op)."""
        return rms_norm(x, self.weight, self.eps, residual)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm scales by (1 + weight): checkpoints store the offset from 1 (zeros at init). As in HF,
    1 + w is float32 (in bfloat16 it would keep 7 bits of w) and the product is rounded to x's dtype."""

    def forward(self, x, residual=None):
        out, residual = rms_norm(x, 1.0 + self.weight.float(), self.eps, residual)
        return out.to(x.dtype), residual


class Rotary(nn.Module):
    """cos/sin for a step's positions, in HF's rotate-half layout. The variant (plain, linear, llama3,
    longrope) is cfg.rope_scaling; `theta` given: a plain rope of that base (Gemma 3's sliding layers).
    cos/sin cover the rotary part of a head (cfg.partial_rotary_factor); the frequencies stay float32
    whatever the model's dtype.

    Multimodal rotary (Qwen2-VL, cfg.mrope_section): positions may be [3, T], a (time, height, width) row
    each; the frequencies' consecutive sections turn by rows 0, 1, 2, 0, ... in turn. Three equal rows
    are the plain rope of that row, so [T] positions (text, decodes) take the plain path."""

    def __init__(self, cfg: ModelConfig, theta: float | None = None):
        super().__init__()
        self.rotary_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
        self.theta = cfg.rope_theta if theta is None else theta
        self.scaling = cfg.rope_scaling_dict if theta is None else None
        self.factor = attention_factor(self.scaling)
        self.mrope_section = list(cfg.mrope_section) if cfg.mrope_section and theta is None else None
        if self.mrope_section is not None and sum(self.mrope_section) != self.rotary_dim // 2:
            raise ValueError(f"mrope_section {self.mrope_section} must sum to half the rotary dim ({self.rotary_dim // 2})")
        self.register_buffer("inv_freq", self.frequencies(), persistent=False)

    def frequencies(self) -> torch.Tensor:
        return inverse_frequencies(self.rotary_dim, self.theta, self.scaling)   # [rotary_dim / 2] float32

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions: [T] (or [3, T] with mrope_section) -> cos, sin: [T, rotary_dim] in dtype."""
        if positions.dim() == 1:
            return rotary_cos_sin(positions, self.inv_freq, dtype, self.factor)
        if self.mrope_section is None or positions.shape[0] != 3:
            raise ValueError(f"positions of shape {tuple(positions.shape)}: [3, T] needs a multimodal rotary model")
        freqs = positions.float()[..., None] * self.inv_freq          # [3, T, rotary_dim / 2], as HF in float32
        freqs = torch.cat([part[i % 3] for i, part in enumerate(freqs.split(self.mrope_section, dim=-1))], dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.factor != 1.0:
            cos, sin = cos * self.factor, sin * self.factor
        return cos.to(dtype), sin.to(dtype)


class Attention(nn.Module):
    """Grouped-query attention over the paged KV cache. Switches: cfg.attention_bias (bias on q, k
    and v), cfg.qk_norm (a `norm_class` over each head of q and k, before rotary), the scale
    (cfg.attention_multiplier, else cfg.query_pre_attn_scalar or head_dim to the -1/2), the score
    cap (cfg.attn_logit_softcapping) and whether this layer slides (cfg.is_sliding)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0, norm_class: type[RMSNorm] = RMSNorm):
        super().__init__()
        self.tp = current_group()
        plan = ShardPlan(cfg, self.tp)
        self.num_heads, self.num_kv_heads, self.head_dim = plan.heads, plan.kv_heads, cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = norm_class(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = norm_class(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.attention_multiplier or (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.softcap = cfg.attn_logit_softcapping
        self.sliding = cfg.is_sliding(layer_idx)

    def project(self, x):
        """x: [T, hidden] -> q [T, Hq, D], k and v [T, Hk, D], normed where the family norms them."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, _ = self.q_norm(q)
            k, _ = self.k_norm(k)
        return q, k, v

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata):
        t = x.shape[0]
        q, k, v = self.project(x)
        q, k = apply_rotary(q, k, cos, sin)
        switches = dict(sliding=self.sliding, softcap=self.softcap)
        if len(kv_cache) == 4:      # 8-bit cache: int8 values, a float32 scale per token and head
            k_cache, v_cache, k_scale, v_scale = kv_cache
            store_kv_int8(k, v, k_cache, v_cache, k_scale, v_scale, meta.slot_mapping)
            o = paged_attention(q, k_cache, v_cache, meta, self.scale, k_scale, v_scale, **switches)
        else:
            k_cache, v_cache = kv_cache
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            o = paged_attention(q, k_cache, v_cache, meta, self.scale, **switches)
        return self.tp.all_reduce(self.o_proj(o.reshape(t, self.q_size)))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up fused into one matmul; act is cfg.hidden_act.
    intermediate_size: the config's unless given (a MoE's shared expert has its own). reduce=False
    leaves a tensor-parallel rank's partial sum to the caller (a MoE block sums once for all its parts)."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None, reduce: bool = True):
        super().__init__()
        self.tp = current_group() if reduce else None
        inter = ShardPlan(cfg, current_group()).width(intermediate_size or cfg.intermediate_size)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)
        self.act_and_mul = gelu_tanh_and_mul if cfg.hidden_act == "gelu_pytorch_tanh" else silu_and_mul

    def forward(self, x):
        y = self.down_proj(self.act_and_mul(self.gate_up_proj(x)))
        return y if self.tp is None else self.tp.all_reduce(y)
