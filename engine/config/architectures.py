"""Which family module builds a checkpoint: HF `architectures[0]` (or GGUF `general.architecture`) -> family.

Plain data, no torch: ModelConfig.from_hf reads it for the per-family switches' defaults, engine/load/gguf.py
for the names of GGUF architectures; only `model_class` imports a family's module.

Adding a family: a module here whose CausalLM subclass (over layers.py) it exposes as `Model`, its
architecture names below, and each new switch as a ModelConfig field with its family default here.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    """What an HF architecture name implies beyond what its config.json says."""
    family: str                     # the module engine.models.<family> builds it
    attention_bias: bool = False    # bias on the q, k and v projections when config.json has no "attention_bias"
    qk_norm: bool = False           # RMSNorm over each head of q and k (config.json has no key for it)
    sliding_window: bool = False    # when config.json has no "use_sliding_window"
    sliding_window_pattern: int = 0 # every n-th layer global, the others sliding, when config.json has no layer_types
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    renormalize_topk: bool = False  # MoE: top-k routing weights sum to 1 when config.json has no "norm_topk_prob"
    vision: str | None = None       # a vision-language model's tower (engine.vision.config.KINDS); None: text only


ARCHITECTURES: dict[str, Architecture] = {                     # config.json architectures[0] ->
    "LlamaForCausalLM": Architecture("llama"),                 # Llama 2/3, SmolLM2
    "MistralForCausalLM": Architecture("llama", sliding_window=True),
    "Qwen2ForCausalLM": Architecture("qwen2", attention_bias=True),
    "Qwen3ForCausalLM": Architecture("qwen3", qk_norm=True),
    "Gemma2ForCausalLM": Architecture("gemma", sliding_window=True, sliding_window_pattern=2, scale_embeddings=True),
    "Gemma3ForCausalLM": Architecture("gemma", qk_norm=True, sliding_window=True, sliding_window_pattern=6,
                                      scale_embeddings=True),                  # Gemma 3 text (1B, and text configs)
    "Phi3ForCausalLM": Architecture("phi3", sliding_window=True),             # Phi-3, Phi-3.5, Phi-4-mini
    "Olmo2ForCausalLM": Architecture("olmo2"),
    "GraniteForCausalLM": Architecture("granite"),
    "MixtralForCausalLM": Architecture("mixtral", sliding_window=True, renormalize_topk=True),
    "Qwen2MoeForCausalLM": Architecture("qwen2_moe", attention_bias=True),
    "Qwen3MoeForCausalLM": Architecture("qwen3_moe", qk_norm=True),
    # vision-language: a tower, and a decoder whose switches are its text architecture's (text_architecture)
    "Qwen2VLForConditionalGeneration": Architecture("qwen2_vl", attention_bias=True, vision="qwen2_vl"),
    "Qwen2_5_VLForConditionalGeneration": Architecture("qwen2_vl", attention_bias=True, vision="qwen2_5_vl"),
    "LlavaForConditionalGeneration": Architecture("llava", vision="llava"),
}
DEFAULT_ARCHITECTURE = "LlamaForCausalLM"                      # for a config.json without "architectures"

# The decoders a vision-language model's layers may be: Qwen2-VL's is always Qwen2's; LLaVA's is its
# text_config's model_type (these families' layers take the shared CausalLM around them as they are).
_VISION_DECODERS = {"qwen2_vl": "Qwen2ForCausalLM", "qwen2_5_vl": "Qwen2ForCausalLM"}
LLAVA_TEXT_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass(frozen=True)
class GGUFArchitecture:
    hf: str                         # the HF architecture name the file loads as
    permuted_qk: bool = False       # llama.cpp's converter permuted the q/k rows per head (engine/load/gguf.py undoes it)


GGUF_ARCHITECTURES: dict[str, GGUFArchitecture] = {           # GGUF general.architecture ->
    "llama": GGUFArchitecture("LlamaForCausalLM", permuted_qk=True),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM"),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM"),
}


def architecture(name: str) -> Architecture:
    """The entry of an HF architecture name; ValueError naming the supported ones."""
    if name not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {name!r}; supported: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def text_architecture(name: str, text_config: dict) -> str:
    """The HF text architecture whose switches and layers a vision-language architecture's decoder has;
    ValueError for a LLaVA decoder of another family."""
    kind = architecture(name).vision
    if kind in _VISION_DECODERS:
        return _VISION_DECODERS[kind]
    model_type = text_config.get("model_type", "llama")
    if model_type not in LLAVA_TEXT_MODEL_TYPES:
        raise ValueError(f"{name} with a {model_type!r} text model is not supported; supported: "
                         f"{', '.join(sorted(LLAVA_TEXT_MODEL_TYPES))}")
    return LLAVA_TEXT_MODEL_TYPES[model_type]


def model_class(name: str) -> type:
    """The CausalLM subclass that builds HF architecture `name`."""
    return importlib.import_module(f"jobrunner.engine.models.{architecture(name).family}").Model
