"""The kernels' public names: one dispatch function per op, Triton on CUDA tensors, the pure-torch
reference elsewhere. Each op is a folder with its dispatch and reference beside its Triton form; the
engine imports only the names below (`from jobrunner.kernels.ops import ...`), never an op's module.
Importing this needs torch and numpy only: triton is imported on first use of a Triton path
(kernels/common/triton_utils.py).

The folder kernels/ has no __init__.py on purpose: installed it is jobrunner.kernels (a namespace
package inside jobrunner), and in a checkout's root it never stands in for Hugging Face's `kernels`
package (which transformers imports), since a regular package later on sys.path wins over a folder
without __init__.py.
"""
from jobrunner.kernels.activation.activation import gelu_tanh_and_mul, silu_and_mul
from jobrunner.kernels.attention.attention import AttentionMetadata, paged_attention, store_kv
from jobrunner.kernels.attention.metadata import choose_num_splits
from jobrunner.kernels.attention.cpu_attention import CpuDecode, DecodeLibrary, compile_command, library_name
from jobrunner.kernels.matmul.cpu_int4 import (Int4Library, int4_bf16_matmul_cpu, int4_compile_command, int4_library_name,
                                              int4_matmul_cpu)
from jobrunner.kernels.matmul.cpu_w4a8 import W4A8Library, W4A8Weights, quantize_activations_ref, w4a8_compile_command, w4a8_library_name, w4a8_matmul_cpu, w4a8_matmul_ref, w4a8_pack, w4a8_quantize_cpu, w4a8_unpack
from jobrunner.kernels.matmul.cpu_int8 import CPU_INT8_MAX_ROWS, Int8Library, fp8_matmul_cpu, int8_compile_command, int8_dot_bf16_cpu, int8_library_name, int8_matmul_cpu
from jobrunner.kernels.matmul.invariant_matmul import InvariantLinear, invariant_linear
from jobrunner.kernels.matmul.cpu_f32 import F32Library, f32_compile_command, f32_library_name, f32_matmul_cpu, pack_panels
from jobrunner.kernels.matmul.cpu_linear import PACKED_DTYPES, PackedLinear, pack_linear, packed_error, packing_available
from jobrunner.kernels.common.device import to_device
from jobrunner.kernels.attention.kv_int8 import store_kv_int8
from jobrunner.kernels.lora.sgmv import Segments, sgmv, sgmv_ref
from jobrunner.kernels.moe.moe import combine_in_expert_order, fused_moe, fused_moe_ref, moe_by_expert, moe_over_linears, route_topk
from jobrunner.kernels.norm.norm import rms_norm
from jobrunner.kernels.matmul.quant_matmul import AMAX_FLOOR, FP8_MAX, widened_bf16, dequantize_int4, dequantize_int8, fbgemm_full_range, fp8_matmul, fp8_matmul_ref, int4_matmul, int4_matmul_ref, int8_matmul, int8_matmul_ref, int_mm_exact, pack_int4, w8a8_matmul_fbgemm, w8a8_matmul_int_mm, w8a8_matmul_ref, w8a8_per_batch_ref
from jobrunner.kernels.matmul.shipped_quant import dequantize_fp8, fake_quantize_fp8, fp8_weight_matmul, fp8_weight_matmul_ref, quantize_act_int8, w8a8_shipped_matmul, w8a8_shipped_matmul_ref
from jobrunner.kernels.rotary.rotary import apply_rotary, attention_factor, inverse_frequencies, rotary_cos_sin
from jobrunner.kernels.token_mask.token_mask import apply_token_bitmask

__all__ = [
    # attention over the paged KV cache (float or int8 cache)
    "AttentionMetadata", "choose_num_splits", "paged_attention", "store_kv", "store_kv_int8",
    # the in-place CPU decode attention: its C library's compile command and name, its loader
    # (engine/run/cpu_decode.py builds, keeps and loads it)
    "CpuDecode", "DecodeLibrary", "compile_command", "library_name",
    # the CPU int4 matmul over packed nibbles: its C library's compile command, name, loader and launcher
    # (engine/run/cpu_kernel_build.py builds, keeps and hands it to the int4 linears)
    "Int4Library", "int4_bf16_matmul_cpu", "int4_compile_command", "int4_library_name", "int4_matmul_cpu",
    # the CPU w4a8 matmul (int4 weights x int8 activations, AVX-512 VNNI): the same, its weights' repacking and
    # its torch reference (the contract)
    "W4A8Library", "W4A8Weights", "quantize_activations_ref", "w4a8_compile_command", "w4a8_library_name",
    "w4a8_matmul_cpu", "w4a8_matmul_ref", "w4a8_pack", "w4a8_quantize_cpu", "w4a8_unpack",
    # the CPU weight-only int8 matmul, float activations: the same, for the int8 linears (and its fp8 form
    # for a shipped checkpoint's fp8 linears)
    "CPU_INT8_MAX_ROWS", "Int8Library", "fp8_matmul_cpu", "int8_compile_command", "int8_library_name",
    "int8_matmul_cpu", "int8_dot_bf16_cpu",
    # float32 and bfloat16 linears on the CPU over weights packed once for oneDNN
    "PACKED_DTYPES", "PackedLinear", "pack_linear", "packed_error", "packing_available",
    # the float32 panel form of PackedLinear: its C library (engine/run/cpu_kernel_build.py builds and loads it)
    "F32Library", "f32_compile_command", "f32_library_name", "f32_matmul_cpu", "pack_panels",
    # float linears on CUDA whose rows' sums keep one order whatever the batch (the batch-invariant mode's)
    "InvariantLinear", "invariant_linear",
    # layers
    "apply_rotary", "attention_factor", "gelu_tanh_and_mul", "inverse_frequencies", "rms_norm", "rotary_cos_sin",
    "silu_and_mul",
    # quantized matmuls: the dispatch, and the torch forward each quantized linear keeps as its reference
    "AMAX_FLOOR", "FP8_MAX", "widened_bf16", "dequantize_int4", "dequantize_int8", "fbgemm_full_range", "fp8_matmul", "fp8_matmul_ref",
    "int4_matmul",
    "int4_matmul_ref", "int8_matmul", "int8_matmul_ref", "int_mm_exact", "pack_int4", "w8a8_matmul_fbgemm",
    "w8a8_matmul_int_mm", "w8a8_matmul_ref", "w8a8_per_batch_ref",
    # quantized checkpoints as shipped: their activation quantization, int8 x int8, fp8 weights
    "dequantize_fp8", "fake_quantize_fp8", "fp8_weight_matmul", "fp8_weight_matmul_ref",
    "quantize_act_int8", "w8a8_shipped_matmul", "w8a8_shipped_matmul_ref",
    # mixture of experts: router top-k, then the experts over their tokens grouped by expert
    "combine_in_expert_order", "fused_moe", "fused_moe_ref", "moe_by_expert", "moe_over_linears", "route_topk",
    # LoRA: rows of many adapters in one batch, the segmented gather matmul
    "Segments", "sgmv", "sgmv_ref",
    # structured output: a grammar's token bitmask on the logits
    "apply_token_bitmask",
    # host -> device
    "to_device",
]
