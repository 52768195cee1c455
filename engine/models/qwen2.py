"""Qwen2 (and Qwen2.5): Llama's decoder with a bias on the q, k and v projections.

The bias is the switch ModelConfig.attention_bias, which the registry turns on for this family:
HF's Qwen2 always has it, and its config.json has no key for it. Qwen2's sliding window is off
unless config.json sets use_sliding_window.
"""
from __future__ import annotations

from jobrunner.engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


Model = Qwen2ForCausalLM
