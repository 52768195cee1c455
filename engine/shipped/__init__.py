"""Quantized checkpoints as users ship them: compressed-tensors (llmcompressor's output), GPTQ, AWQ.

    quant = read_quantization(hf_config)        # ShippedQuant | None; ConfigError for what we do not run
    loader = ShippedLoader(model, quant)        # engine/runtime.build_model: the quantized linears, as stored

scheme.py reads the config, unpack.py turns each format's tensors into levels, build.py makes our
modules of them (engine/quant/linear.py's int4/int8 where they fit, modules.py here for the rest),
load.py places them as the weights stream by. Nothing is dequantized to float at load.
"""
from jobrunner.engine.shipped.load import ShippedLoader
from jobrunner.engine.shipped.scheme import ShippedQuant, read_quantization

__all__ = ["ShippedLoader", "ShippedQuant", "read_quantization"]
