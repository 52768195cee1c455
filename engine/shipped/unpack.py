"""One linear's stored tensors -> its levels: integer (IntLevels) or fp8 (FloatLevels), in one form for
every format, so engine/shipped/build.py makes our modules from either without knowing the format.

    IntLevels:   W[n, k] = (q[n, k] - zero[n, g(k)]) * scale[n, g(k)]      q, zero signed int8
                 g(k) = k // group, or g_idx[k] (GPTQ act order: columns not in group order)
    FloatLevels: W[n, k] = q[n, k] * scale[n // bn, k // bk]               per channel: [N, 1]

The stored layouts (names as the checkpoint has them, after the module's "<name>."):

compressed-tensors (its compressors/pack_quantized/helpers.py and naive/float compressors)
    pack-quantized   weight_packed int32 [N, ceil(K bits / 32)]: level + 2^(bits-1) at bits * i of the
                     row's bit string, little-endian words; weight_shape [N, K]; weight_scale [N, G];
                     weight_zero_point int32 packed the same way along dim 0 (asymmetric); weight_g_idx [K]
    int-quantized    weight int8 [N, K] levels; weight_scale; weight_zero_point (int8, asymmetric)
    float-quantized  weight float8_e4m3fn [N, K]; weight_scale [1] | [N, 1] | [ceil(N/bn), ceil(K/bk)]
    naive-quantized  weight as levels in int8 or float8, as the two above
    (static activations: input_scale [1])
GPTQ (AutoGPTQ / GPTQModel's `pack`)
    qweight int32 [K bits / 32, N]: levels (unsigned) packed along K, low bits first; qzeros int32
    [G, N bits / 32] packed along N, stored minus one in checkpoint_format "gptq" (v1); scales [G, N];
    g_idx int32 [K]; W = (q - z) * s
AWQ GEMM (AutoAWQ's WQLinear_GEMM.from_linear)
    qweight int32 [K, N / 8] and qzeros int32 [G, N / 8], packed along N: nibble i of a word holds
    column 8 c + AWQ_ORDER[i]; scales [G, N]; W = (q - z) * s
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from jobrunner.engine.api.errors import ModelError
from jobrunner.engine.shipped.scheme import ModuleScheme

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass
class IntLevels:
    q: torch.Tensor                     # int8 [N, K]
    scale: torch.Tensor                 # float32 [N, groups]
    zero: torch.Tensor | None           # int8 [N, groups]; None: symmetric
    bits: int
    group: int                          # columns a scale covers (K: per channel)
    g_idx: torch.Tensor | None = None   # int64 [K], only where not k // group
    input_scale: torch.Tensor | None = None


@dataclass
class FloatLevels:
    q: torch.Tensor                     # float8_e4m3fn [N, K]
    scale: torch.Tensor                 # float32 [N, 1] or [ceil(N / bn), ceil(K / bk)]
    block: tuple[int, int] | None
    input_scale: torch.Tensor | None = None


def required(scheme: ModuleScheme) -> tuple[str, ...]:
    """The tensors (names after the module's) a linear of this scheme must have."""
    w = scheme.weights
    if scheme.format == "gptq":
        return ("qweight", "qzeros", "scales") + (("g_idx",) if scheme.desc_act else ())
    if scheme.format == "awq":
        return ("qweight", "qzeros", "scales")
    names = ("weight_packed", "weight_shape") if scheme.format == "pack-quantized" else ("weight",)
    names += ("weight_scale",)
    if w.type == "int" and not w.symmetric:
        names += ("weight_zero_point",)
    if scheme.desc_act:
        names += ("weight_g_idx",)
    if scheme.acts is not None and not scheme.acts.dynamic:
        names += ("input_scale",)
    return names


def unpack(scheme: ModuleScheme, t: dict[str, torch.Tensor], where: str) -> IntLevels | FloatLevels:
    """The levels of the linear `where` from its tensors `t` (suffix -> tensor)."""
    try:
        if scheme.format == "gptq":
            return _gptq(scheme, t)
        if scheme.format == "awq":
            return _awq(scheme, t)
        return _compressed_tensors(scheme, t)
    except (RuntimeError, ValueError, IndexError) as e:
        shapes = {k: tuple(v.shape) for k, v in t.items()}
        raise ModelError(f"{where}: its quantized tensors do not fit the checkpoint's scheme "
                         f"{scheme.describe()} ({e}; tensors {shapes})") from e


def _compressed_tensors(scheme: ModuleScheme, t: dict) -> IntLevels | FloatLevels:
    w = scheme.weights
    static = t.get("input_scale")
    static = None if static is None else static.float().reshape(1)
    if w.type == "float":
        q = t["weight"]
        if q.dtype != torch.float8_e4m3fn:
            raise ValueError(f"fp8 weights stored as {q.dtype}")
        n, k = q.shape
        scale = t["weight_scale"].float()
        if w.strategy == "block":
            bn, bk = w.block
            scale = scale.reshape(-(-n // bn), -(-k // bk))
            return FloatLevels(q, scale.contiguous(), (bn, bk), static)
        return FloatLevels(q, _per_row(scale, n), None, static)
    if scheme.format == "pack-quantized":
        n, k = (int(v) for v in t["weight_shape"].tolist())
        q = unpack_int32(t["weight_packed"], w.bits, k)
    else:
        q = t["weight"]
        if q.dtype != torch.int8:
            raise ValueError(f"int levels stored as {q.dtype}")
        n, k = q.shape
    scale = t["weight_scale"].float()
    group = w.group_size if w.strategy == "group" else k
    groups = -(-k // group)
    scale = _per_row(scale, n) if w.strategy in ("tensor", "channel") else scale.reshape(n, groups)
    zero = None
    if not w.symmetric:
        z = t["weight_zero_point"]
        if z.dtype == torch.int32 and scheme.format == "pack-quantized":
            z = unpack_int32(z.t().contiguous(), w.bits, n).t()      # packed along dim 0
        zero = _per_row(z, n) if w.strategy in ("tensor", "channel") else z.reshape(n, groups)
        zero = zero.to(torch.int8)
    g_idx = t.get("weight_g_idx")
    return IntLevels(q, scale.contiguous(), zero, w.bits, group, _act_order(g_idx, group, k), static)


def _per_row(v: torch.Tensor, n: int) -> torch.Tensor:
    """A per-tensor ([1] or []) or per-channel ([N] or [N, 1]) value as [N, 1]."""
    return v.reshape(-1, 1).expand(n, 1).contiguous() if v.numel() == 1 else v.reshape(n, 1)


def unpack_int32(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """int32 [R, W] holding 32 / bits unsigned levels a word, lowest bits first -> signed int8 [R, cols]
    (level - 2^(bits-1))."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    u = (packed[..., None] >> shifts) & ((1 << bits) - 1)                 # [R, W, per_word]
    u = u.reshape(packed.shape[0], packed.shape[1] * per_word)[:, :cols]
    return (u - (1 << (bits - 1))).to(torch.int8)


def _act_order(g_idx: torch.Tensor | None, group: int, k: int) -> torch.Tensor | None:
    """g_idx when it is not the plain k // group (act order), else None; every group must hold
    exactly `group` columns, so the columns sorted by group are our contiguous groups."""
    if g_idx is None:
        return None
    g = g_idx.long().reshape(-1)
    if g.numel() != k:
        raise ValueError(f"g_idx has {g.numel()} entries for {k} columns")
    plain = torch.arange(k, device=g.device) // group
    if torch.equal(g, plain):
        return None
    counts = torch.bincount(g, minlength=-(-k // group))
    if k % group or not bool((counts == group).all()):
        raise ValueError(f"g_idx's groups are not all {group} columns")
    return g


def _gptq(scheme: ModuleScheme, t: dict) -> IntLevels:
    bits = scheme.weights.bits
    qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
    k, n = qweight.shape[0] * 32 // bits, qweight.shape[1]
    q = unpack_int32(qweight.t().contiguous(), bits, k)                      # packed along K -> [N, K]
    z = unpack_int32(qzeros, bits, n).t().to(torch.int16)                     # [N, G], signed
    if scheme.zeros_minus_one:
        z = z + 1
    groups = scales.shape[0]
    group = k // groups if scheme.weights.group_size is None else scheme.weights.group_size
    zero = None if bool((z == 0).all()) else z.to(torch.int8)
    g_idx = t.get("g_idx") if scheme.desc_act else None
    return IntLevels(q, scales.float().t().contiguous(), zero, bits, group, _act_order(g_idx, group, k))


def _awq(scheme: ModuleScheme, t: dict) -> IntLevels:
    qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
    k, n = qweight.shape[0], qweight.shape[1] * 8
    q = unpack_int32(qweight, 4, n)                 # [K, N], nibble order within each word
    z = unpack_int32(qzeros, 4, n)                  # [G, N]
    # column 8c + AWQ_ORDER[i] sits at nibble 8c + i, so column 8c + j at 8c + argsort(AWQ_ORDER)[j]
    columns = torch.arange(n).view(-1, 8)[:, torch.tensor(AWQ_ORDER).argsort()].reshape(-1)
    q = q[:, columns].t().contiguous()
    z = z[:, columns].t().contiguous()
    groups = scales.shape[0]
    return IntLevels(q, scales.float().t().contiguous(), z, 4, k // groups)
