"""One decoder for the Llama family: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm), SmolLM2.

Tokens of all sequences in a step are flattened into one batch: [num_tokens, hidden].
Projections are fused (qkv, gate_up) so each layer does four matmuls; `load_weights`
slices HF's separate q/k/v and gate/up tensors into them.
"""
from __future__ import annotations

from typing import Iterable

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
        return rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
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


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos, sin, kv_cache, meta):
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict),
                             persistent=False)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states before the final norm's output projection: [T, hidden]."""
        x = self.embed_tokens(input_ids)
        cos, sin = rotary_cos_sin(positions, self.inv_freq, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, kv_cache, meta)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Only for the rows that are sampled or scored: [N, hidden] -> [N, vocab] float32."""
        return self.lm_head(hidden).float()

    # --- weights -------------------------------------------------------------------------

    _FUSED = {  # HF name piece -> (our fused param, shard index)
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies HF-named tensors in, one at a time; returns the names of parameters filled."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        cfg = self.config
        shard_sizes = {"qkv_proj": [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                                    cfg.num_kv_heads * cfg.head_dim],
                       "gate_up_proj": [cfg.intermediate_size] * 2}
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            for piece, (fused, shard) in self._FUSED.items():
                if f".{piece}." in name:
                    target = name.replace(piece, fused)
                    sizes = shard_sizes[fused]
                    offset = sum(sizes[:shard])
                    param = params[target]
                    with torch.no_grad():
                        param.data[offset:offset + sizes[shard]].copy_(tensor)
                    filled.add(f"{target}#{shard}")
                    break
            else:
                if name not in params:
                    raise KeyError(f"unexpected weight {name!r}")
                with torch.no_grad():
                    params[name].data.copy_(tensor)
                filled.add(name)
        return filled

    def expected_weight_names(self) -> set[str]:
        names = set()
        for name, _ in self.named_parameters():
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            fused = next((f for f in ("qkv_proj", "gate_up_proj") if f".{f}." in name), None)
            if fused:
                shards = 3 if fused == "qkv_proj" else 2
                names.update(f"{name}#{i}" for i in range(shards))
            else:
                names.add(name)
        return names
