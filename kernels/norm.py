"""RMSNorm, optionally fused with the residual add before it."""
from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (norm(x + residual) * weight, x + residual); computed in float32 like HF."""
    if residual is not None:
        x = x + residual
    residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), residual


def rms_norm(x, weight, eps, residual=None):
    return rms_norm_ref(x, weight, eps, residual)
