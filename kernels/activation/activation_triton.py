"""Triton activation-and-multiply over the fused gate_up projection output.

    x: [..., 2 * d] = [gate | up]  ->  out: [..., d] = act(gate) * up,  act = silu or gelu-tanh (ACT)

Matches `kernels.activation.silu_and_mul_ref`: silu computed in float32 and rounded to
x.dtype (as torch does), then the product rounded again. Grid: (rows, column blocks),
so wide intermediates (14336 for Llama-8B) spread over many programs even for a
one-token decode batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from jobrunner.kernels.common.triton_utils import check, check_float, check_last_contiguous, launch, next_pow2


SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)    # a constexpr: jitted code reads no plain globals


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr, ACT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    if ACT == "silu":
        s = g / (1.0 + tl.exp(-g))
    else:   # gelu_tanh: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), tanh(y) = 1 - 2 / (exp(2y) + 1)
        y = SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
        s = 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))
    s = s.to(x_ptr.dtype.element_ty)
    out = s.to(tl.float32) * u.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * d] -> [..., d] (a new contiguous tensor, x.dtype)."""
    return _act_and_mul(x, "silu")


def gelu_tanh_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * d] -> [..., d]: gelu(gate, approximate="tanh") * up (a new contiguous tensor, x.dtype)."""
    return _act_and_mul(x, "gelu_tanh")


def _act_and_mul(x: torch.Tensor, act: str) -> torch.Tensor:
    check_float("x", x)
    check(x.dim() >= 1 and x.shape[-1] % 2 == 0, f"x: last dim must be even, got shape {tuple(x.shape)}")
    check_last_contiguous("x", x)
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    try:
        x2 = x.view(-1, 2 * d)
    except RuntimeError:
        x2 = x.reshape(-1, 2 * d).contiguous()
    o2 = out.view(-1, d)
    BLOCK = min(next_pow2(d), 1024)
    launch(_act_and_mul_kernel, (x2.shape[0], triton.cdiv(d, BLOCK)), x.device,
           x2, o2, x2.stride(0), o2.stride(0), d, BLOCK=BLOCK, ACT=act, num_warps=4)
    return out
