"""Weight transforms: float (or GGUF blocks) -> the quantized layouts of kernels/matmul/quant_matmul.py.

Each function takes one weight [N, K] (rows = output channels) and returns the tensors a
quantized module holds. GGUF's quantized blocks run along rows, 32 elements a block, so a
row-concatenation of several GGUF tensors (q, k, v -> qkv) is a row-concatenation of their
bytes, and Q8_0 / Q4_0 / Q4_1 map onto our int8 (group 32) and int4 (group 32) layouts with
byte copies only: no float round trip, bit-exact to the file.
"""
from __future__ import annotations

import numpy as np
import torch

from jobrunner.kernels.ops import AMAX_FLOOR, FP8_MAX, pack_int4

GGUF_INT8_TYPES = ("Q8_0",)
GGUF_INT4_TYPES = ("Q4_0", "Q4_1")
GGUF_GROUP = 32


def quantize_int8(w: torch.Tensor, group_size: int | None = None, qmax: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8: w [N, K] -> (qweight int8 [N, K], scales float32 [N, K // G]).
    group_size None: one scale per output channel. qmax < 127 narrows the range (w8a8 on CPUs
    whose int8 GEMM needs 7-bit weights)."""
    n, k = w.shape
    g = k if group_size is None else group_size
    if k % g:
        raise ValueError(f"in_features {k} is not a multiple of the group size {g}")
    wf = w.float().view(n, k // g, g)
    scales = wf.abs().amax(-1).clamp_(min=AMAX_FLOOR) / qmax        # [N, K // G]
    q = torch.round(wf / scales[..., None]).clamp_(-qmax, qmax).to(torch.int8)
    return q.view(n, k), scales


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group (min/max, like GGUF Q4_1): w [N, K] -> (packed uint8 [N, Kp // 2],
    scales float16 [N, Kp // G], zeros float16 [N, Kp // G]), Kp = K rounded up to G (pad with 0).
    The nibbles are computed against the float16-rounded scale and zero that are stored."""
    if group_size < 2 or group_size % 2:
        raise ValueError(f"int4 group size must be even, got {group_size}")
    n, k = w.shape
    kp = -(-k // group_size) * group_size
    wf = w.float()
    if kp != k:
        wf = torch.nn.functional.pad(wf, (0, kp - k))
    wf = wf.view(n, kp // group_size, group_size)
    lo, hi = wf.amin(-1), wf.amax(-1)
    scales = ((hi - lo) / 15.0).half()
    zeros = lo.half()
    s = scales.float()
    s = torch.where(s > 0, s, torch.ones_like(s))       # a constant group: every nibble 0
    q = torch.round((wf - zeros.float()[..., None]) / s[..., None]).clamp_(0, 15)
    return pack_int4(q.view(n, kp), group_size), scales, zeros


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 per output channel: w [N, K] -> (float8_e4m3fn [N, K], float32 scales [N, 1])."""
    wf = w.float()
    scales = wf.abs().amax(-1, keepdim=True).clamp_(min=AMAX_FLOOR) / FP8_MAX
    return (wf / scales).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scales


# ----------------------------------------------------------------------------- GGUF blocks

def _gguf_rows(raws, block_bytes: int) -> torch.Tensor:
    """Rows of one or more RawTensors (same type and K), concatenated -> uint8 [N, K // 32, block_bytes]."""
    data = raws[0].data if len(raws) == 1 else np.concatenate([r.data for r in raws], axis=0)
    t = torch.from_numpy(np.ascontiguousarray(data))
    return t.view(t.shape[0], -1, block_bytes)


def _f16_field(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of each block: [N, B, bytes] -> [N, B] float16 (a copy)."""
    return blocks[..., start:start + 2].contiguous().view(torch.float16)[..., 0]


def int8_from_gguf(raws) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks (f16 d, int8 q[32]; w = d * q) -> (qweight int8 [N, K], scales float32 [N, K // 32])."""
    blocks = _gguf_rows(raws, 34)
    n = blocks.shape[0]
    q = blocks[..., 2:].contiguous().view(torch.int8).reshape(n, -1)
    return q, _f16_field(blocks, 0).float()


def int4_from_gguf(raws) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 (f16 d, u8 qs[16]; w = d * (q - 8)) or Q4_1 (f16 d, f16 m, u8 qs[16]; w = d * q + m)
    -> (packed uint8 [N, K // 2], scales float16, zeros float16 [N, K // 32]). The nibble order of a
    block is our int4 group order, so the bytes are copied unchanged; Q4_0's offset becomes
    zeros = -8 d (exact in float16)."""
    kind = raws[0].ggml_type
    if kind == "Q4_1":
        blocks = _gguf_rows(raws, 20)
        scales, zeros, qs = _f16_field(blocks, 0), _f16_field(blocks, 2), blocks[..., 4:]
    elif kind == "Q4_0":
        blocks = _gguf_rows(raws, 18)
        scales, qs = _f16_field(blocks, 0), blocks[..., 2:]
        zeros = scales * -8.0
    else:
        raise ValueError(f"not a 4-bit GGUF type: {kind}")
    n = blocks.shape[0]
    return qs.contiguous().view(n, -1), scales.contiguous(), zeros.contiguous()
