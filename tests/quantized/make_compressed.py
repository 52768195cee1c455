"""Writes the tiny compressed-tensors checkpoints of tests/quantized/ with llmcompressor, as users make them.

    python tests/quantized/make_compressed.py OUT_DIR     (in an environment with llmcompressor installed;
                                                            made with llmcompressor 0.14.0.1, compressed-tensors 0.19.0)

llmcompressor pins an older transformers than the tests use, so the checkpoints are made once and
kept in the repository (tests/quantized/checkpoints/, bfloat16 like the models users quantize);
the tests load them with transformers + compressed-tensors as the reference. Each family x scheme
is one directory: config.json with its quantization_config, model.safetensors, the tiny tokenizer.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import TINY_MODEL_VOCAB, save_tiny_tokenizer  # noqa: E402

# Sizes where a group of 128 and a 128 x 128 block fit (k/v rows: 64, half a block)
SIZES = dict(vocab_size=TINY_MODEL_VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
             rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**SIZES, tie_word_embeddings=False),
    "qwen2": lambda: transformers.Qwen2Config(**SIZES, tie_word_embeddings=True),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SIZES, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=128, norm_topk_prob=True,
                                                     decoder_sparse_step=1, mlp_only_layers=[],
                                                     tie_word_embeddings=False),
}
# llmcompressor's preset schemes; the static ones (FP8: per-tensor activation scale) calibrate
SCHEMES = ("W4A16", "W4A16_ASYM", "W8A16", "W8A8", "FP8", "FP8_DYNAMIC", "FP8_BLOCK")
IGNORE = {"llama": ["lm_head"], "qwen2": ["lm_head"], "qwen3_moe": ["lm_head", "re:.*mlp.gate$"]}


def random_model(family: str):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family](), dtype=torch.float32)
    with torch.no_grad():   # norms and biases off their constants, so loading them is checked
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
            else:
                p.normal_(0.0, 0.08)
    return model.to(torch.bfloat16)


def calibration():
    from datasets import Dataset
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, 320, (48,), generator=g).tolist() for _ in range(8)]
    return Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * 48 for _ in rows]})


def make(family: str, scheme: str, out: Path) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    base = out / f"{family}-bf16"            # llmcompressor starts from a saved model, as users do
    if not base.is_dir():
        random_model(family).save_pretrained(str(base))
        save_tiny_tokenizer(base)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.bfloat16)
    recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=IGNORE[family])
    kwargs = dict(dataset=calibration(), num_calibration_samples=8, max_seq_length=48) if scheme == "FP8" else {}
    path = out / f"{family}-{scheme}"
    save_tiny_tokenizer(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(base))
    oneshot(model=model, recipe=recipe, tokenizer=tokenizer, **kwargs)
    model.save_pretrained(str(path), save_compressed=True)
    print(path)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    only = sys.argv[2:]
    for family in FAMILIES:
        for scheme in SCHEMES:
            if not only or f"{family}-{scheme}" in only:
                make(family, scheme, out)
