"""The matmuls of quantized checkpoints as shipped (compressed-tensors, GPTQ, AWQ), beside their references.

Weight layouts that are ours already (int4 groups, int8 groups, fp8 per channel: kernels/matmul/quant_matmul.py)
take those kernels; what is new here is what a checkpoint declares and we must reproduce as it does:

activations, quantized at run time the way compressed-tensors' forward does (its `calculate_qparams` and
`_quantize_dequantize`), in x's dtype:
    int8, symmetric:  scale = max|x| / 127.5 per token (dynamic; (127 - -128) / 2), or the checkpoint's
                      input_scale (static, per tensor); levels round(clamp(x / scale, -128, 127))
    fp8 e4m3:         scale = max|x| / 448 per token, per group of G columns, or the static input_scale;
                      levels clamp(x / scale, -448, 448) cast to float8_e4m3fn
    (a zero scale becomes its dtype's eps, as there)

fp8 weights with scales per tensor, per output channel or per [bn, bk] block (FP8_BLOCK):
    W[n, k] = q[n, k] * scale[n // bn, k // bk]       (per channel: bn = 1, bk = K)

The int8 product of int8 activations and int8 weights is exact in int32 (torch._int_mm where it is
exact for full-range operands on this device, else float64, exact too); fp8 products dequantize the
weight a slice of rows at a time (the float copy stays small) and multiply in x's dtype, or on the CPU
multiply the e4m3 bytes in the C kernel (cpu_int8.c's fp8 form) where fp8_weight_matmul's doc says.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from jobrunner.kernels.matmul.cpu_int8 import (FP8_BF16_KERNEL_ROWS, FP8_KERNEL_ROWS, Int8Library, fake_quantize_fp8_cpu,
                                               fp8_dequantize_cpu, fp8_dot_bf16_cpu, fp8_dot_cpu,
                                               fp8_matmul_cpu)
from jobrunner.kernels.matmul.quant_matmul import CPU_DEQUANT_ELEMENTS, FP8_MAX, int_mm_exact, sliced_linear
from jobrunner.kernels.common.triton_utils import use_triton

INT8_HALF_RANGE = 127.5            # compressed-tensors' symmetric scale divisor: (127 - (-128)) / 2
# fp8_weight_matmul's e4m3-activation calls take the CPU library's bf16 form where it has one (every row count: it
# matched or beat the float32 fp8 form from 1 row and float32 oneDNN from 16; benchmarks/cpu_int8_bench.py
# --part fp8-dot); False holds them to the float32 form (the benchmark's fp8-job compares the two)
FP8_DOT = True


def _nonzero(s: torch.Tensor) -> torch.Tensor:
    return torch.where(s == 0, torch.tensor(torch.finfo(s.dtype).eps, dtype=s.dtype, device=s.device), s)


def quantize_act_int8(x2: torch.Tensor, static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (int8 levels [M, K], scale [M, 1] or [1, 1] in x's dtype)."""
    if static_scale is None:
        s = _nonzero(x2.abs().amax(-1, keepdim=True) / INT8_HALF_RANGE)
    else:
        s = static_scale.to(x2.dtype).reshape(1, 1)
    return torch.round(torch.clamp(x2 / s, -128, 127)).to(torch.int8), s


def fake_quantize_fp8(x2: torch.Tensor, static_scale: torch.Tensor | None = None,
                      group: int | None = None) -> torch.Tensor:
    """[M, K] -> x quantized to e4m3 and back, in x's dtype: per token, per group of `group`
    columns (K a multiple of it) or with the static per-tensor scale."""
    if static_scale is not None:
        s = static_scale.to(x2.dtype).reshape(1, 1)
        q = torch.clamp(x2 / s, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return q.to(x2.dtype) * s
    xg = x2 if group is None else x2.unflatten(-1, (x2.shape[-1] // group, group))
    s = _nonzero(xg.abs().amax(-1, keepdim=True) / FP8_MAX)
    q = torch.clamp(xg / s, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.to(x2.dtype) * s).reshape(x2.shape)


def int8_product(xq: torch.Tensor, xs: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """(xq [M, K] int8 * xs [M, 1]) @ (qweight [N, K] int8 * scales [N, 1])^T (+ bias) -> [M, N] dtype;
    the integer sums exact."""
    m = xq.shape[0]
    if int_mm_exact(127, xq.device.type, full_range=True) and not (xq.is_cuda and (xq.shape[1] % 8 or qweight.shape[0] % 8)):
        pad = 17 - m if xq.is_cuda and m <= 16 else 0          # CUDA _int_mm wants more than 16 rows
        acc = torch._int_mm(F.pad(xq, (0, 0, 0, pad)) if pad else xq, qweight.t())[:m].float()
    else:
        acc = (xq.double() @ qweight.double().t()).float()     # |sum| < 2^24 for K < 1000, else float64's
    y = acc.mul_(xs.float()).mul_(scales.float().view(1, -1))
    if bias is not None:
        y.add_(bias.float())
    return y.to(dtype)


def w8a8_shipped_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                        bias: torch.Tensor | None = None, static_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float, int8 activations as the checkpoint says, times int8 qweight [N, K] per channel."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_act_int8(x2, static_scale)
    return int8_product(xq, xs, qweight, scales, bias, x.dtype).view(*x.shape[:-1], -1)


def w8a8_shipped_matmul_ref(x, qweight, scales, bias=None, static_scale=None):
    """What compressed-tensors computes: the fake-quantized x times the dequantized weight, in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_act_int8(x2, static_scale)
    w = qweight.to(x.dtype) * scales.to(x.dtype)
    return F.linear(xq.to(x.dtype) * xs, w, None if bias is None else bias.to(x.dtype)).view(*x.shape[:-1], -1)


# ----------------------------------------------------------------------------- fp8 weights

def dequantize_fp8(qweight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] | None,
                   dtype: torch.dtype, rows: slice = slice(None)) -> torch.Tensor:
    """Rows `rows` of W = q * scale (the module doc) in dtype: the product in the scales' dtype, as
    compressed-tensors' decompression does, then cast."""
    q = qweight[rows]
    if block is None:                                  # scales [N, 1] (per tensor: expanded at load)
        return (q.to(scales.dtype) * scales[rows]).to(dtype)
    bn, bk = block
    start = rows.start or 0
    first, last = start // bn, (start + q.shape[0] - 1) // bn + 1
    s = scales[first:last].repeat_interleave(bn, 0)[start - first * bn:][:q.shape[0]]
    s = s.repeat_interleave(bk, 1)[:, :q.shape[1]]
    return (q.to(scales.dtype) * s).to(dtype)


def fp8_weight_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] | None,
                      bias: torch.Tensor | None = None, act: str | None = None,
                      static_scale: torch.Tensor | None = None, act_group: int | None = None,
                      cpu_kernel: Int8Library | None = None) -> torch.Tensor:
    """x [..., K] (its activations fake-quantized to fp8 when act is "dynamic" or "static") times the
    fp8 weight. The Triton kernel runs block scales on CUDA. On the CPU with cpu_kernel: calls whose activations
    are quantized to e4m3 (act "dynamic" or "static"; bfloat16 ones widened first, exactly) take the bf16 form
    where the library has it (FP8_DOT; cpu_fp8_dot.c, AVX512_BF16: e4m3 times e4m3 in exact bfloat16 products,
    any number of rows), and weight-only bfloat16 calls the same form over their bfloat16 values as they are
    (fp8_dot_bf16_cpu); otherwise (cpu_int8.c's fp8 form) float32 calls (of up to FP8_KERNEL_ROWS rows without its panel path)
    multiply the e4m3 bytes (never a float weight), the activations fake-quantized there too (the same values);
    bfloat16 calls of up to FP8_BF16_KERNEL_ROWS too, in float32
    (the weight unrounded to bfloat16: closer to the exact product than the reference); more rows take the
    slices below with the library dequantizing them (dequantize_fp8's values, faster). Otherwise the weight
    is dequantized a slice of rows at a time in torch, then dense_linear (quant_matmul.sliced_linear)."""
    n, k = qweight.shape
    x2 = x.reshape(-1, k)
    if block is not None and use_triton(x) and act_group == block[1] and act == "dynamic":
        from jobrunner.kernels.matmul.fp8_block_triton import fp8_block_matmul_triton       # quantizes x2 itself, per token and group
        return fp8_block_matmul_triton(x2, qweight, scales, block, bias).view(*x.shape[:-1], n)
    lib = cpu_kernel if cpu_kernel is not None and cpu_kernel.serves_fp8(x2, qweight, scales) else None
    if FP8_DOT and lib is not None and lib.fp8_dot and act is not None and x2.dtype in (torch.float32, torch.bfloat16) \
            and (act == "static" or act_group is None or k % act_group == 0):
        static = static_scale if act == "static" else None
        y = fp8_dot_cpu(x2.float(), qweight, scales, block, bias, static, act_group, lib)   # bfloat16: widened exactly
        return y.to(x.dtype).view(*x.shape[:-1], n)
    if FP8_DOT and lib is not None and lib.fp8_dot and act is None and x2.dtype == torch.bfloat16:
        return fp8_dot_bf16_cpu(x2, qweight, scales, block, bias, lib).view(*x.shape[:-1], n)
    if act is not None:
        static = static_scale if act == "static" else None
        if lib is not None and x2.dtype == torch.float32 and (act_group is None or k % act_group == 0):
            x2 = fake_quantize_fp8_cpu(x2, static, act_group, lib)
        else:
            x2 = fake_quantize_fp8(x2, static, act_group)
    if lib is not None and x2.dtype == torch.float32 and (x2.shape[0] <= FP8_KERNEL_ROWS
                                                          or lib.fp8_panel_path(n, k, block)):
        return fp8_matmul_cpu(x2, qweight, scales, block, bias, lib).view(*x.shape[:-1], n)
    if lib is not None and x2.dtype == torch.bfloat16 and x2.shape[0] <= FP8_BF16_KERNEL_ROWS:
        y = fp8_matmul_cpu(x2.float(), qweight, scales, block, bias, lib)      # widened exactly, at the edge
        return y.to(x.dtype).view(*x.shape[:-1], n)
    b = None if bias is None else bias.to(x.dtype)
    step = max(block[0] if block else 64, min(n, CPU_DEQUANT_ELEMENTS // max(k, 1)))
    if block is not None:
        step = -(-step // block[0]) * block[0]         # slices start on a block's first row
    if lib is not None:                                # one buffer for every slice of the call
        scratch = torch.empty(min(step, n) * k, dtype=torch.float32)
        dequant = lambda rows: fp8_dequantize_cpu(qweight, scales, block, rows, lib, scratch).to(x.dtype)  # noqa: E731
    else:
        dequant = lambda rows: dequantize_fp8(qweight, scales, block, x.dtype, rows)  # noqa: E731
    return sliced_linear(x2, n, k, lambda r0, r1: dequant(slice(r0, r1)), b, step).view(*x.shape[:-1], n)


def fp8_weight_matmul_ref(x, qweight, scales, block, bias=None, act=None, static_scale=None, act_group=None):
    """The whole weight dequantized at once, the activations fake-quantized: compressed-tensors' forward."""
    k = qweight.shape[1]
    x2 = x.reshape(-1, k)
    if act is not None:
        x2 = fake_quantize_fp8(x2, static_scale if act == "static" else None, act_group)
    w = dequantize_fp8(qweight, scales, block, x.dtype)
    return F.linear(x2, w, None if bias is None else bias.to(x.dtype)).view(*x.shape[:-1], -1)
