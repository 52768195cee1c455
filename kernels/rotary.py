"""Rotary position embedding in HF's rotate-half layout (first half pairs with second half)."""
from __future__ import annotations

import math

import torch

from kernels.triton_utils import use_triton


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    # on the CPU even inside a meta-device build: meta ops run Python decompositions that import torch._dynamo
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if scaling and (scaling.get("rope_type") or scaling.get("type")) == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    elif scaling and (scaling.get("rope_type") or scaling.get("type")) == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif scaling:
        raise ValueError(f"unsupported rope_scaling {scaling}")
    return inv_freq


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


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """positions: [T] -> cos, sin: [T, head_dim], computed in float32 as HF does."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q: [T, Hq, D], k: [T, Hk, D], cos/sin: [T, D]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return torch.cat((-x[..., d:], x[..., :d]), dim=-1)


def apply_rotary(q, k, cos, sin):
    """Dispatch: Triton on CUDA (or with JOBRUNNER_TRITON=1), the reference elsewhere. Out of place."""
    if use_triton(q):
        from kernels.triton_rotary import apply_rotary_triton
        return apply_rotary_triton(q, k, cos, sin)
    return apply_rotary_ref(q, k, cos, sin)
