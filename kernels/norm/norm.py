"""RMSNorm, optionally fused with the residual add before it."""
from __future__ import annotations

import torch

from jobrunner.kernels.common.triton_utils import use_triton


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (norm(x + residual) * weight, x + residual); computed in float32 like HF."""
    if residual is not None:
        x = x + residual
    residual = x
    if x.dtype == torch.float32:   # fused, one pass over x; same formula
        return torch.nn.functional.rms_norm(x, weight.shape, weight, eps), residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), residual


def rms_norm(x, weight, eps, residual=None):
    """Dispatch: Triton on CUDA (or with JOBRUNNER_TRITON=1), the reference elsewhere."""
    if use_triton(x):
        from jobrunner.kernels.norm.norm_triton import rms_norm_triton
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)
