"""Linears: float32/bfloat16 packed for oneDNN on CPU, quantized matmuls (int8, int4, fp8, w8a8,
shipped checkpoints' schemes, GGUF blocks), each with its torch reference beside its Triton kernel."""
