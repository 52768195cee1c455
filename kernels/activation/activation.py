"""act(gate) * up over the fused gate_up projection output: SiLU (Llama, Qwen, ...) or GELU-tanh (Gemma)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from jobrunner.kernels.common.triton_utils import use_triton


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * d] = [gate | up] -> [..., d]."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def silu_and_mul(x):
    """Dispatch: Triton on CUDA (or with JOBRUNNER_TRITON=1), the reference elsewhere."""
    if use_triton(x):
        from jobrunner.kernels.activation.activation_triton import silu_and_mul_triton
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * d] = [gate | up] -> [..., d]: gelu(gate, approximate="tanh") * up (HF's gelu_pytorch_tanh)."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def gelu_tanh_and_mul(x):
    """Dispatch: Triton on CUDA (or with JOBRUNNER_TRITON=1), the reference elsewhere."""
    if use_triton(x):
        from jobrunner.kernels.activation.activation_triton import gelu_tanh_and_mul_triton
        return gelu_tanh_and_mul_triton(x)
    return gelu_tanh_and_mul_ref(x)
