"""Decoder models: one small module per family over shared layers, chosen through one registry.

    registry.py   HF architectures[0] / GGUF general.architecture -> family, and the family's switch defaults
    layers.py     RMSNorm, Rotary, Attention (q/k/v bias, q/k norm, scale, soft-cap, window), GatedMLP:
                  switched by ModelConfig's fields
    base.py       CausalLM: embedding, the layer stack, the final norm, lm_head; HF weight names -> our params
    llama.py      Llama 2/3, Mistral, SmolLM2: the pre-norm decoder layer
    qwen2.py      Qwen2: Llama's layer with q/k/v biases
    qwen3.py      Qwen3: Llama's layer with q/k norms
    gemma.py      Gemma 2, Gemma 3 (text): sandwich norms (1 + weight), GELU-tanh, soft-caps, sliding and global layers
    phi3.py       Phi-3, Phi-4-mini: Llama's layer; fused checkpoint projections, LongRoPE, partial rotary
    olmo2.py      OLMo 2: post-norm blocks, q/k norms over the whole projections
    granite.py    Granite: Llama's layer with embedding, attention, residual and logits multipliers
    moe.py        mixture of experts: router, stacked experts (kernels.fused_moe), the shared expert; MoECausalLM
                  loads per-expert checkpoint tensors into the stacks (switches: moe_config.py)
    mixtral.py, qwen2_moe.py, qwen3_moe.py: MoECausalLM with each family's checkpoint names
    vision_language.py  VisionLanguageModel: a decoder whose image tokens take a vision tower's embeddings
    qwen2_vl.py   Qwen2-VL, Qwen2.5-VL: the ViT (2-D rotary, windows, patch merger) and multimodal rotary
    llava.py      LLaVA: CLIP's tower, the projector, a Llama/Mistral/Qwen2 decoder

Importing this package does not import torch; `model_class` imports the family's module.
"""
from jobrunner.engine.config.architectures import ARCHITECTURES, GGUF_ARCHITECTURES, architecture, model_class

__all__ = ["ARCHITECTURES", "GGUF_ARCHITECTURES", "architecture", "model_class"]
