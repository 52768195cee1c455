"""One dispatch function per op: Triton on CUDA tensors, the pure-torch reference elsewhere.

Each op lives in its own module beside its reference (`*_ref`). The engine imports only
the names below.
"""
from kernels.activation import silu_and_mul
from kernels.attention import AttentionMetadata, paged_attention, store_kv
from kernels.norm import rms_norm
from kernels.rotary import apply_rotary, rotary_cos_sin

__all__ = [
    "AttentionMetadata", "apply_rotary", "paged_attention", "rms_norm", "rotary_cos_sin",
    "silu_and_mul", "store_kv",
]
