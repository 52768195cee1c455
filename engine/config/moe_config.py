"""The mixture-of-experts switches of a config.json (Mixtral, Qwen2-MoE, Qwen3-MoE); plain data, no torch.

    config.json key                      Mixtral              Qwen2-MoE / Qwen3-MoE
    experts                              num_local_experts    num_experts (transformers 5 writes num_local_experts)
    experts per token                    num_experts_per_tok  num_experts_per_tok
    expert intermediate size             intermediate_size    moe_intermediate_size
    renormalize the top k                always               norm_topk_prob
    shared expert (sigmoid-gated)        none                 shared_expert_intermediate_size (Qwen2-MoE)
    which layers are sparse              all                  decoder_sparse_step, mlp_only_layers
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int              # of each routed expert
    renormalize: bool                   # top-k weights divided by their sum
    shared_intermediate_size: int = 0   # 0: no shared expert
    sparse_step: int = 1                # layer i is sparse iff (i + 1) % sparse_step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()   # ... and i is not listed here

    @classmethod
    def from_hf(cls, cfg: dict, renormalize_default: bool) -> "MoEConfig | None":
        """None for a dense config. renormalize_default: the family's rule when config.json has no
        norm_topk_prob (the registry's Architecture.renormalize_topk)."""
        experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        if not experts:
            return None
        top_k = cfg["num_experts_per_tok"]
        if not 1 <= top_k <= experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the {experts} experts")
        return cls(num_experts=experts, top_k=top_k,
                   intermediate_size=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
                   renormalize=bool(cfg.get("norm_topk_prob", renormalize_default)),
                   shared_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0,
                   sparse_step=cfg.get("decoder_sparse_step") or 1,
                   mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()))

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.sparse_step == 0
