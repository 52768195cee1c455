"""The mixture-of-experts feed-forward block and the CausalLM around it (Mixtral, Qwen2-MoE, Qwen3-MoE).

    x [T, H] -> gate (router) -> softmax top-k -> fused_moe over the experts' stacked weights
             (+ sigmoid(shared_expert_gate(x)) * shared_expert(x), Qwen2-MoE)

The decoder layer is Llama's; only its `mlp` differs, and only on the sparse layers
(MoEConfig.is_sparse: Qwen's decoder_sparse_step and mlp_only_layers keep some layers dense,
with the config's intermediate_size).

Checkpoints hold one tensor per expert and projection; load_weights copies each into its slice
of the stacked parameters as it arrives (one tensor at a time: memory stays bounded):

    <layer>.<moe>.experts.<e>.<gate>.weight  [I, H]  ->  mlp.experts.w13[e, :, :I]  (transposed)
    <layer>.<moe>.experts.<e>.<up>.weight    [I, H]  ->  mlp.experts.w13[e, :, I:]  (transposed)
    <layer>.<moe>.experts.<e>.<down>.weight  [H, I]  ->  mlp.experts.w2[e]          (transposed)
    <layer>.<moe>.gate.weight                [E, H]  ->  mlp.gate.weight

with (moe; gate, up, down) = (block_sparse_moe; w1, w3, w2) for Mixtral, (mlp; gate_proj, up_proj,
down_proj) for Qwen. A family module sets EXPERT_NAMES and MOE_PREFIX.
"""
from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from jobrunner.engine.config.model_config import ModelConfig
from jobrunner.engine.models.base import CausalLM
from jobrunner.engine.models.layers import GatedMLP
from jobrunner.engine.models.llama import LlamaDecoderLayer
from jobrunner.engine.parallel.group import current as current_group
from jobrunner.engine.parallel.shards import ShardPlan
from jobrunner.kernels.ops import fused_moe, moe_over_linears, route_topk


class Experts(nn.Module):
    """The routed experts' weights, stacked. Float: parameters in the model dtype. Quantized
    (engine/quant: int8 or float8 per output channel): buffers of that dtype plus float32 scales.
    Batch-invariant mode (engine/run/packed_weights.py): each expert's projections as linear modules
    instead (`packed`, set by `pack`), the stacked weights dropped."""

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        # input-major, the transpose of nn.Linear's weight (kernels/moe/moe.py says why)
        self.w13 = nn.Parameter(torch.empty(num_experts, hidden, 2 * inter))    # [E, H, 2I]: gate, up columns
        self.w2 = nn.Parameter(torch.empty(num_experts, inter, hidden))         # [E, I, H]
        self.register_buffer("w13_scale", None)                                 # [E, 2I] when quantized
        self.register_buffer("w2_scale", None)                                  # [E, H] when quantized
        self.packed: nn.ModuleList | None = None     # per expert nn.ModuleList([w13, w2]) linears (pack)

    def forward(self, x, topk_weights, topk_ids, foreign: bool = False):
        if self.packed is not None:
            return moe_over_linears(x, self.packed, topk_weights, topk_ids)
        return fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, self.w13_scale, self.w2_scale, foreign)

    def pack(self, pack) -> None:
        """Each expert's w13 [H, 2I] and w2 [I, H] as nn.Linear modules through pack(linear) -> module (a
        PackedLinear), one expert at a time; then the stacked weights go. Float weights only."""
        if self.w13_scale is not None:
            raise ValueError("quantized experts are not packed")
        packed = nn.ModuleList()
        for w13, w2 in zip(self.w13.detach(), self.w2.detach()):
            packed.append(nn.ModuleList(pack(_linear(w.T.contiguous())) for w in (w13, w2)))
        del self.w13, self.w2
        self.packed = packed

    def set_quantized(self, w13, w13_scale, w2, w2_scale) -> None:
        """Swaps the float parameters for quantized buffers (engine/quant/apply.py)."""
        del self.w13, self.w2
        for name, t in (("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
            self.register_buffer(name, t)


def _linear(weight: torch.Tensor) -> nn.Linear:
    """A bias-free nn.Linear over weight [out, in] (no initialization, no copy)."""
    linear = nn.utils.skip_init(nn.Linear, weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


class SparseMoE(nn.Module):
    """Router, routed experts and (Qwen2-MoE) the sigmoid-gated shared expert. Under tensor parallelism
    each rank holds its share of every expert's columns, or some experts whole (engine/parallel/shards.py:
    then a slot routed to another rank's expert is foreign here), and the block's partial sums,
    routed and shared, are summed over the ranks once, at its end."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.tp = current_group()
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.gate = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)
        plan = ShardPlan(cfg, self.tp)
        (self.first_expert, num_local), self.foreign = plan.experts, plan.experts_whole
        self.experts = Experts(num_local, cfg.hidden_size, plan.expert_width())
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_intermediate_size:
            self.shared_expert = GatedMLP(cfg, moe.shared_intermediate_size, reduce=False)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x):
        """x: [T, H] -> [T, H]."""
        fixed = getattr(self.experts, "packed", None) is not None     # the batch-invariant mode: sums in a fixed order
        topk_weights, topk_ids = route_topk(self.gate(x), self.top_k, self.renormalize, fixed_order=fixed)
        if self.foreign:                      # other ranks' experts -> id num_local (kernels.fused_moe)
            num_local = self.experts.w13.shape[0]
            topk_ids = topk_ids - self.first_expert
            topk_ids = torch.where((topk_ids >= 0) & (topk_ids < num_local), topk_ids, num_local)
        y = self.experts(x, topk_weights, topk_ids, self.foreign)
        if self.shared_expert is not None:
            gate = self.shared_expert_gate(x)
            y = y + (_sigmoid_by_row(gate) if fixed else torch.sigmoid(gate)) * self.shared_expert(x)
        return self.tp.all_reduce(y)


def _sigmoid_by_row(gate: torch.Tensor) -> torch.Tensor:
    """sigmoid of the [T, 1] gate column with every element on torch's scalar path. torch's CPU elementwise
    kernels run whole vectors and the remainder (the last T mod 32 elements here) by a scalar loop that
    rounds otherwise, so a token's sigmoid would follow T; written into a strided output, none is vectorized."""
    return torch.sigmoid(gate, out=gate.new_empty(gate.shape[0], 2)[:, :1])


class MoECausalLM(CausalLM):
    """Llama's decoder layers with SparseMoE as the mlp of the sparse layers."""
    layer_class = LlamaDecoderLayer
    MOE_PREFIX = "mlp"                                              # the block's name in the checkpoint
    EXPERT_NAMES = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        for i, layer in enumerate(self.layers):
            if cfg.moe.is_sparse(i):
                layer.mlp = SparseMoE(cfg)
        names = "|".join(map(re.escape, self.EXPERT_NAMES))
        self._expert_name = re.compile(rf"layers\.(\d+)\.mlp\.experts\.(\d+)\.({names})\.weight")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Per-expert tensors go into the stacked experts; the rest, the shared expert's too, as for a
        dense model (CausalLM.load_weights)."""
        stacked: set[str] = set()
        filled = super().load_weights(self._stack_experts(weights, stacked))
        return filled | stacked

    def _stack_experts(self, weights, filled: set[str]):
        """Yields the tensors that are not expert slices; copies those in, adding their names to filled."""
        for name, tensor in weights:
            name = name.removeprefix("model.").replace(f".{self.MOE_PREFIX}.", ".mlp.", 1)
            m = self._expert_name.fullmatch(name)
            if m:
                layer, expert, piece = int(m[1]), int(m[2]), m[3]
                if layer >= len(self.layers) or not isinstance(self.layers[layer].mlp, SparseMoE) \
                        or expert >= self.config.moe.num_experts:
                    raise KeyError(f"unexpected weight {name!r} (layer {layer} has no expert {expert})")
                target, shard = self.EXPERT_NAMES[piece]
                moe = self.layers[layer].mlp
                param = getattr(moe.experts, target).data[expert - moe.first_expert]     # this rank's stack
                if target == "w13":
                    inter = param.shape[1] // 2               # this rank's share of the expert's columns
                    param = param[:, shard * inter:(shard + 1) * inter]
                with torch.no_grad():
                    param.copy_(tensor.T)
                filled.add(f"layers.{layer}.mlp.experts.{target}#{expert}.{shard}")
            else:
                yield name, tensor

    def expected_weight_names(self) -> set[str]:
        names = {n for n in super().expected_weight_names() if ".mlp.experts." not in n}
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mlp, SparseMoE):
                first, count = self.shards.experts
                for e in range(first, first + count):
                    names.update(f"layers.{i}.mlp.experts.{t}#{e}.{s}" for t, s in self.EXPERT_NAMES.values())
        return names
