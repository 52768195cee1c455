"""Phi-3, Phi-3.5 and Phi-4-mini (Phi3ForCausalLM): Llama's decoder.

What differs is in the checkpoint and the rope, not in the layer: qkv_proj and gate_up_proj are
stored fused already ([q | k | v] and [gate | up] rows, our own layout, loaded whole by
CausalLM.load_weights); LongRoPE scaling and partial rotary (Phi-4-mini rotates 3/4 of each head)
are ModelConfig.rope_scaling and partial_rotary_factor, read by layers.Rotary; the sliding window
in config.json applies to every layer, as in HF's Phi3.
"""
from __future__ import annotations

from jobrunner.engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    pass


Model = Phi3ForCausalLM
