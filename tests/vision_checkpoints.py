"""Tiny random vision-language checkpoints, saved by transformers as the real ones ship: config.json with
text_config and vision_config, model.safetensors, preprocessor_config.json, a tokenizer whose image tokens
are special, and a chat template rendering {"type": "image"} parts as the real ones do (Qwen2-VL's in
chat_template.jinja, LLaVA's in chat_template.json, the older processor file).

    checkpoint(kind, root) -> (path, the transformers model): kind in KINDS
    sample_images() -> PIL images of 28-112 px, several sizes and modes

Sizes: decoder hidden 64, 2 layers, 4 heads (2 KV); tower width 32, depth 2, 4 heads; Qwen patches of 4 px
merged 2 x 2 (an image of 28-112 px is 4-49 tokens; max_pixels 4096 caps one at 64), Qwen2.5-VL windows
of 16 px with its second block full; LLaVA's CLIP over 28 px squares of 7 px patches (16 tokens).
Float32; norms and biases randomized so their loading is checked.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from conftest import TINY_MODEL_VOCAB, make_tiny_tokenizer

KINDS = ("qwen2_vl", "qwen2_5_vl", "llava", "llava_full")

QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
LLAVA_TOKENS = ["<image>"]

# Qwen2-VL-Instruct's chat template (images; videos left out)
QWEN_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}{% if loop.first and message['role'] "
    "!= 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>"
    "{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content or 'image_url' "
    "in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)
# llava-1.5-hf's chat template (chat_template.json)
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}{% for content in "
    "message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}{% endfor %}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{% generation %}"
    "{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

_TEXT = dict(vocab_size=TINY_MODEL_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)
QWEN_PREPROCESSOR = dict(min_pixels=256, max_pixels=4096, patch_size=4, merge_size=2, temporal_patch_size=2)
LLAVA_PREPROCESSOR = dict(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})


def tokenizer(kind: str):
    """transformers' fast tokenizer over the tiny BPE, with the family's image tokens special."""
    import transformers
    from tokenizers import AddedToken

    tok = make_tiny_tokenizer()
    extra = LLAVA_TOKENS if kind.startswith("llava") else QWEN_TOKENS
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                                eos_token="<|im_end|>", unk_token="<|endoftext|>",
                                                pad_token="<|endoftext|>")


def hf_config(kind: str, tok):
    import transformers

    if kind in ("qwen2_vl", "qwen2_5_vl"):
        ids = {f"{name}_token_id": tok.convert_tokens_to_ids(t) for name, t in
               zip(("vision_start", "vision_end", "image", "video"), QWEN_TOKENS)}
        text = dict(_TEXT, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
        if kind == "qwen2_vl":
            vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=4,
                          spatial_merge_size=2, temporal_patch_size=2)
            return transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
        vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=64, patch_size=4,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1])
        return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    full = kind == "llava_full"
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, image_size=28, patch_size=7)
    return transformers.LlavaConfig(text_config=dict(_TEXT, model_type="llama"), vision_config=vision,
                                    image_token_index=tok.convert_tokens_to_ids("<image>"),
                                    vision_feature_layer=[-2, -1] if full else -2,
                                    vision_feature_select_strategy="full" if full else "default")


def checkpoint(kind: str, root: Path):
    """Saves kind's tiny checkpoint under root -> (its directory, the transformers model, eval, float32)."""
    import transformers

    tok = tokenizer(kind)
    cfg = hf_config(kind, tok)
    cls = {"qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
           "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration}.get(kind,
                                                                             transformers.LlavaForConditionalGeneration)
    torch.manual_seed(0)
    model = cls(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    path = root / kind
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    if kind.startswith("llava"):
        transformers.LlavaImageProcessorPil(**LLAVA_PREPROCESSOR).save_pretrained(str(path))
        (path / "chat_template.json").write_text(json.dumps({"chat_template": LLAVA_TEMPLATE}))
    else:
        transformers.Qwen2VLImageProcessorPil(**QWEN_PREPROCESSOR).save_pretrained(str(path))
        (path / "chat_template.jinja").write_text(QWEN_TEMPLATE)
    return path, model


def sample_images():
    """Random-noise PIL images: RGB of several sizes and aspect ratios, an RGBA one and a grayscale one."""
    from PIL import Image

    g = np.random.default_rng(0)
    rgb = lambda w, h: Image.fromarray(g.integers(0, 256, (h, w, 3), dtype=np.uint8))  # noqa: E731
    rgba = Image.fromarray(g.integers(0, 256, (40, 33, 4), dtype=np.uint8), mode="RGBA")
    gray = Image.fromarray(g.integers(0, 256, (30, 60), dtype=np.uint8), mode="L")
    return [rgb(40, 56), rgb(112, 30), rgb(28, 28), rgb(97, 83), rgba, gray]
