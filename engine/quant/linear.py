"""Quantized drop-in replacements for nn.Linear and nn.Embedding.

Every quantized tensor is a registered buffer, so `model.buffers()` (and the runtime's
`weight_bytes`) sees what the model holds; a tied embedding and lm_head share the same
buffer objects. Each linear keeps `forward_ref`, a plain torch forward that is the
reference its fast `forward` (kernel) is tested against, and `dequantize(dtype)`.

    module          buffers                                              forward
    Int8Linear      qweight int8 [N, K], scales f32 [N, K // G]          int8_matmul (Triton on CUDA); on CPU
                    (zeros f32 [N, K // G] or None)                      the C kernel over the int8 weight,
                                                                          when built (else dequantize + matmul)
    Int4Linear      packed u8 [N, Kp // 2], scales/zeros f16 [N, Kp // G] int4_matmul (same; on CPU the C kernel
                                                                          over the nibbles, when built)
    W4A8Linear      Int4Linear's (the w4a8 kernel's layout once attached) per-row-and-group int8 x, int8 dot
                                                                          products (the CPU w4a8 kernel)
    W8A8Linear      qweight int8 [N, K], scales f32 [N, 1]               per-token int8 x, torch._int_mm
                    (fbgemm backend: a prepacked weight instead)         (or fbgemm dynamic linear)
    Fp8Linear       qweight e4m3 [N, K], scales f32 [N, 1]               torch._scaled_mm (CUDA >= 8.9)
    QuantEmbedding  qweight int8 [V, H], scales f32 [V, H // G]          gather rows, dequantize
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from jobrunner.kernels.ops import W4A8Weights, widened_bf16, dequantize_int4, w4a8_matmul_cpu, w4a8_matmul_ref, w4a8_pack, w4a8_unpack, dequantize_int8, fp8_matmul, fp8_matmul_ref, int4_matmul, int4_matmul_ref, fbgemm_full_range, int8_dot_bf16_cpu, int8_matmul, int8_matmul_cpu, w8a8_matmul_fbgemm, w8a8_matmul_int_mm, w8a8_matmul_ref, w8a8_per_batch_ref


class QuantLinear(nn.Module):
    """Base: shapes, bias (a float buffer or None), repr."""
    scheme = "?"

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        if bias is not None:
            self.register_buffer("bias", bias.detach().clone())
        else:
            self.bias = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The effective weight [out_features, in_features] in dtype."""
        raise NotImplementedError

    def forward_ref(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Linear(QuantLinear):
    """Weight-only int8, symmetric, per output channel (or per group of G columns, from GGUF Q8_0 or a
    shipped checkpoint); a shipped asymmetric one adds `zeros` (W = q * s + zeros, by group)."""
    scheme = "int8"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 zeros: torch.Tensor | None = None):
        super().__init__(qweight.shape[1], qweight.shape[0], bias)
        self.register_buffer("qweight", qweight)    # [N, K] int8
        self.register_buffer("scales", scales)      # [N, K // G] float32
        self.register_buffer("zeros", zeros)        # [N, K // G] float32, or None
        self.cpu_kernel = None                      # the CPU int8 kernel, once engine/run/cpu_kernel_build.py hands it

    @property
    def group_size(self) -> int:
        return self.in_features // self.scales.shape[1]

    def forward(self, x):
        if self.cpu_kernel is not None and self.cpu_kernel.takes_bf16_dot(x, self.zeros):
            return int8_dot_bf16_cpu(x, self.qweight, self.scales, self.bias, self.cpu_kernel)
        if self.cpu_kernel is not None and self.cpu_kernel.takes(x, self.scales, self.zeros):
            return int8_matmul_cpu(x, self.qweight, self.scales, self.zeros, self.bias, self.cpu_kernel)
        # bfloat16: widened for decode-sized calls, and for any call the panel path takes (float32's GEMM rate:
        # twice the bfloat16 slices dequantized at every call, int4 mode's int8 lm_head at 64 rows)
        x32 = None if self.cpu_kernel is None else widened_bf16(
            x, self.cpu_kernel.panel_path_for(self.in_features, self.scales, self.zeros))
        if x32 is not None and self.cpu_kernel.takes(x32, self.scales, self.zeros):
            return int8_matmul_cpu(x32, self.qweight, self.scales, self.zeros, self.bias, self.cpu_kernel).to(x.dtype)
        y = int8_matmul(x, self.qweight, self.scales, self.bias)
        return y if self.zeros is None else y + self._zero_terms(x)

    def forward_ref(self, x):
        return F.linear(x, self.dequantize(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def _zero_terms(self, x):
        """x @ zeros' columns spread over their groups: each group's sum of x times its zero."""
        groups = self.scales.shape[1]
        sums = x.reshape(*x.shape[:-1], groups, self.in_features // groups).sum(-1)
        return (sums @ self.zeros.to(x.dtype).t())

    def dequantize(self, dtype=torch.float32):
        w = dequantize_int8(self.qweight, self.scales, torch.float32)
        if self.zeros is not None:
            w = (w.view(self.out_features, self.zeros.shape[1], -1) + self.zeros[..., None]).view_as(w)
        return w.to(dtype)

    def extra_repr(self):
        return super().extra_repr() + f", group_size={self.group_size}"


class Int4Linear(QuantLinear):
    """Weight-only int4, asymmetric per group of `group_size` columns, two nibbles a byte."""
    scheme = "int4"

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 in_features: int, bias: torch.Tensor | None = None):
        super().__init__(in_features, packed.shape[0], bias)
        self.group_size = group_size
        self.register_buffer("packed", packed)      # [N, Kp // 2] uint8
        self.register_buffer("scales", scales)      # [N, Kp // G] float16
        self.register_buffer("zeros", zeros)        # [N, Kp // G] float16
        self.cpu_kernel = None                      # the CPU int4 kernel, once engine/run/cpu_kernel_build.py hands it

    def forward(self, x):
        return int4_matmul(x, self.packed, self.scales, self.zeros, self.group_size, self.bias, self.cpu_kernel)

    def forward_ref(self, x):
        return int4_matmul_ref(x, self.packed, self.scales, self.zeros, self.group_size, self.bias)

    def dequantize(self, dtype=torch.float32):
        return dequantize_int4(self.packed, self.scales, self.zeros, self.group_size, self.in_features, dtype)

    def extra_repr(self):
        return super().extra_repr() + f", group_size={self.group_size}"


class W4A8Linear(Int4Linear):
    """int4's weights times activations quantized to int8 per row and group at run time: a CPU speed mode
    (llama.cpp's Q4 x Q8 arithmetic: exact int32 dot products, VNNI; kernels/matmul/cpu_w4a8.py has the
    contract). use_kernel repacks the buffers into the kernel's layout once (the same bytes, no second
    copy); without the kernel, the torch reference of the same arithmetic (slow: float64)."""
    scheme = "w4a8"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kernel_weights: W4A8Weights | None = None     # the buffers, in the kernel's layout

    def use_kernel(self, lib) -> None:
        if self.kernel_weights is None:
            w = w4a8_pack(self.packed, self.scales, self.zeros, self.group_size, self.in_features)
            self.packed, self.scales, self.zeros = w.qweight, w.scales, w.zeros
            self.kernel_weights = w
        self.cpu_kernel = lib

    def int4_buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(packed, scales, zeros) in the int4 layout (Int4Linear's), unpacked where the kernel's layout holds them."""
        if self.kernel_weights is None:
            return self.packed, self.scales, self.zeros
        return w4a8_unpack(self.kernel_weights)

    def forward(self, x):
        x32 = x.float()         # the activations are rounded to int8 anyway: any float dtype widens first
        if self.cpu_kernel is not None and self.cpu_kernel.covers(x32):
            return w4a8_matmul_cpu(x32, self.kernel_weights, self.bias, self.cpu_kernel).to(x.dtype)
        return self.forward_ref(x)

    def forward_ref(self, x):
        y = w4a8_matmul_ref(x.float(), *self.int4_buffers(), self.group_size, self.bias)
        return y.to(x.dtype)

    def dequantize(self, dtype=torch.float32):
        packed, scales, zeros = self.int4_buffers()
        if zeros is None:               # the kernel's layout keeps symmetric weights' zeros implicit (-8 s)
            zeros = -8 * scales
        return dequantize_int4(packed, scales, zeros, self.group_size, self.in_features, dtype)


class W8A8Linear(QuantLinear):
    """int8 weights (per channel) times int8 activations quantized at run time.

    backend "int_mm": activations per token, exact int32 product through torch._int_mm (oneDNN
        on CPU, cuBLASLt on CUDA); a row's result never depends on its batch mates.
    backend "fbgemm": torch.ao's dynamic quantized linear (prepacked weight; activations per
        batch, 8-bit where exact (VNNI) else 7-bit, each row scaled to max |x| = 1 first:
        kernels.w8a8_matmul_fbgemm). Its packed weight is not a tensor, so a stride-0 placeholder buffer of
        the same byte count (`packed_nbytes`) keeps `weight_bytes` honest; `qweight` unpacks.
    backend "ref": w8a8_matmul_ref (exact, float64; where neither kernel is usable).
    """
    scheme = "w8a8"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 backend: str = "int_mm"):
        super().__init__(qweight.shape[1], qweight.shape[0], bias)
        if scales.shape != (qweight.shape[0], 1):
            raise ValueError(f"w8a8 needs one scale per output channel, got scales {tuple(scales.shape)}")
        self.backend = backend
        if backend == "fbgemm":
            self.reduce_range = not fbgemm_full_range()      # 7-bit activations only where 8 would saturate
            with warnings.catch_warnings():   # torch marks quantized tensors deprecated (moving to torchao)
                warnings.simplefilter("ignore")
                qw = torch._make_per_channel_quantized_tensor(
                    qweight.cpu(), scales[:, 0].double().cpu(), torch.zeros(qweight.shape[0], dtype=torch.long), 0)
            self._packed = torch.ops.quantized.linear_prepack(qw, None)     # the bias is added after the row scales
            self.register_buffer("scales", scales)
            nbytes = qweight.numel() + 4 * qweight.shape[0]      # packed int8 matrix + column offsets
            self.register_buffer("packed_nbytes", torch.zeros(1, dtype=torch.uint8).expand(nbytes),
                                 persistent=False)
        else:
            self.register_buffer("qweight", qweight)    # [N, K] int8
            self.register_buffer("scales", scales)      # [N, 1] float32

    def __getattr__(self, name):
        if name == "qweight" and self.__dict__.get("backend") == "fbgemm":
            return torch.ops.quantized.linear_unpack(self._packed)[0].int_repr()
        return super().__getattr__(name)

    def forward(self, x):
        if self.backend == "int_mm" and not (x.is_cuda and (self.in_features % 8 or self.out_features % 8)):
            # (cuBLASLt's int8 GEMM wants K and N multiples of 8)
            return w8a8_matmul_int_mm(x, self.qweight, self.scales, self.bias)
        if self.backend == "fbgemm":
            return w8a8_matmul_fbgemm(x, self._packed, self.out_features, self.bias,
                                      reduce_range=self.reduce_range)
        return w8a8_matmul_ref(x, self.qweight, self.scales, self.bias)

    def forward_ref(self, x):
        if self.backend == "fbgemm":
            return w8a8_per_batch_ref(x, self.qweight, self.scales, self.bias, reduce_range=self.reduce_range)
        return w8a8_matmul_ref(x, self.qweight, self.scales, self.bias)

    def dequantize(self, dtype=torch.float32):
        return dequantize_int8(self.qweight, self.scales, dtype)

    def extra_repr(self):
        return super().extra_repr() + f", backend={self.backend}"


class Fp8Linear(QuantLinear):
    """float8_e4m3fn weights per channel, activations scaled per token; torch._scaled_mm."""
    scheme = "fp8"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 rowwise: bool = True):
        super().__init__(qweight.shape[1], qweight.shape[0], bias)
        self.register_buffer("qweight", qweight)    # [N, K] float8_e4m3fn
        self.register_buffer("scales", scales)      # [N, 1] float32
        self.rowwise = rowwise

    def forward(self, x):
        n, k = self.qweight.shape
        if x.is_cuda and k % 16 == 0 and n % 16 == 0:
            return fp8_matmul(x, self.qweight, self.scales, self.bias, self.rowwise)
        return self.forward_ref(x)

    def forward_ref(self, x):
        return fp8_matmul_ref(x, self.qweight, self.scales, self.bias)

    def dequantize(self, dtype=torch.float32):
        return (self.qweight.float() * self.scales.float()).to(dtype)


class QuantEmbedding(nn.Module):
    """int8 rows (per row, or per group of 32 from GGUF Q8_0); looked-up rows are dequantized to
    `dtype`. Its buffers double as a tied lm_head's weight (a row of the embedding is an output
    channel of the head, so per-row scales are per-channel scales there)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim = qweight.shape
        self.dtype = dtype
        self.register_buffer("qweight", qweight)    # [V, H] int8
        self.register_buffer("scales", scales)      # [V, H // G] float32

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize_int8(self.qweight[ids.reshape(-1)], self.scales[ids.reshape(-1)],
                                  self.dtype).view(*ids.shape, self.embedding_dim)

    def dequantize(self, dtype=torch.float32):
        return dequantize_int8(self.qweight, self.scales, dtype)

    def extra_repr(self):
        return (f"{self.num_embeddings}, {self.embedding_dim}, group_size="
                f"{self.embedding_dim // self.scales.shape[1]}, dtype={self.dtype}")
