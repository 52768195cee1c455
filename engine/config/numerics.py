"""The version of the engine's numeric path.

Bump NUMERICS_VERSION whenever a change can alter any output bit for the same checkpoint and
settings (a kernel, an accumulation order, the sampler, the tokenizer's handling, a quantization
format): the result cache (jobrunner/cache) keys on it, so results computed by an older numeric
path are never served to a newer one.
"""
NUMERICS_VERSION = 10    # 2: the CPU decode attention's softmax sum in fixed lanes; mean pooling's running sum
                         # 3: the CPU int4/int8/fp8 weight kernels; short prompt chunks in small steps through
                         #    the in-place decode attention
                         # 4: fp8 checkpoints with e4m3 activations through bfloat16 dot products on CPU
                         # 5: quantized weights' dequantized slices on oneDNN (prefill), the int8 and int4
                         #    kernels' row limits 128 and 256; bfloat16 calls of up to 16 rows on those kernels
                         # 6: the CPU int4 kernel's panel path (24 rows and more, any count: prefill too)
                         # 7: the CPU int8/fp8 kernels' panel path from 16 rows (was 24)
                         # 8: bfloat16 int4 calls of 8+ rows through the int4 kernel's bf16 form; bfloat16 int8 calls of
                         #    any size widened to the int8 kernel where its panel path runs; bfloat16 fp8 calls through
                         #    the bf16 dot form (weight-only as they are, e4m3 activations widened and quantized in C)
                         # 9: float32 linears on AVX-512 CPUs through the panel kernel (kernels/matmul/cpu_f32.c), not oneDNN
                         # 10: float32 prefill chunks on AVX-512 CPUs through the in-place kernel (cpu_attention.c), not
                         #     torch's flash attention
