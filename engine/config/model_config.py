"""Architecture hyperparameters, read from a Hugging Face `config.json` dict.

The per-family switches are fields that the shared layers read (engine/models/layers.py):
attention_bias, qk_norm, tie_word_embeddings, rope_scaling, sliding_window, and the Gemma, Phi-3 and
Granite switches after them (their defaults change nothing). Where config.json leaves out
attention_bias, qk_norm, use_sliding_window or the layer pattern, the architecture's entry in
engine/config/architectures.py gives the default.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from jobrunner.engine.config import architectures as registry
from jobrunner.engine.config.moe_config import MoEConfig
from jobrunner.engine.config.vision_config import VisionConfig, text_config


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
    layer_types: tuple[str, ...] = ()           # per layer, sliding_attention or full_attention; (): all alike
    hidden_act: str = "silu"                    # the gated MLP's activation: silu or gelu_pytorch_tanh
    attn_logit_softcapping: float | None = None     # Gemma 2: scores -> c * tanh(scores / c)
    final_logit_softcapping: float | None = None    # Gemma 2: logits -> c * tanh(logits / c)
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale is its -1/2 power (else head_dim's)
    rope_local_theta: float | None = None       # Gemma 3: the rope base of the sliding layers
    partial_rotary_factor: float = 1.0          # Phi-3, Phi-4-mini: the share of each head that rotates
    embedding_multiplier: float = 1.0           # Granite; Gemma: sqrt(hidden_size)
    attention_multiplier: float | None = None   # Granite: the attention scale itself
    residual_multiplier: float = 1.0            # Granite: each block's output is scaled before the add
    logits_scaling: float = 1.0                 # Granite: logits are divided by it
    moe: MoEConfig | None = None                # mixture-of-experts switches (engine/config/moe_config.py); None: dense
    # Qwen2-VL's multimodal rotary: the rotary frequencies' split over the (time, height, width) position rows
    mrope_section: tuple[int, ...] | None = None
    vision: VisionConfig | None = None          # a vision-language model's tower (engine/config/vision_config.py); None: text

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """A text model's config.json; a vision-language one's decoder from its text_config (the
        switches its text architecture's) and its tower as `vision`."""
        arch = (cfg.get("architectures") or [registry.DEFAULT_ARCHITECTURE])[0]
        spec = registry.architecture(arch)     # ValueError naming the supported architectures
        if spec.vision is None:
            return cls._from_text(cfg, arch, spec)
        text_arch = registry.text_architecture(arch, cfg.get("text_config") or {})
        decoder = cls._from_text(text_config(cfg), arch, registry.architecture(text_arch))
        return replace(decoder, vision=VisionConfig.from_hf(cfg, spec.vision, text_arch))

    @classmethod
    def _from_text(cls, cfg: dict, arch: str, spec: registry.Architecture) -> "ModelConfig":
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        local_theta = cfg.get("rope_local_base_freq")
        if "full_attention" in scaling:     # rope per layer type (transformers 5 writes Gemma 3's so)
            local_theta = local_theta or scaling.get("sliding_attention", {}).get("rope_theta")
            scaling = scaling["full_attention"]
        theta = cfg.get("rope_theta") or scaling.get("rope_theta") or 10000.0
        partial = cfg.get("partial_rotary_factor") or scaling.get("partial_rotary_factor") or 1.0
        mrope = scaling.get("mrope_section")
        if (scaling.get("rope_type") or scaling.get("type")) in (None, "default", "mrope"):
            scaling = None
        elif (scaling.get("rope_type") or scaling.get("type")) == "longrope":     # Phi-3: the contexts decide
            scaling = {**scaling, "max_position_embeddings": cfg.get("max_position_embeddings", 4096),
                       "original_max_position_embeddings": scaling.get("original_max_position_embeddings")
                       or cfg["original_max_position_embeddings"]}
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", spec.sliding_window) else None
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported activation {act!r}; supported: silu, gelu_pytorch_tanh")
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
            rope_scaling=_frozen(scaling) if scaling else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
            sliding_window=window,
            layer_types=_layer_types(cfg, spec.sliding_window_pattern),
            hidden_act=act,
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
            rope_local_theta=float(local_theta) if local_theta else None,
            partial_rotary_factor=float(partial),
            embedding_multiplier=(cfg["hidden_size"] ** 0.5 if spec.scale_embeddings
                                  else cfg.get("embedding_multiplier", 1.0)),
            attention_multiplier=cfg.get("attention_multiplier"),
            residual_multiplier=cfg.get("residual_multiplier", 1.0),
            logits_scaling=cfg.get("logits_scaling", 1.0),
            moe=MoEConfig.from_hf(cfg, spec.renormalize_topk),
            mrope_section=tuple(mrope) if mrope else None,
        )

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends within sliding_window (when one is set): every layer
        without layer_types (Mistral), else those of type sliding_attention (Gemma)."""
        return not self.layer_types or self.layer_types[layer] == "sliding_attention"

    @property
    def family(self) -> str:
        """The module of engine.models that builds this architecture."""
        return registry.architecture(self.architecture).family

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None


def _frozen(d: dict) -> tuple:
    """A dict as sorted items, lists as tuples: a frozen dataclass field that hashes."""
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in d.items()))


def _layer_types(cfg: dict, pattern: int) -> tuple[str, ...]:
    """config.json's layer_types, else every `pattern`-th layer global and the others sliding (older
    Gemma configs: Gemma 2 alternates, Gemma 3 says sliding_window_pattern); () when neither."""
    if cfg.get("layer_types"):
        types = tuple(cfg["layer_types"])
        if len(types) != cfg["num_hidden_layers"]:
            raise ValueError(f"layer_types has {len(types)} entries for {cfg['num_hidden_layers']} layers")
        return types
    pattern = cfg.get("sliding_window_pattern", pattern)
    if not pattern:
        return ()
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(cfg["num_hidden_layers"]))
