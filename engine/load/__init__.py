"""Checkpoints to tensors and a tokenizer: safetensors, GGUF, dummy weights (never pickle), the
float32 conversion cache, the tokenizer and its chat template."""
