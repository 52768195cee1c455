"""The modules a shipped checkpoint needs beyond engine/quant/linear.py's (which take its int4 and
int8 weight-only linears as they are):

    ShippedW8A8Linear   int8 weights per channel x int8 activations quantized as the checkpoint says
                        (compressed-tensors: per token max / 127.5, or its static input_scale)
    Fp8WeightLinear     fp8 weights (per tensor, channel or block scales), activations none, fp8 per
                        token, per group, or static
    PermutedInput       act-order (GPTQ desc_act): the input's columns put in group order first
    ConcatLinear        parts of one fused projection (q, k, v) that cannot share one module
    ShippedExperts      a MoE block's experts as one module per projection of each expert
"""
from __future__ import annotations

import torch
from torch import nn

from jobrunner.engine.quant.linear import QuantLinear
from jobrunner.kernels.ops import dequantize_fp8, fp8_matmul, fp8_weight_matmul, fp8_weight_matmul_ref, moe_by_expert, silu_and_mul, w8a8_shipped_matmul, w8a8_shipped_matmul_ref


class ShippedW8A8Linear(QuantLinear):
    scheme = "w8a8"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 input_scale: torch.Tensor | None = None):
        super().__init__(qweight.shape[1], qweight.shape[0], bias)
        self.register_buffer("qweight", qweight)            # [N, K] int8, levels in [-128, 127]
        self.register_buffer("scales", scales)              # [N, 1] float32
        self.register_buffer("input_scale", input_scale)    # [1] static, or None: per token

    def forward(self, x):
        return w8a8_shipped_matmul(x, self.qweight, self.scales, self.bias, self.input_scale)

    def forward_ref(self, x):
        return w8a8_shipped_matmul_ref(x, self.qweight, self.scales, self.bias, self.input_scale)

    def dequantize(self, dtype=torch.float32):
        return (self.qweight.float() * self.scales).to(dtype)


class Fp8WeightLinear(QuantLinear):
    scheme = "fp8"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] | None,
                 bias: torch.Tensor | None = None, act: str | None = None,
                 input_scale: torch.Tensor | None = None, act_group: int | None = None):
        super().__init__(qweight.shape[1], qweight.shape[0], bias)
        self.block, self.act, self.act_group = block, act, act_group     # act: None | "dynamic" | "static"
        self.register_buffer("qweight", qweight)            # [N, K] float8_e4m3fn
        self.register_buffer("scales", scales)              # [N, 1] or the block grid, float32
        self.register_buffer("input_scale", input_scale)
        self.cpu_kernel = None          # the CPU fp8 kernel, once engine/run/cpu_kernel_build.py hands it

    def forward(self, x):
        n, k = self.qweight.shape
        if x.is_cuda and self.block is None and self.act == "dynamic" and self.act_group is None \
                and k % 16 == 0 and n % 16 == 0:            # per-token activations: torch._scaled_mm
            return fp8_matmul(x, self.qweight, self.scales, self.bias, rowwise=True)
        return fp8_weight_matmul(x, self.qweight, self.scales, self.block, self.bias, self.act,
                                 self.input_scale, self.act_group, self.cpu_kernel)

    def forward_ref(self, x):
        return fp8_weight_matmul_ref(x, self.qweight, self.scales, self.block, self.bias, self.act,
                                     self.input_scale, self.act_group)

    def dequantize(self, dtype=torch.float32):
        return dequantize_fp8(self.qweight, self.scales, self.block, dtype)

    def extra_repr(self):
        return super().extra_repr() + f", block={self.block}, act={self.act}"


class PermutedInput(nn.Module):
    """inner(x[..., perm]): inner's weight columns are stored in group order (perm: g_idx's stable sort)."""

    def __init__(self, inner: nn.Module, perm: torch.Tensor):
        super().__init__()
        self.inner = inner
        self.in_features, self.out_features = inner.in_features, inner.out_features
        self.register_buffer("perm", perm)

    def forward(self, x):
        return self.inner(x.index_select(-1, self.perm))

    def dequantize(self, dtype=torch.float32):
        w = self.inner.dequantize(dtype)
        return torch.empty_like(w).index_copy_(1, self.perm, w)


class ConcatLinear(nn.Module):
    """Output columns of several linears over the same input, in order (a fused qkv whose parts differ)."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x):
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def dequantize(self, dtype=torch.float32):
        return torch.cat([p.dequantize(dtype) for p in self.parts], dim=0)


class ShippedExperts(nn.Module):
    """Each expert's gate_up and down projections as quantized modules (any shipped scheme), run by
    expert over the tokens routed to it (kernels.moe_by_expert): as HF runs the checkpoint's experts."""

    def __init__(self, gate_up: list[nn.Module], down: list[nn.Module]):
        super().__init__()
        self.gate_up, self.down = nn.ModuleList(gate_up), nn.ModuleList(down)

    def forward(self, x, topk_weights, topk_ids, foreign: bool = False):
        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            return self.down[e](silu_and_mul(self.gate_up[e](rows)))
        return moe_by_expert(x, topk_weights, topk_ids, len(self.down), expert, foreign)
