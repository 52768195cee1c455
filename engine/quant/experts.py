"""A MoE block's stacked experts, quantized: int8 or float8 (e4m3) weights with a float32 scale per
output channel of each expert (layouts: kernels/moe/moe.py; the modules: engine/models/moe.py).

Weight-only: the fused-MoE kernel converts the 1-byte weights to the activations' dtype in registers
and scales its float32 accumulators, so only a byte per weight crosses memory in the decode steps
that MoE layers are bound by. One expert is quantized at a time (a float32 copy of one expert's
matrix, not of the layer's), into tensors allocated once per layer.
"""
from __future__ import annotations

import torch

from jobrunner.engine.config.engine_config import ConfigError
from jobrunner.engine.quant import formats

EXPERT_SCHEMES = ("int8", "fp8")


def check_expert_scheme(scheme: str) -> None:
    """ConfigError for a scheme the experts have no layout for."""
    if scheme not in EXPERT_SCHEMES:
        raise ConfigError(f"--quantization {scheme}: mixture-of-experts models support "
                          f"{' and '.join(EXPERT_SCHEMES)} only; use one of those, or none")


@torch.no_grad()
def quantize_experts(experts, scheme: str) -> None:
    """Swaps experts.w13 / w2 for quantized buffers with their scales (Experts.set_quantized)."""
    check_expert_scheme(scheme)
    quantize = formats.quantize_int8 if scheme == "int8" else formats.quantize_fp8
    qdtype = torch.int8 if scheme == "int8" else torch.float8_e4m3fn
    out = []
    for w in (experts.w13, experts.w2):                 # [E, K, N], input-major
        q = torch.empty(w.shape, dtype=qdtype, device=w.device)
        scales = torch.empty((w.shape[0], w.shape[2]), dtype=torch.float32, device=w.device)
        for e in range(w.shape[0]):
            qe, s = quantize(w[e].T.contiguous())       # [N, K] and [N, 1], as for a linear's weight
            q[e] = qe.T
            scales[e] = s[:, 0]
        out += [q, scales]
    experts.set_quantized(*out)
