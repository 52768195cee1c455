"""Batch-invariant float linears for CUDA: a row's product the same bits whatever the rows beside it
(kernels/matmul/invariant_matmul_triton.py says how). The CPU mode packs its linears for oneDNN instead
(kernels/matmul/cpu_linear.py, min_rows=2)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jobrunner.kernels.common.triton_utils import use_triton


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatch: the fixed-tile Triton matmul on CUDA (or with JOBRUNNER_TRITON=1, interpreted); F.linear
    elsewhere, its torch reference (not invariant: the CPU mode packs its linears instead)."""
    if use_triton(x):
        from jobrunner.kernels.matmul.invariant_matmul_triton import invariant_matmul_triton
        return invariant_matmul_triton(x, weight, bias)
    return F.linear(x, weight, bias)


class InvariantLinear(nn.Module):
    """nn.Linear's forward through invariant_linear, over the same weight and bias (no copy)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x.contiguous(), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, batch-invariant"
