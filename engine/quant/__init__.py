"""Quantization: weight transforms plus a module swap (see apply.py for what each scheme covers).

    check_quantization(scheme, device, dtype)   # ConfigError before any work (fp8 off CUDA >= 8.9, ...)
    quantize_model(model, scheme, bundle)       # in place, after the float weights are loaded
    int8_activations(model)                     # w4a8 over int4 linears already built (a shipped checkpoint's)
    layer_quantizer(model, scheme, bundle)      # f(i): layer i quantized as it loads (build_model), or None

Schemes: none | int8 | int4 (int4-g32, -g64, -g128) | w8a8 | w4a8 (its groups as int4's) | fp8. Layouts and
kernels: kernels/matmul/quant_matmul.py; modules: engine/quant/linear.py; float/GGUF -> layouts: formats.py.
"""
from jobrunner.engine.quant.apply import SCHEMES, check_quantization, int8_activations, layer_quantizer, parse_scheme, quantize_model, w8a8_backend
from jobrunner.engine.quant.linear import Fp8Linear, Int4Linear, Int8Linear, QuantEmbedding, QuantLinear, W4A8Linear, W8A8Linear

__all__ = ["SCHEMES", "check_quantization", "int8_activations", "layer_quantizer", "parse_scheme", "quantize_model", "w8a8_backend",
           "Fp8Linear", "Int4Linear", "Int8Linear", "QuantEmbedding", "QuantLinear", "W4A8Linear", "W8A8Linear"]
