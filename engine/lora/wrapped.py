"""The model's projections with LoRA deltas, for a whole batch of rows of different adapters.

    loras = apply_loras(model, specs, max_loras)   # after the weights (and quantization): wraps the
                                                   # targeted projections in LoraLinear, in place
    loras.batch.segments = Segments(...)            # per step (the runner): rows grouped by slot
    model(...)                                      # each LoraLinear adds its deltas

A wrapped projection keeps, per slot, A for all its output slices stacked [slices * R, in] and B per
slice [size, R] (scaling folded in); R is the largest rank of the job's adapters, smaller ranks and
untargeted slices zero-padded. Slices follow the fused layouts: qkv_proj is [q | k | v] rows,
gate_up_proj [gate | up], o_proj and down_proj one slice. The delta is two segmented gather
matmuls (kernels.sgmv): shrink h = x @ A.T for all slices at once, then expand y[slice] += h[slice] @ B.T.

Tensor parallelism: a rank's slices are its rows of the column-parallel projections (q, k, v, gate,
up: B split by the output side, as the base weight) and its columns of the row-parallel ones (o,
down: A split by the input side); B(A_r x_r) summed by the layer's all-reduce is B(A x) since B is
whole there.

Residency: slots hold the adapters the device keeps; with max_loras below the job's adapters the
host keeps all of them and `place` copies an adapter into a free slot before a step needs it
(the scheduler runs rows of at most max_loras adapters at once).
"""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from jobrunner.engine.config.engine_config import ConfigError
from jobrunner.engine.lora.adapter import AdapterSpec, adapter_tensors
from jobrunner.kernels.ops import Segments, sgmv

# HF projection -> (our module, slice); a fused HF name covers all slices of ours
_SLICE_OF = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
             "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0),
             "qkv_proj": ("qkv_proj", None), "gate_up_proj": ("gate_up_proj", None)}
_ROW_PARALLEL = ("o_proj", "down_proj")


class LoraBatch:
    """The step's rows grouped by slot; None: no row of this step has an adapter."""
    segments: Segments | None = None


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Module, slices: list[int], rank: int, slots: int, batch: LoraBatch,
                 dtype: torch.dtype, device: torch.device, in_features: int):
        super().__init__()
        self.base, self.batch, self.rank = base, batch, rank
        self.offsets = [sum(slices[:i]) for i in range(len(slices))]
        self.slices = slices
        self.a = torch.zeros(slots, len(slices) * rank, in_features, dtype=dtype, device=device)
        self.b = [torch.zeros(slots, size, rank, dtype=dtype, device=device) for size in slices]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        seg = self.batch.segments
        if seg is None:
            return y
        h = x.new_zeros(x.shape[0], self.a.shape[1])
        sgmv(x, self.a, seg, h)
        r = self.rank
        for s, (off, size) in enumerate(zip(self.offsets, self.slices)):
            sgmv(h[:, s * r:(s + 1) * r], self.b[s], seg, y[:, off:off + size])
        return y

    def load_slot(self, slot: int, a: torch.Tensor, b: list[torch.Tensor]) -> None:
        self.a[slot].copy_(a, non_blocking=True)
        for dst, src in zip(self.b, b):
            dst[slot].copy_(src, non_blocking=True)


class LoraSet:
    """The job's adapters over one model: adapter i (1-based; 0 is the base model) -> its slot."""

    def __init__(self, specs: list[AdapterSpec], modules: dict[str, LoraLinear], host: dict, slots: int):
        self.specs, self.modules, self.host = specs, modules, host
        self.names = [s.name for s in specs]
        self.batch = next(iter(modules.values())).batch if modules else LoraBatch()
        self.num_slots = slots
        self.resident: OrderedDict[int, int] = OrderedDict()     # adapter -> slot, least recently used first

    def index(self, name: str | None) -> int:
        """0 for the base model (None); KeyError for a name the job did not load."""
        return 0 if name is None else self.names.index(name) + 1

    def set_step(self, spans: list[tuple[int, int, int]], device: torch.device) -> None:
        """The step's (first row, rows, adapter) spans become its segments, by slot. Every rank of a
        tensor-parallel group places the same adapters in the same order: the same slots."""
        if not spans:
            self.batch.segments = None
            return
        slots = self.place({a for _, _, a in spans})
        self.batch.segments = Segments([(s, n, slots[a]) for s, n, a in spans], device)

    def place(self, adapters: set[int]) -> dict[int, int]:
        """Slots for this step's adapters (each resident after this call): {adapter: slot}."""
        for adapter in sorted(adapters):
            if adapter in self.resident:
                self.resident.move_to_end(adapter)
                continue
            used = set(self.resident.values())
            free = [s for s in range(self.num_slots) if s not in used]
            if not free:
                victim = next(a for a in self.resident if a not in adapters)
                free = [self.resident.pop(victim)]
            self.resident[adapter] = free[0]
            for path, module in self.modules.items():
                a, b = self.host[adapter][path]
                module.load_slot(free[0], a, b)
        return {a: self.resident[a] for a in adapters}


def apply_loras(model, specs: list[AdapterSpec], max_loras: int | None = None) -> LoraSet:
    """Wraps the projections any adapter targets; ConfigError naming a module the model lacks."""
    if not specs:
        return LoraSet([], {}, {}, 0)
    modules = dict(model.named_modules())
    weights = [_our_tensors(model, modules, spec) for spec in specs]
    rank = max(s.rank for s in specs)
    slots = len(specs) if max_loras is None else min(max_loras, len(specs))
    ref = model.embed_tokens.weight
    batch, wrapped = LoraBatch(), {}
    for path in sorted({p for w in weights for p in w}):
        parent, _, attr = path.rpartition(".")
        base = modules[path]
        in_features = base.in_features        # nn.Linear and the quantized linears (engine/quant) alike
        wrapped[path] = LoraLinear(base, _slice_sizes(modules[parent], attr, base), rank, slots, batch,
                                   ref.dtype, ref.device, in_features)
        setattr(modules[parent], attr, wrapped[path])
    host = {}
    for i, (spec, w) in enumerate(zip(specs, weights), 1):
        host[i] = {path: _stacked(m, w.get(path, {}), spec, rank) for path, m in wrapped.items()}
    loras = LoraSet(specs, wrapped, host, slots)
    if slots == len(specs):                   # all resident: no host copies kept
        loras.place(set(range(1, len(specs) + 1)))
        loras.host = {}
    return loras


def _slice_sizes(parent: nn.Module, attr: str, base: nn.Module) -> list[int]:
    out = base.out_features
    if attr == "qkv_proj":
        return [parent.q_size, parent.kv_size, parent.kv_size]
    if attr == "gate_up_proj":
        return [out // 2, out // 2]
    return [out]


def _our_tensors(model, modules: dict, spec: AdapterSpec) -> dict[str, dict[int | None, tuple]]:
    """{our module path: {slice (None: all): (A, B)}} of this rank's part of an adapter."""
    pairs: dict[str, dict] = {}
    for (module, kind), t in adapter_tensors(spec).items():
        pairs.setdefault(module, {})[kind] = t
    out: dict[str, dict] = {}
    for module, ab in pairs.items():
        parent, _, piece = module.rpartition(".")
        ours, slice_ = _SLICE_OF.get(piece, (None, None))
        path = f"{parent}.{ours}"
        if ours is None or path not in modules or ".experts." in module or set(ab) != {"A", "B"}:
            raise ConfigError(f"LoRA adapter {spec.name!r}: target {module} has no counterpart in this model "
                              f"(LoRA applies to the attention and dense MLP projections)")
        a, b = ab["A"], ab["B"]
        if a.shape[0] != b.shape[1]:
            raise ConfigError(f"LoRA adapter {spec.name!r}: {module}'s A and B ranks differ")
        name, split = f"{module}.weight", model.shards.select
        if model.tp.size > 1:
            if piece in _ROW_PARALLEL:
                a = _take(a, split(name, tuple(a.shape)))
            else:
                b = _take(b, split(name, tuple(b.shape)))
        out.setdefault(path, {})[slice_] = (a, b)
    return out


def _take(t: torch.Tensor, ranges) -> torch.Tensor:
    if ranges is None:
        return t
    dim, parts = ranges
    return torch.cat([t.narrow(dim, start, n) for start, n in parts], dim=dim)


def _stacked(m: LoraLinear, pieces: dict, spec: AdapterSpec, rank: int):
    """One adapter's (A [slices * R, in], [B_s [size_s, R]]) for module m, scaling folded into B."""
    dtype, device = m.a.dtype, m.a.device
    a = torch.zeros(m.a.shape[1:], dtype=dtype)
    b = [torch.zeros(size, rank, dtype=dtype) for size in m.slices]
    for slice_, (pa, pb) in pieces.items():
        r = pa.shape[0]
        for s in (range(len(m.slices)) if slice_ is None else [slice_]):
            rows = pb[m.offsets[s]:m.offsets[s] + m.slices[s]] if slice_ is None else pb
            if pa.shape[1] != a.shape[1] or rows.shape[0] != m.slices[s] or r > rank:
                raise ConfigError(f"LoRA adapter {spec.name!r}: shapes A {tuple(pa.shape)}, B {tuple(pb.shape)} "
                                  f"do not fit the model's projection")
            a[s * rank:s * rank + r] = pa.to(dtype)
            b[s][:, :r] = rows.to(dtype) * spec.scaling
    pin = device.type == "cuda"
    return (a.pin_memory() if pin else a), [x.pin_memory() if pin else x for x in b]
