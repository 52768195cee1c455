"""A quantized checkpoint's linears, built as their tensors stream by (engine/runtime.build_model).

    loader = ShippedLoader(model, quant, device)   # on the meta-built model: each quantized linear -> a placeholder
    ... materialize the rest (float: norms, embeddings, routers, what `ignore` keeps) ...
    model.load_weights(loader.split(bundle.weights()))   # float tensors pass; quantized ones are caught
    loader.finish()                                      # ModelError if a quantized linear never completed

Invariants: a quantized linear never exists in float (its placeholder holds no storage, so the float
model is never allocated for it); a linear is built as soon as its tensors are all there and its raw
tensors are dropped then, so at most one fused projection's levels are held beside the model at a time;
our fused projections take their HF parts (q, k, v -> qkv_proj; gate, up -> gate_up_proj) by the
model's FUSED_SHARDS; a MoE block's experts become ShippedExperts once every expert is complete.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from jobrunner.engine.config.engine_config import ConfigError
from jobrunner.engine.api.errors import ModelError
from jobrunner.engine.shipped.build import fused_module
from jobrunner.engine.shipped.shipped_linear import ShippedExperts
from jobrunner.engine.shipped.scheme import ModuleScheme, ShippedQuant
from jobrunner.engine.shipped.unpack import required, unpack


class _Pending(nn.Module):
    """Where a quantized linear will go; holds nothing."""

    def __init__(self, in_features: int, out_features: int, has_bias: bool):
        super().__init__()
        self.in_features, self.out_features, self.has_bias = in_features, out_features, has_bias

    def forward(self, x):
        raise RuntimeError("a quantized linear was never loaded")


@dataclass
class _Part:
    """One HF linear of a target: its scheme, the tensors caught so far, its levels once complete."""
    scheme: ModuleScheme
    tensors: dict = field(default_factory=dict)
    levels: object = None
    bias: torch.Tensor | None = None


@dataclass
class _Target:
    """One of our modules to build: a linear (parts in shard order) or a MoE block's experts
    (parts keyed (expert, piece))."""
    name: str                          # our module name, e.g. "layers.0.self_attn.qkv_proj"
    parts: dict                        # part key -> _Part
    has_bias: bool = False
    experts: int = 0                   # > 0: an Experts module of this many experts


class ShippedLoader:
    def __init__(self, model: nn.Module, quant: ShippedQuant, device: torch.device):
        if model.tp.size > 1:
            raise ConfigError(f"a quantized checkpoint ({quant.name}) runs on one device; --tensor-parallel "
                              f"splits float checkpoints only (use --data-parallel for more GPUs)")
        self.quant = quant
        self.device = device
        self.model = model
        self._targets: dict[str, _Target] = {}
        self._owner: dict[str, tuple[_Target, object]] = {}     # HF module (no "model.") -> (target, part key)
        self._plan_linears(model)
        self._plan_experts(model)
        self.module_names = frozenset(self._targets)      # what this loader builds (our module names)

    # -- before materializing: placeholders ---------------------------------------------

    def _plan_linears(self, model) -> None:
        splits: dict[str, list[str]] = {}
        for piece, (fused, shard) in model.FUSED_SHARDS.items():
            splits.setdefault(fused, [None] * (max(s for f, s in model.FUSED_SHARDS.values() if f == fused) + 1))
            splits[fused][shard] = piece
        for name, lin in list(model.named_modules()):
            if not isinstance(lin, nn.Linear):
                continue
            leaf = name.rsplit(".", 1)[-1]
            pieces = [name[:-len(leaf)] + p for p in splits[leaf]] if leaf in splits else [name]
            hf = [self._hf_name(p) for p in pieces]
            schemes = [self.quant.scheme_for(self._hf_full(h)) for h in hf]
            if all(s is None for s in schemes):
                continue
            if any(s is None for s in schemes) or len(set(schemes)) > 1:
                raise ConfigError(f"{name}: the checkpoint quantizes some of its parts ({', '.join(hf)}) "
                                  f"differently; jobrunner runs a fused projection in one scheme")
            if name == "lm_head" and model.config.tie_word_embeddings:
                raise ConfigError("the checkpoint quantizes lm_head, which is tied to the float embedding")
            target = _Target(name, {i: _Part(schemes[i]) for i in range(len(hf))}, has_bias=lin.bias is not None)
            self._targets[name] = target
            for i, h in enumerate(hf):
                self._owner[h] = (target, i)
            self._owner[self._hf_name(name)] = (target, "fused")    # stored fused already (Phi-3)
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr,
                    _Pending(lin.in_features, lin.out_features, lin.bias is not None))

    def _plan_experts(self, model) -> None:
        names = getattr(model, "EXPERT_NAMES", None)
        if not names:
            return
        prefix = model.MOE_PREFIX
        for i, layer in enumerate(model.layers):
            experts = getattr(layer.mlp, "experts", None)
            if experts is None:
                continue
            num = experts.w13.shape[0]
            hf = {(e, piece): f"layers.{i}.{prefix}.experts.{e}.{piece}" for e in range(num) for piece in names}
            schemes = {k: self.quant.scheme_for(self._hf_full(h)) for k, h in hf.items()}
            if all(s is None for s in schemes.values()):
                continue
            if any(s is None for s in schemes.values()):
                raise ConfigError(f"layer {i}: the checkpoint quantizes only some of its experts")
            target = _Target(f"layers.{i}.mlp.experts", {k: _Part(s) for k, s in schemes.items()}, experts=num)
            self._targets[target.name] = target
            for k, h in hf.items():
                self._owner[h] = (target, k)
            layer.mlp.experts = _Pending(0, 0, False)

    def _hf_name(self, ours: str) -> str:
        prefix = getattr(self.model, "MOE_PREFIX", "mlp")
        return ours if prefix == "mlp" else re.sub(r"^(layers\.\d+)\.mlp\.", rf"\1.{prefix}.", ours)

    @staticmethod
    def _hf_full(name: str) -> str:
        return name if name.startswith("lm_head") else f"model.{name}"

    # -- while loading: catch, complete, build --------------------------------------------

    def split(self, weights):
        """Yields the float tensors; keeps the quantized linears' (and their biases)."""
        for name, tensor in weights:
            short = name.removeprefix("model.")
            module, _, suffix = short.rpartition(".")
            owner = self._owner.get(module)
            if owner is None:
                yield name, tensor
                continue
            target, key = owner
            if key == "fused":                       # one stored tensor for all the target's parts
                target.parts = {0: _Part(target.parts[0].scheme)} if len(target.parts) > 1 else target.parts
                key = 0
                for h, (t, k) in list(self._owner.items()):
                    if t is target and k not in (0, "fused"):
                        del self._owner[h]
            part = target.parts.get(key)
            if part is None or part.levels is not None:
                continue                             # a tensor the scheme does not use, after its part is built
            part.tensors[suffix] = tensor
            self._try_complete(target, key, part)

    def _try_complete(self, target: _Target, key, part: _Part) -> None:
        need = required(part.scheme) + (("bias",) if target.has_bias else ())
        if not all(n in part.tensors for n in need):
            return
        part.bias = part.tensors.get("bias")
        part.levels = unpack(part.scheme, part.tensors, f"{target.name} ({key})")
        part.tensors = {}
        if all(p.levels is not None for p in target.parts.values()):
            self._build(target)

    def _build(self, target: _Target) -> None:
        if target.experts:
            module = self._experts(target)
        else:
            parts = [target.parts[i] for i in sorted(target.parts)]
            bias = torch.cat([p.bias for p in parts]) if target.has_bias else None
            module = fused_module(parts[0].scheme, [p.levels for p in parts], bias, self.device)
        parent, _, attr = target.name.rpartition(".")
        setattr(self.model.get_submodule(parent) if parent else self.model, attr, module)
        del self._targets[target.name]

    def _experts(self, target: _Target) -> ShippedExperts:
        names = self.model.EXPERT_NAMES                        # HF piece -> (w13 | w2, shard)
        gate_up, down = [], []
        for e in range(target.experts):
            pieces = {names[p]: target.parts[(e, p)] for p in names}
            first = pieces[("w13", 0)]
            gate_up.append(fused_module(first.scheme, [pieces[("w13", 0)].levels, pieces[("w13", 1)].levels],
                                        None, self.device))
            down.append(fused_module(first.scheme, [pieces[("w2", 0)].levels], None, self.device))
        return ShippedExperts(gate_up, down)

    def finish(self) -> None:
        if self._targets:
            missing = sorted(self._targets)
            raise ModelError(f"the quantized checkpoint lacks tensors of {', '.join(missing[:5])}"
                             + (" ..." if len(missing) > 5 else ""))
        self.model.quantization = self.quant.name

    def covers(self, weight_name: str) -> bool:
        """Whether a name the float model expected (CausalLM.expected_weight_names) is this loader's."""
        return any(weight_name.startswith((t + ".", t + "#")) for t in self.module_names)
