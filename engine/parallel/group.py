"""This process's rank in its tensor-parallel group, and the collectives the layers call.

Layers read the group at construction (`current()`, set for the build by `building(tp)`) and keep it;
with one rank every collective is the identity, so the single-device path is unchanged.

Two process groups: `group` moves tensors on the device (NCCL on GPUs, gloo on CPU); `host` (gloo)
carries rank 0's step plans, host objects, so a plan never waits behind the device's queue.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None       # torch.distributed ProcessGroup for device tensors; None with one rank
    host: Any = None        # gloo ProcessGroup for host objects (channel.py)
    moe_split: str = "auto"  # how routed experts are split: auto | experts | columns (shards.ShardPlan)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def part(self, n: int) -> tuple[int, int]:
        """(start, length) of this rank's equal share of n (n divides by the size: shards.check_split checks)."""
        step = n // self.size
        return self.rank * step, step

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of a row-parallel layer's partial outputs, in place."""
        if self.size > 1:
            import torch.distributed as dist
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., size * n], ranks in order along the last dimension."""
        if self.size == 1:
            return x
        import torch.distributed as dist
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x, on every rank (the others pass a tensor of the same shape and dtype), in place."""
        if self.size > 1:
            import torch.distributed as dist
            dist.broadcast(x, src=dist.get_global_rank(self.group, 0), group=self.group)
        return x


SINGLE = TensorParallel()
_CURRENT: ContextVar[TensorParallel] = ContextVar("tensor_parallel", default=SINGLE)


def current() -> TensorParallel:
    """The group a model is being built for (SINGLE outside `building`)."""
    return _CURRENT.get()


@contextmanager
def building(tp: TensorParallel):
    """Layers constructed inside take `tp`'s shapes and collectives."""
    token = _CURRENT.set(tp)
    try:
        yield tp
    finally:
        _CURRENT.reset(token)
