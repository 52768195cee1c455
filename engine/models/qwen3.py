"""Qwen3: Llama's decoder with an RMSNorm over each head of q and k, before rotary.

The norms are the switch ModelConfig.qk_norm, which the registry turns on for this family (HF's
Qwen3 always has them); their weights load as self_attn.q_norm / self_attn.k_norm. head_dim is
set apart from hidden_size / num_heads in Qwen3's configs.
"""
from __future__ import annotations

from jobrunner.engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass


Model = Qwen3ForCausalLM
