"""Packing a CPU model's float32 or bfloat16 linears into oneDNN's layout once, after loading and
quantizing (kernels/matmul/cpu_linear.py says why and how close it stays to F.linear).

Only plain nn.Linear modules with float32 or bfloat16 weights are packed: quantized linears keep their own
kernels, and LoRA wraps the packed base afterwards. A packed weight replaces the dense one, so the
model costs no more memory, except an lm_head tied to the embeddings: the embeddings keep the dense
rows for lookups and the head gets a packed copy (vocab x hidden floats, counted in weight_bytes).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from jobrunner.engine.models.moe import Experts
from jobrunner.kernels.ops import PACKED_DTYPES, pack_linear, packing_available

log = logging.getLogger("engine")


def pack_linears(model: nn.Module, batch_invariant: bool = False, panel_kernel=None) -> int | None:
    """Replaces model's float32 and bfloat16 nn.Linear modules by packed ones in place, one at a time
    (the dense weight is freed as its packed one arrives: no second copy of the model at load).
    Returns the bytes added (the tied head's copy), or None when nothing was packed: no oneDNN, or
    the first packing failed its check (then the model is left as it was). batch_invariant: each packed in
    its batch-invariant form (kernels/matmul/cpu_linear.py), each shape checked for it; a failure leaves
    linears unpacked (engine/run/batch_invariance.check_model refuses the model then); a mixture of
    experts' float experts are packed too then, each expert's two projections (pack_experts). panel_kernel:
    cpu_f32's library (engine/run/cpu_kernel_build.panel_kernel), for float32 linears' panel form."""
    if not packing_available():
        log.info("engine: this torch has no oneDNN; linears run on F.linear")
        return None
    head, embed = getattr(model, "lm_head", None), getattr(model, "embed_tokens", None)
    tied = head is not None and getattr(head, "weight", None) is getattr(embed, "weight", False)
    names = [name for name, m in model.named_modules()     # names only: each old module dies once replaced
             if type(m) is nn.Linear and m.weight.dtype in PACKED_DTYPES and m.weight.device.type == "cpu"]
    added, packed, checked = 0, 0, set()
    for name in names:
        m = model.get_submodule(name)
        try:
            p = _pack_checked(m, checked, batch_invariant, panel_kernel)
        except (RuntimeError, ValueError) as e:
            log.warning("engine: packing %s failed (%s); %s on F.linear", name, e,
                        "every linear runs" if not packed else "it runs")
            if not packed:
                return None
            continue
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, p)
        packed += 1
        if m is head and tied:
            added += p.weight.numel() * p.weight.element_size()       # panels: padded to whole panels
    if packed and batch_invariant:
        pack_experts(model, checked)
    return added if packed else None


def pack_experts(model: nn.Module, checked: set) -> None:
    """The batch-invariant mode: every float Experts module's experts as PackedLinear in the invariant form,
    so an expert's product for a token does not depend on how many tokens the step routed to it. Each
    shape checked once (into `checked`); a failure leaves that module stacked (check_model refuses it)."""
    for name, m in list(model.named_modules()):
        if isinstance(m, Experts) and m.w13_scale is None and m.w13.dtype in PACKED_DTYPES \
                and m.w13.device.type == "cpu":
            try:
                m.pack(lambda linear: _pack_checked(linear, checked, batch_invariant=True))
            except (RuntimeError, ValueError) as e:
                log.warning("engine: packing the experts of %s failed (%s)", name, e)


def _pack_checked(linear: nn.Linear, checked: set, batch_invariant: bool, panel_kernel=None):
    """pack_linear, its check run once per shape (`checked` collects them): checking every linear cost the
    default model ~0.25 s of load."""
    shape = (linear.in_features, linear.out_features, linear.weight.dtype, linear.bias is not None)
    packed = pack_linear(linear, check=shape not in checked, batch_invariant=batch_invariant,
                         panel_kernel=panel_kernel)
    checked.add(shape)
    return packed
