"""int4 weights times int8 activations ("w4a8") on CPU: int8 dot products with AVX-512 VNNI, no float copy of W.

The int4 kernel (cpu_int4.py) dequantizes the nibbles to float32 and multiplies in float32: past a few rows it
is bound by float32 FMAs, so a 4-bit model runs no faster than float32. Here (llama.cpp's way) the activations
are quantized to int8 per row per group of the weight's group size, and the nibbles are multiplied into them
as integers with `vpdpbusd` (u8 x s8 -> int32, 64 multiply-adds an instruction); once per group the int32 sums
go to float32 with the two scales. cpu_w4a8.c beside this file has the loop, the work split and the layout.

The contract (w4a8_matmul_ref computes it on the original int4 layout, independent of the repacking):

    W[n, k] = q[n, k] * s[n, g] + z[n, g],  g = k // G  (zeros None: z = -8 s)
    per row m and group g of x (columns >= K count as 0): amax = max |x|; amax == 0: xq = 0, sa = 0; else
        inv = 127 / amax (float32 division), xq = rint(x * inv) (float32 multiply, half to even), sa = amax / 127
        xsum = the group's sum of x (float32)
    out[m, n] = sum_g ( s[n, g] * sa[m, g] * idot[m, n, g] + z[n, g] * xsum[m, g] ) (+ bias[n])
    idot[m, n, g] = sum over the group of q[n, k] * xq[m, k], exact (int32)

The only approximation against float is the activations' rounding (to 1/254 of each group's largest |x|); the
kernel differs from the reference by float32 rounding only: RTOL/ATOL below.

The weights are repacked once at load (w4a8_pack; w4a8_unpack is its inverse): per block of 16 output columns,
per chunk of 8 k, 64 bytes of nibbles; scales and zeros [ceil(N / 16), groups, 16], their dtype kept (float16
or float32): the int4 form's bytes, but for a block's padding columns. Built, named and loaded like the int4
kernel (the same flags, the "native" and "portable" builds); a group size not a multiple of 8, and a build
without AVX-512 VNNI, run the portable loop (plain C, the same integer sums).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from jobrunner.kernels.matmul.cpu_int4 import compile_command, library_name, run_over_rows
from jobrunner.kernels.matmul.quant_matmul import pack_int4, unpack_int4

SOURCE = Path(__file__).with_name("cpu_w4a8.c")
SCALE_DTYPES = (torch.float16, torch.float32)
RTOL, ATOL = 1e-4, 1e-4          # against w4a8_matmul_ref, relative to the output's max |out|
BLOCK, CHUNK = 16, 8             # output columns a block; k a chunk of 64 bytes


def w4a8_compile_command(cc: list[str], output: Path, variant: str = "native") -> list[str]:
    return compile_command(SOURCE, cc, output, variant)


def w4a8_library_name(variant: str = "native") -> str:
    return library_name(SOURCE, variant)


class W4A8Library:
    """The compiled kernel, loaded. isa: "avx512_vnni" or "portable" (the loop this build runs for G % 8 == 0);
    portable=True makes a native build run its portable loop too (tests compare the two)."""

    def __init__(self, path: Path, portable: bool = False):
        lib = ctypes.CDLL(str(path))
        ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        fn = lib.w4a8_matmul
        fn.argtypes = [ptr, i64, ptr, ptr, ptr, i32, ptr, ptr] + [i32] * 6
        fn.restype = i32
        self.quantize = lib.w4a8_quantize
        self.quantize.argtypes = [ptr, i64, ptr, i64, ptr, ptr] + [i32] * 4
        self.quantize.restype = i32
        lib.w4a8_kernel_isa.restype = i32
        self.function, self.path, self.portable = fn, path, portable
        self.isa = "avx512_vnni" if lib.w4a8_kernel_isa() and not portable else "portable"

    def covers(self, x: torch.Tensor) -> bool:
        """Whether the kernel takes this call (float32 activations on the CPU)."""
        return x.device.type == "cpu" and x.dtype == torch.float32


@dataclass(frozen=True, eq=False)
class W4A8Weights:
    """An int4 weight repacked for the kernel. qweight [ceil(N / 16), Kc, 64] uint8 (Kc = ceil(Kp / 8), Kp = K
    rounded up to the group); scales, zeros [ceil(N / 16), Kp // G, 16] in the int4 form's dtype (float16 or
    float32; zeros None: z = -8 s)."""
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    out_features: int
    in_features: int
    group_size: int

    def __post_init__(self):
        _check_packed(self)                      # once here: the kernel reads these through raw pointers

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros) if t is not None)


def _check_int4(packed, scales, zeros, group_size: int, in_features: int) -> None:
    n, half = packed.shape
    kp = half * 2
    if packed.dtype != torch.uint8 or scales.dtype not in SCALE_DTYPES:
        raise TypeError(f"w4a8_pack: packed {packed.dtype} (uint8), scales {scales.dtype} (float16 or float32)")
    if zeros is not None and (zeros.dtype != scales.dtype or zeros.shape != scales.shape):
        raise TypeError(f"w4a8_pack: zeros {zeros.dtype} {tuple(zeros.shape)} must match the scales")
    if group_size < 2 or group_size % 2 or kp % group_size or not kp - group_size < in_features <= kp \
            or scales.shape != (n, kp // group_size):
        raise ValueError(f"w4a8_pack: packed {tuple(packed.shape)}, scales {tuple(scales.shape)}, group "
                         f"{group_size}, in_features {in_features}: want Kp = in_features rounded up to the group")


def _by_block(t: torch.Tensor, nb: int) -> torch.Tensor:
    """[N, groups] -> [nb, groups, 16], columns past N zero."""
    out = torch.zeros(nb * BLOCK, t.shape[1], dtype=t.dtype)
    out[:t.shape[0]] = t
    return out.view(nb, BLOCK, -1).transpose(1, 2).contiguous()


def w4a8_pack(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
              in_features: int) -> W4A8Weights:
    """Our int4 layout (packed [N, Kp // 2] uint8, scales and zeros [N, Kp // G] float16 or float32, zeros None:
    symmetric) -> the kernel's. Pad columns (k >= in_features) keep their nibbles; pad rows are zero."""
    _check_int4(packed, scales, zeros, group_size, in_features)
    n, kp = packed.shape[0], packed.shape[1] * 2
    nb, kc = -(-n // BLOCK), -(-kp // CHUNK)
    q = torch.zeros(nb * BLOCK, kc * CHUNK, dtype=torch.uint8)
    q[:n, :kp] = unpack_int4(packed.contiguous(), group_size)
    v = q.view(nb, BLOCK, kc, 2, 4).permute(0, 2, 1, 4, 3)           # [block, chunk, column, i, low/high]
    qweight = (v[..., 0] | (v[..., 1] << 4)).contiguous().view(nb, kc, BLOCK * 4)
    return W4A8Weights(qweight, _by_block(scales, nb), None if zeros is None else _by_block(zeros, nb),
                       n, in_features, group_size)


def w4a8_unpack(w: W4A8Weights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The inverse of w4a8_pack: (packed [N, Kp // 2] uint8, scales, zeros or None), the dtype as packed."""
    nb, kc, _ = w.qweight.shape
    groups = w.scales.shape[1]
    kp = groups * w.group_size
    v = w.qweight.view(nb, kc, BLOCK, 4)
    q = torch.stack([v & 15, v >> 4], dim=-2)                          # [block, chunk, column, low/high, i]
    q = q.permute(0, 2, 1, 3, 4).reshape(nb * BLOCK, kc * CHUNK)[:w.out_features, :kp]
    rows = lambda t: t.transpose(1, 2).reshape(nb * BLOCK, groups)[:w.out_features].contiguous()  # noqa: E731
    return pack_int4(q, w.group_size), rows(w.scales), None if w.zeros is None else rows(w.zeros)


def _check_packed(w: W4A8Weights) -> None:
    """The shapes, dtypes and layout w4a8_pack makes."""
    nb, groups = -(-w.out_features // BLOCK), -(-w.in_features // w.group_size)
    kc = -(-groups * w.group_size // CHUNK)
    ok = (w.in_features >= 1 and w.group_size >= 2 and w.group_size % 2 == 0
          and w.qweight.dtype == torch.uint8 and w.qweight.shape == (nb, kc, BLOCK * 4)
          and w.scales.dtype in SCALE_DTYPES and w.scales.shape == (nb, groups, BLOCK)
          and (w.zeros is None or (w.zeros.dtype == w.scales.dtype and w.zeros.shape == w.scales.shape))
          and all(t.is_contiguous() and t.device.type == "cpu" for t in (w.qweight, w.scales, w.zeros)
                  if t is not None))
    if not ok:
        raise ValueError(f"W4A8Weights: {w.out_features} x {w.in_features}, group {w.group_size}: qweight "
                         f"{w.qweight.dtype} {tuple(w.qweight.shape)}, scales {w.scales.dtype} "
                         f"{tuple(w.scales.shape)} (want w4a8_pack's form, contiguous, on the CPU)")


def w4a8_matmul_cpu(x: torch.Tensor, w: W4A8Weights, bias: torch.Tensor | None, lib: W4A8Library) -> torch.Tensor:
    """x: [..., K] float32 -> [..., N] float32 (the contract in the module doc)."""
    k = x.shape[-1]
    if x.dtype != torch.float32:
        raise TypeError(f"w4a8_matmul_cpu: x {x.dtype}: want float32")
    if k != w.in_features:
        raise ValueError(f"w4a8_matmul_cpu: x [..., {k}] against a weight of {w.in_features} in_features")
    return run_over_rows("w4a8", x, w.out_features, bias, lambda x2, stride, b, out: lib.function(
        x2.data_ptr(), stride, w.qweight.data_ptr(), w.scales.data_ptr(),
        None if w.zeros is None else w.zeros.data_ptr(), int(w.scales.dtype == torch.float32), b, out.data_ptr(),
        x2.shape[0], w.out_features, k, w.group_size, torch.get_num_threads(), int(lib.portable)))


def w4a8_quantize_cpu(x: torch.Tensor, group_size: int, lib: W4A8Library
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's own quantization of x [M, K] float32: (xq [M, groups * G] int8, sa, xsum [M, groups])."""
    m, k = x.shape
    x2 = x if x.stride(1) == 1 else x.contiguous()
    groups = -(-k // group_size)
    xq = torch.empty(m, groups * group_size, dtype=torch.int8)
    sa, xsum = torch.empty(m, groups), torch.empty(m, groups)
    rc = lib.quantize(x2.data_ptr(), x2.stride(0) if m > 1 else k, xq.data_ptr(), xq.stride(0), sa.data_ptr(),
                      xsum.data_ptr(), m, k, group_size, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"w4a8_quantize_cpu: the kernel refused [{m}, {k}] in groups of {group_size} ({rc})")
    return xq, sa, xsum


def quantize_activations_ref(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., K] float32 -> (xq [..., groups * G] int8, sa [..., groups] float32, xsum [..., groups] float32),
    bit for bit the kernel's (xsum's last bits aside: its order is not part of the contract)."""
    k = x.shape[-1]
    groups = -(-k // group_size)
    xg = F.pad(x.float(), (0, groups * group_size - k)).unflatten(-1, (groups, group_size))
    amax = xg.abs().amax(-1)
    c127 = torch.full_like(amax, 127.0)                  # tensor / tensor: a true float32 division each
    inv = c127 / amax
    xq = torch.round(xg * inv[..., None])
    xq = torch.where((amax == 0)[..., None], torch.zeros_like(xq), xq)
    return xq.to(torch.int8).flatten(-2), amax / c127, xg.sum(-1)


def w4a8_matmul_ref(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The contract on our int4 layout (packed [N, Kp // 2], scales and zeros [N, Kp // G], zeros None: z = -8 s):
    the activations quantized as the kernel does, the integer sums exact and the rest in float64 -> [..., N]
    float32."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    _check_int4(packed, scales, zeros, group_size, k)
    n, groups = scales.shape
    xq, sa, xsum = quantize_activations_ref(x2, group_size)
    q = unpack_int4(packed.contiguous(), group_size).view(n, groups, group_size).double()
    idot = torch.einsum("mgk,ngk->mng", xq.double().view(-1, groups, group_size), q)     # exact: < 2^53
    s = scales.double()
    z = -8.0 * s if zeros is None else zeros.double()
    out = (idot * s[None] * sa.double()[:, None, :]).sum(-1) + xsum.double() @ z.t()
    if bias is not None:
        out = out + bias.double()
    return out.float().view(*x.shape[:-1], n)
