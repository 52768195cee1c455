"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's decoder (q/k/v biases) with a sparse MoE block.

Beside the routed experts each sparse layer has a shared expert, a gated MLP of
shared_expert_intermediate_size whose output is scaled by sigmoid(shared_expert_gate(x)).
norm_topk_prob (default off) renormalizes the top k; decoder_sparse_step and mlp_only_layers
leave some layers dense (engine/config/moe_config.py).
"""
from __future__ import annotations

from jobrunner.engine.models.moe import MoECausalLM


class Qwen2MoeForCausalLM(MoECausalLM):
    pass


Model = Qwen2MoeForCausalLM
