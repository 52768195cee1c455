"""The version of the engine's numeric path.

Bump NUMERICS_VERSION whenever a change can alter any output bit for the same checkpoint and
settings (a kernel, an accumulation order, the sampler, the tokenizer's handling, a quantization
format): the result cache (jobrunner/cache) keys on it, so results computed by an older numeric
path are never served to a newer one.
"""
NUMERICS_VERSION = 2     # 2: the CPU decode attention's softmax sum in fixed lanes; mean pooling's running sum
