"""Architecture hyperparameters, read from a Hugging Face `config.json` dict.

The per-family switches are fields that the shared layers read (engine/models/layers.py):
attention_bias, qk_norm, tie_word_embeddings, rope_scaling, sliding_window. Where config.json
leaves out attention_bias, qk_norm or use_sliding_window, the architecture's entry in
engine/models/registry.py gives the default.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.models import registry
from engine.models.moe_config import MoEConfig


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool            # bias on the q, k and v projections (Qwen2)
    qk_norm: bool                   # RMSNorm on q and k per head (Qwen3)
    rope_scaling: tuple | None = None   # frozen items of the config's rope_scaling dict
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    moe: MoEConfig | None = None    # mixture-of-experts switches (engine/models/moe_config.py); None: dense

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        arch = (cfg.get("architectures") or [registry.DEFAULT_ARCHITECTURE])[0]
        spec = registry.architecture(arch)     # ValueError naming the supported architectures
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        theta = cfg.get("rope_theta") or (scaling or {}).get("rope_theta") or 10000.0
        if scaling and (scaling.get("rope_type") or scaling.get("type")) in (None, "default"):
            scaling = None
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", spec.sliding_window) else None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", spec.attention_bias)),
            qk_norm=spec.qk_norm,
            rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
            sliding_window=window,
            moe=MoEConfig.from_hf(cfg, spec.renormalize_topk),
        )

    @property
    def family(self) -> str:
        """The module of engine.models that builds this architecture."""
        return registry.architecture(self.architecture).family

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None
