"""Rank 0's step plans to the other ranks of its tensor-parallel group.

Per step, rank 0 broadcasts the ForwardPlan (host lists, over the gloo group) and then, when some
input ids are the previous step's samples, still on the device, those ids (over the device group:
no host sync, so async scheduling keeps its overlap). None ends the other ranks' loop.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from jobrunner.engine.parallel.group import TensorParallel


@dataclass
class ForwardPlan:
    """What every rank runs for one step: the flattened batch, the KV block copies before it, and the
    token rows whose logits are computed, pass by pass in the order rank 0 computes them (computing
    logits is a collective: every rank makes the same calls)."""
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    num_decodes: int = 0
    logit_rows: list[list[int]] = field(default_factory=list)
    patch_rows: list[int] = field(default_factory=list)     # rows whose input id is a sample still on the device
    graphed: bool = False                                    # replays a CUDA graph (every rank captured the same)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    lora_spans: list[tuple[int, int, int]] = field(default_factory=list)   # (first row, rows, adapter): engine/lora
    mrope_positions: list[list[int]] | None = None           # [3, T] multimodal rotary positions, else None


class StepChannel:
    def __init__(self, tp: TensorParallel, device: torch.device):
        self.tp, self.device = tp, device

    def send(self, plan: ForwardPlan | None, patch_ids: torch.Tensor | None = None) -> None:
        """Rank 0: the step's plan, then the placeholder rows' ids [len(plan.patch_rows)] int64."""
        import torch.distributed as dist
        dist.broadcast_object_list([plan], src=0, group=self.tp.host)
        if plan is not None and plan.patch_rows:
            self.tp.broadcast(patch_ids)

    def receive(self) -> tuple[ForwardPlan | None, torch.Tensor | None]:
        """The other ranks: (rank 0's next plan or None at the end, the placeholder ids or None)."""
        import torch.distributed as dist
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.tp.host)
        plan = box[0]
        if plan is None or not plan.patch_rows:
            return plan, None
        return plan, self.tp.broadcast(torch.empty(len(plan.patch_rows), dtype=torch.int64, device=self.device))
