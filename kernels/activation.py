"""SiLU(gate) * up over the fused gate_up projection output."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * d] = [gate | up] -> [..., d]."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def silu_and_mul(x):
    return silu_and_mul_ref(x)
