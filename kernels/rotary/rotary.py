"""Rotary position embedding in HF's rotate-half layout (first half pairs with second half).

Partial rotary (Phi-3's partial_rotary_factor): cos/sin cover the first rotary_dim dims of a head,
the rest pass through. LongRoPE (Phi-3): per-frequency factors and an attention factor on cos/sin.
"""
from __future__ import annotations

import math

import torch

from jobrunner.kernels.common.triton_utils import use_triton


def _rope_type(scaling: dict | None) -> str | None:
    return scaling and (scaling.get("rope_type") or scaling.get("type"))


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """[head_dim / 2] float32; head_dim here is the rotary dim (partial rotary: a part of the head).
    Computed on the CPU even inside a meta-device build: meta ops run Python decompositions that
    import torch._dynamo (seconds of start-up)."""
    base = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim)
    kind = _rope_type(scaling)
    if kind == "longrope":
        return 1.0 / (torch.tensor(_longrope_factors(scaling), dtype=torch.float32, device="cpu") * base)
    inv_freq = 1.0 / base
    if kind == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif scaling:
        raise ValueError(f"unsupported rope_scaling {scaling}")
    return inv_freq


def _longrope_factors(s: dict) -> list[float]:
    """LongRoPE's per-frequency factors: HF picks the long ones for a forward whose positions pass
    original_max_position_embeddings. Our KV cache and prefix cache need one rotation per position
    whatever the batch, so the choice is made once per model: the long factors when the model's
    context (max_position_embeddings) is longer than the original one. Sequences longer than the
    original context then match HF exactly; with a short context, so do all sequences."""
    long = s["max_position_embeddings"] > s["original_max_position_embeddings"]
    return list(s["long_factor" if long else "short_factor"])


def attention_factor(scaling: dict | None) -> float:
    """What cos and sin are multiplied by: LongRoPE's attention factor (HF's default formula), else 1."""
    if _rope_type(scaling) != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _llama3_scale(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, factor: float = 1.0):
    """positions: [T] -> cos, sin: [T, rotary_dim], computed in float32 as HF does (times the attention
    factor, when not 1)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.to(dtype), sin.to(dtype)


def apply_rotary_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q: [T, Hq, D], k: [T, Hk, D], cos/sin: [T, D]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return torch.cat((-x[..., d:], x[..., :d]), dim=-1)


def apply_rotary(q, k, cos, sin):
    """Dispatch: Triton on CUDA (or with JOBRUNNER_TRITON=1), the reference elsewhere. Out of place.
    cos/sin narrower than the head (partial rotary): only the head's first cos.shape[-1] dims turn."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < q.shape[-1]:
        q, k = q.clone(), k.clone()
        q[..., :rotary_dim], k[..., :rotary_dim] = apply_rotary(q[..., :rotary_dim], k[..., :rotary_dim], cos, sin)
        return q, k
    if use_triton(q):
        from jobrunner.kernels.rotary.rotary_triton import apply_rotary_triton
        return apply_rotary_triton(q, k, cos, sin)
    return apply_rotary_ref(q, k, cos, sin)
