"""Random PEFT adapters over tiny HF models, and their transformers + peft references."""
from __future__ import annotations

import copy
from pathlib import Path

import torch

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def make_adapter(hf, path: Path, seed: int, r: int = 4, targets=None, alpha: int = 16, rslora: bool = False,
                 gain: float = 3.0, **config):
    """Saves a random LoRA adapter of `hf` (B non-zero) under path; returns transformers + peft with it active."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_PROJECTIONS, init_lora_weights=False,
                     use_rslora=rslora, **config)
    peft_model = get_peft_model(copy.deepcopy(hf), cfg).eval()
    with torch.no_grad():       # peft's random B is small; scaled so the adapter changes the greedy tokens
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.mul_(gain)
    peft_model.save_pretrained(str(path))
    return peft_model
