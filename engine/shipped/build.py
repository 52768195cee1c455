"""Levels (engine/shipped/unpack.py) -> the module that runs them, for one HF linear or the parts of
one of our fused projections (q, k, v -> qkv_proj; gate, up -> gate_up_proj).

    int4, weight-only         Int4Linear (our nibble layout, float32 scales; zeros = -(z + 8) * s for the
                              unsigned nibble u = q + 8: W = (q - z) s = u s + zeros)
    int8, weight-only         Int8Linear (asymmetric: its zeros = -z s)
    int8 x int8 activations   ShippedW8A8Linear
    fp8                       Fp8WeightLinear
    act order (g_idx)         the above over the columns sorted by group, in PermutedInput

Parts that agree (the same kind, group, activation scale; no act order; fp8 blocks not straddling a
part) are concatenated by rows into one module, as our float model fuses them; others run as a
ConcatLinear of one module each.
"""
from __future__ import annotations

import torch
from torch import nn

from jobrunner.engine.config.engine_config import ConfigError
from jobrunner.engine.quant.linear import Int4Linear, Int8Linear
from jobrunner.engine.shipped.shipped_linear import ConcatLinear, Fp8WeightLinear, PermutedInput, ShippedW8A8Linear
from jobrunner.engine.shipped.scheme import ModuleScheme
from jobrunner.engine.shipped.unpack import FloatLevels, IntLevels
from jobrunner.kernels.ops import pack_int4


def fused_module(scheme: ModuleScheme, parts: list[IntLevels | FloatLevels], bias: torch.Tensor | None,
                 device: torch.device) -> nn.Module:
    """One module computing the parts' outputs side by side (a single part: its own module)."""
    if len(parts) > 1 and _joinable(parts):
        parts = [_join(parts)]
    biases = [None] * len(parts) if bias is None else bias.to(device).split([p.q.shape[0] for p in parts])
    modules = [_module(scheme, p, device, b) for p, b in zip(parts, biases)]
    return modules[0] if len(modules) == 1 else ConcatLinear(modules)


def _joinable(parts) -> bool:
    first = parts[0]
    if any(type(p) is not type(first) or _same(p.input_scale, first.input_scale) is False for p in parts):
        return False
    if isinstance(first, FloatLevels):
        return all(p.block == first.block and (p.block is None or p.q.shape[0] % p.block[0] == 0) for p in parts)
    return all(p.g_idx is None and p.group == first.group and p.bits == first.bits
               and (p.zero is None) == (first.zero is None) for p in parts)


def _same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _join(parts):
    first = parts[0]
    cat = lambda name: torch.cat([getattr(p, name) for p in parts])       # noqa: E731
    if isinstance(first, FloatLevels):
        return FloatLevels(cat("q"), cat("scale"), first.block, first.input_scale)
    return IntLevels(cat("q"), cat("scale"), None if first.zero is None else cat("zero"), first.bits, first.group,
                     None, first.input_scale)


def _module(scheme: ModuleScheme, lv, device, bias) -> nn.Module:
    if isinstance(lv, FloatLevels):
        acts = scheme.acts
        act = None if acts is None else ("dynamic" if acts.dynamic else "static")
        k = lv.q.shape[1]
        if acts is not None and acts.group_size and k % acts.group_size:      # refused at load, not mid-job
            raise ConfigError(f"the checkpoint quantizes activations in groups of {acts.group_size} columns, but a "
                              f"linear has {k} inputs (not a multiple): the engine cannot run its activation groups")
        return Fp8WeightLinear(lv.q.to(device), lv.scale.to(device), lv.block, bias, act=act,
                               input_scale=None if lv.input_scale is None else lv.input_scale.to(device),
                               act_group=None if acts is None else acts.group_size)
    perm = None
    if lv.g_idx is not None:                          # columns into group order: groups become contiguous
        perm = torch.argsort(lv.g_idx, stable=True)
        lv = IntLevels(lv.q[:, perm], lv.scale, lv.zero, lv.bits, lv.group, None, lv.input_scale)
    module = _int_module(scheme, lv, device, bias)
    return module if perm is None else PermutedInput(module, perm.to(device))


def _int_module(scheme: ModuleScheme, lv: IntLevels, device, bias) -> nn.Module:
    n, k = lv.q.shape
    scale = lv.scale.to(device)
    if scheme.acts is not None:                       # int8 x int8 (scheme.py admits only this pairing)
        return ShippedW8A8Linear(lv.q.to(device), scale, bias,
                                 input_scale=None if lv.input_scale is None else lv.input_scale.to(device))
    if lv.bits == 8:
        zeros = None if lv.zero is None else (-lv.zero.float() * lv.scale).to(device)
        return Int8Linear(lv.q.to(device), scale, bias, zeros=zeros)
    groups = scale.shape[1]
    kp = groups * lv.group
    u = (lv.q.to(torch.int16) + 8).to(torch.uint8)
    if kp != k:
        u = torch.nn.functional.pad(u, (0, kp - k))
    z = 8.0 if lv.zero is None else lv.zero.float() + 8.0
    zeros = (-z * lv.scale).to(device)
    return Int4Linear(pack_int4(u, lv.group).to(device), scale, zeros, lv.group, k, bias)

