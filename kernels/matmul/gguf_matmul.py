"""GGUF blocks times int8 activations (llama.cpp's Q4_0/Q4_1/Q8_0 dot products), beside the reference.

Weights as GGUF ships them (engine/quant/formats.py maps the file's bytes, no float round trip);
a block is 32 consecutive columns of one row (b = k // 32):

    q: int8    [N, K]        Q4_0 / Q4_1: the nibble, 0..15; Q8_0: the stored int8
    d: float32 [N, K // 32]  the block's scale (float16 in the file, exact in float32)
    m: float32 [N, K // 32]  the value a q of 0 stands for: Q4_1's min; Q4_0: -8 d; Q8_0: 0
    W[n, k] = d[n, b] * q[n, k] + m[n, b]

Activations quantized as llama.cpp quantizes them for these dot products (its Q8_0 / Q8_1): per
token and block of 32, dx = max|x| / 127, qx = round(x / dx), an int8. Then

    y[t, n] = sum_b dx[t, b] d[n, b] * sum_{k in b} qx[t, k] q[n, k]     integer block dot (int32)
            + sum_b m[n, b] * (dx[t, b] * sum_{k in b} qx[t, k])        Q8_1's "s" term: [T, B] @ [B, N]

Each token's result depends on that token only. A block's integer dot is at most
32 * 127 * 127 < 2^19, so it is exact in int32 and in float32 alike.

Speed (benchmarks/gguf_matmul_bench.py; RESULTS.md, issue 20 item 3): the per-block scales d[n, b]
sit inside the sum over blocks, so the integer part is one [T, 32] x [32, N] product per block,
not one GEMM. On the 2-core AVX2 EPYC we measured, no torch CPU op or PyPI library runs that
faster than float32 on the dequantized weight: this module is the reference (and the exact
block-wise path, for machines where torch._int_mm is fast), not a speed path the engine uses.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from jobrunner.kernels.matmul.quant_matmul import AMAX_FLOOR

GGUF_BLOCK = 32


def gguf_weight_from_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                          in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our int4 layout (group 32: GGUF Q4_0/Q4_1 bytes unchanged) -> (q int8 [N, K], d, m float32 [N, K // 32])."""
    from jobrunner.kernels.matmul.quant_matmul import unpack_int4
    if in_features % GGUF_BLOCK or packed.shape[1] * 2 != in_features:
        raise ValueError(f"GGUF blocks need in_features a multiple of {GGUF_BLOCK}, got {in_features}")
    q = unpack_int4(packed, GGUF_BLOCK).view(torch.int8)    # 0..15 fit int8 unchanged
    return q, scales.float(), zeros.float()


def gguf_weight_from_int8(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our int8 layout with group 32 (GGUF Q8_0 bytes unchanged) -> (q, d, m = 0)."""
    if qweight.shape[1] != scales.shape[1] * GGUF_BLOCK:
        raise ValueError(f"Q8_0 blocks need scales [N, K // {GGUF_BLOCK}], got {tuple(scales.shape)}")
    d = scales.float()
    return qweight, d, torch.zeros_like(d)


def quantize_blocks_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] float -> (qx int8 [T, K], dx float32 [T, K // 32]); per token and block of 32,
    symmetric, round half to even (llama.cpp rounds half away from zero: ties are rare and
    shift one product by one unit)."""
    t, k = x.shape
    xb = x.float().view(t, k // GGUF_BLOCK, GGUF_BLOCK)
    dx = xb.abs().amax(-1).clamp_(min=AMAX_FLOOR) / 127.0
    qx = torch.round(xb / dx[..., None]).clamp_(-127, 127).to(torch.int8)
    return qx.view(t, k), dx


def _check(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[int, int, int]:
    n, k = q.shape
    if q.dtype != torch.int8 or k % GGUF_BLOCK:
        raise ValueError(f"q must be int8 [N, K] with K a multiple of {GGUF_BLOCK}, got {q.dtype} {tuple(q.shape)}")
    if d.shape != (n, k // GGUF_BLOCK) or m.shape != d.shape:
        raise ValueError(f"d and m must be [{n}, {k // GGUF_BLOCK}], got {tuple(d.shape)} and {tuple(m.shape)}")
    if x.shape[-1] != k or not x.is_floating_point():
        raise ValueError(f"x must be float [..., {k}], got {x.dtype} {tuple(x.shape)}")
    return n, k, k // GGUF_BLOCK


def gguf_int8_matmul_ref(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float -> [..., N] x.dtype: the formula of the module doc in float64 (the integer
    block dots are exact there); what a kernel of this op must return up to float32 rounding."""
    n, k, nb = _check(x, q, d, m)
    shape = x.shape
    qx, dx = quantize_blocks_ref(x.reshape(-1, k))
    t = qx.shape[0]
    dots = torch.einsum("tbj,nbj->tnb", qx.double().view(t, nb, GGUF_BLOCK), q.double().view(n, nb, GGUF_BLOCK))
    y = (dots * dx.double()[:, None, :] * d.double()[None]).sum(-1)                # [T, N]
    y = y + (dx.double() * qx.double().view(t, nb, GGUF_BLOCK).sum(-1)) @ m.double().t()
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype).view(*shape[:-1], n)


def gguf_int8_matmul(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """The block-wise integer path: one exact int8 GEMM (torch._int_mm) per block of 32 columns,
    each scaled by dx[t, b] d[n, b] and summed in float32. Same contract as gguf_int8_matmul_ref.
    Only as fast as torch._int_mm on this machine (oneDNN: fast with VNNI or AMX, not on AVX2)."""
    n, k, nb = _check(x, q, d, m)
    shape = x.shape
    qx, dx = quantize_blocks_ref(x.reshape(-1, k))
    t = qx.shape[0]
    qxb = qx.view(t, nb, GGUF_BLOCK)
    qb = q.view(n, nb, GGUF_BLOCK)
    s = dx * qxb.sum(-1, dtype=torch.int32)                               # [T, B]: Q8_1's d * sum(qs)
    y = torch.zeros(t, n, dtype=torch.float32, device=x.device)
    for b in range(nb):   # elementwise float sums in a fixed order: a token's result ignores its batch mates
        acc = torch._int_mm(qxb[:, b].contiguous(), qb[:, b].t())        # [T, N] int32, exact
        y.addcmul_(acc, dx[:, b:b + 1] * d[:, b].view(1, n))            # int32 * float32 -> float32
        y.addcmul_(s[:, b:b + 1], m[:, b].view(1, n))
    if bias is not None:
        y.add_(bias.float())
    return y.to(x.dtype).view(*shape[:-1], n)


def gguf_dequantize(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, dtype: torch.dtype = torch.float32):
    """The weight W = d q + m, [N, K] in dtype (float32 math, rounded once): what `none` runs."""
    n, k = q.shape
    w = torch.mul(q.view(n, -1, GGUF_BLOCK), d[..., None]).add_(m[..., None])
    return w.view(n, k).to(dtype)


def gguf_float_matmul_ref(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """Float activations times the dequantized blocks (the exact-weight baseline)."""
    return F.linear(x, gguf_dequantize(q, d, m, x.dtype), None if bias is None else bias.to(x.dtype))
