"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's decoder (q/k norms) with a sparse MoE block.

No shared expert; norm_topk_prob (on in the published configs) renormalizes the top k;
decoder_sparse_step and mlp_only_layers leave some layers dense (engine/config/moe_config.py).
"""
from __future__ import annotations

from jobrunner.engine.models.moe import MoECausalLM


class Qwen3MoeForCausalLM(MoECausalLM):
    pass


Model = Qwen3MoeForCausalLM
