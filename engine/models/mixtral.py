"""Mixtral: Mistral's decoder with a sparse MoE feed-forward in every layer (engine/models/moe.py).

The router always renormalizes its top k (the registry's renormalize_topk); the checkpoint names
the block block_sparse_moe and each expert's projections w1 (gate), w3 (up) and w2 (down).
"""
from __future__ import annotations

from jobrunner.engine.models.moe import MoECausalLM


class MixtralForCausalLM(MoECausalLM):
    MOE_PREFIX = "block_sparse_moe"
    EXPERT_NAMES = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", 0)}


Model = MixtralForCausalLM
