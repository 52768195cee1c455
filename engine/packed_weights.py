"""Packing a CPU model's float32 or bfloat16 linears into oneDNN's layout once, after loading and
quantizing (kernels/cpu_linear.py says why and how close it stays to F.linear).

Only plain nn.Linear modules with float32 or bfloat16 weights are packed: quantized linears keep their own
kernels, and LoRA wraps the packed base afterwards. A packed weight replaces the dense one, so the
model costs no more memory, except an lm_head tied to the embeddings: the embeddings keep the dense
rows for lookups and the head gets a packed copy (vocab x hidden floats, counted in weight_bytes).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from kernels import PACKED_DTYPES, pack_linear, packing_available

log = logging.getLogger("engine")


def pack_linears(model: nn.Module, batch_hint: int) -> int | None:
    """Replaces model's float32 and bfloat16 nn.Linear modules by packed ones in place. Returns the bytes added
    (the tied head's copy), or None when nothing was packed (no oneDNN, or a packing that failed
    its check: the model is left as it was)."""
    if not packing_available():
        log.info("engine: this torch has no oneDNN; linears run on F.linear")
        return None
    targets = [(name, m) for name, m in model.named_modules()
               if type(m) is nn.Linear and m.weight.dtype in PACKED_DTYPES and m.weight.device.type == "cpu"]
    try:
        packed = {name: pack_linear(m, batch_hint) for name, m in targets}
    except (RuntimeError, ValueError) as e:
        log.warning("engine: packing linears failed (%s); they run on F.linear", e)
        return None
    modules = dict(model.named_modules())
    head, embed = getattr(model, "lm_head", None), getattr(model, "embed_tokens", None)
    tied = head is not None and getattr(head, "weight", None) is getattr(embed, "weight", False)
    for name, p in packed.items():
        parent, _, attr = name.rpartition(".")
        setattr(modules[parent] if parent else model, attr, p)
    head_bytes = model.lm_head.in_features * model.lm_head.out_features * head.weight.element_size() if tied else 0
    return head_bytes if "lm_head" in packed else 0
