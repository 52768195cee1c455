"""A vision-language checkpoint's vision side, read from its config.json. Plain data, no torch.

config.json of a vision-language model nests the decoder's keys in `text_config` (transformers 5; older
Qwen2-VL files keep them at the top level) and the tower's in `vision_config`; the keys that join the two
(the image token, LLaVA's feature layer and projector) sit at the top. `text_config(cfg)` gives the
decoder's keys flat, for ModelConfig; `VisionConfig.from_hf` the rest.
"""
from __future__ import annotations

from dataclasses import dataclass

KINDS = ("qwen2_vl", "qwen2_5_vl", "llava")       # the registry's Architecture.vision values


@dataclass(frozen=True)
class VisionConfig:
    kind: str                       # one of KINDS: which tower (engine/models/qwen2_vl.py, llava.py)
    hidden_size: int                # the tower's width
    depth: int                      # the tower's blocks in the checkpoint
    num_heads: int
    intermediate_size: int          # each block's MLP width
    hidden_act: str                 # each block's MLP activation (HF name: quick_gelu, gelu, silu)
    patch_size: int
    image_token_id: int             # the placeholder token the tower's embeddings replace
    out_hidden_size: int            # what an image embedding is: the decoder's hidden size
    in_channels: int = 3
    temporal_patch_size: int = 1    # Qwen2-VL: an image is this many identical frames
    spatial_merge_size: int = 1     # Qwen2-VL: m x m patches make one image token
    rope_theta: float = 10000.0     # Qwen2-VL: the tower's 2-D rotary base
    window_size: int = 0            # Qwen2.5-VL: windowed attention's side, in pixels
    fullatt_block_indexes: tuple[int, ...] = ()   # Qwen2.5-VL: the blocks attending over the whole image
    layer_norm_eps: float = 1e-6
    image_size: int = 0             # CLIP: the square side its position embeddings are for
    feature_layers: tuple[int, ...] = ()          # LLaVA: hidden-state indexes taken (0: the embeddings)
    feature_strategy: str = "default"             # LLaVA: "default" drops the CLS row, "full" keeps it
    projector_act: str = "gelu"
    projector_bias: bool = True
    vision_start_token_id: int | None = None      # Qwen2-VL: the token before each image's run
    text_architecture: str = ""     # the HF architecture of the decoder's layers (registry.text_architecture)

    @classmethod
    def from_hf(cls, cfg: dict, kind: str, text_architecture: str) -> "VisionConfig":
        v = cfg["vision_config"]
        text = text_config(cfg)
        channels = v.get("in_channels", v.get("in_chans", 3))
        theta = float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        if kind == "qwen2_vl":
            return cls(kind, hidden_size=v["embed_dim"], depth=v["depth"], num_heads=v["num_heads"],
                       intermediate_size=int(v["embed_dim"] * v.get("mlp_ratio", 4)),
                       hidden_act=v.get("hidden_act", "quick_gelu"), patch_size=v.get("patch_size", 14),
                       image_token_id=cfg["image_token_id"], out_hidden_size=v.get("hidden_size", text["hidden_size"]),
                       in_channels=channels, temporal_patch_size=v.get("temporal_patch_size", 2),
                       spatial_merge_size=v.get("spatial_merge_size", 2), rope_theta=theta,
                       vision_start_token_id=cfg.get("vision_start_token_id"), text_architecture=text_architecture)
        if kind == "qwen2_5_vl":
            return cls(kind, hidden_size=v["hidden_size"], depth=v["depth"], num_heads=v["num_heads"],
                       intermediate_size=v["intermediate_size"], hidden_act=v.get("hidden_act", "silu"),
                       patch_size=v.get("patch_size", 14), image_token_id=cfg["image_token_id"],
                       out_hidden_size=v.get("out_hidden_size", text["hidden_size"]), in_channels=channels,
                       temporal_patch_size=v.get("temporal_patch_size", 2),
                       spatial_merge_size=v.get("spatial_merge_size", 2), rope_theta=theta,
                       window_size=v.get("window_size", 112),
                       fullatt_block_indexes=tuple(v.get("fullatt_block_indexes", (7, 15, 23, 31))),
                       vision_start_token_id=cfg.get("vision_start_token_id"), text_architecture=text_architecture)
        if kind == "llava":
            if v.get("model_type", "clip_vision_model") != "clip_vision_model":
                raise ValueError(f"LLaVA with a {v.get('model_type')!r} vision tower is not supported (CLIP is)")
            depth = v.get("num_hidden_layers", 24)
            layers = cfg.get("vision_feature_layer", -2)
            layers = (layers,) if isinstance(layers, int) else tuple(layers)
            strategy = cfg.get("vision_feature_select_strategy", "default")
            if strategy not in ("default", "full"):
                raise ValueError(f"vision_feature_select_strategy {strategy!r}: expected default or full")
            return cls(kind, hidden_size=v.get("hidden_size", 1024), depth=depth,
                       num_heads=v.get("num_attention_heads", 16), intermediate_size=v.get("intermediate_size", 4096),
                       hidden_act=v.get("hidden_act", "quick_gelu"), patch_size=v.get("patch_size", 14),
                       image_token_id=cfg.get("image_token_index", cfg.get("image_token_id", 32000)),
                       out_hidden_size=text["hidden_size"], in_channels=v.get("num_channels", 3),
                       layer_norm_eps=v.get("layer_norm_eps", 1e-5), image_size=v.get("image_size", 336),
                       feature_layers=tuple(i if i >= 0 else depth + 1 + i for i in layers),
                       feature_strategy=strategy, projector_act=cfg.get("projector_hidden_act", "gelu"),
                       projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
                       text_architecture=text_architecture)
        raise ValueError(f"unknown vision kind {kind!r}; expected one of {', '.join(KINDS)}")


def text_config(cfg: dict) -> dict:
    """The decoder's keys, flat: config.json's text_config over its top level (older Qwen2-VL files keep
    them there), without vision_config. tie_word_embeddings is either level's (transformers ties when
    either says so)."""
    top = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
    text = {**top, **(cfg.get("text_config") or {})}
    text["tie_word_embeddings"] = bool(top.get("tie_word_embeddings") or text.get("tie_word_embeddings"))
    return text
