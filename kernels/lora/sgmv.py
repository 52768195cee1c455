"""The segmented gather matmul of batched LoRA (Punica's SGMV, S-LoRA): rows of one flat batch,
cut into contiguous segments, each segment multiplied by its own slot's weight.

    x   [T, K]        the step's rows (a segment's rows are contiguous: the runner orders them by adapter)
    w   [S, N, K]     one weight per slot (an adapter's A, or its B for one output slice)
    segments          (start, length, slot) each; rows in no segment (base-model rows) are left alone
    out [T, N]        out[start:start + length] += x[start:start + length] @ w[slot].T, in place

A LoRA delta is two of these: shrink (x by A, K = in features, N = the rank) then expand (by B,
K = the rank, N = an output slice). `Segments` keeps the host list (the reference loops over it
without a device sync) and the device tensors the Triton kernel reads.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from jobrunner.kernels.common.device import to_device
from jobrunner.kernels.common.triton_utils import use_triton


@dataclass
class Segments:
    spans: list[tuple[int, int, int]]          # (start row, rows, slot)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _tensors: torch.Tensor | None = None

    @property
    def max_rows(self) -> int:
        return max((n for _, n, _ in self.spans), default=0)

    def tensors(self) -> torch.Tensor:
        """[3, len(spans)] int32 on the device: starts, lengths, slots (built once per step)."""
        if self._tensors is None:
            flat = [v for column in zip(*self.spans) for v in column] if self.spans else []
            self._tensors = to_device(flat, self.device, "int32").view(3, len(self.spans))
        return self._tensors


def sgmv_ref(x: torch.Tensor, w: torch.Tensor, segments: Segments, out: torch.Tensor) -> torch.Tensor:
    """The torch reference (and the CPU path): one matmul per segment, on views (no copies)."""
    for start, n, slot in segments.spans:
        if n:
            out[start:start + n].addmm_(x[start:start + n], w[slot].t())
    return out


def sgmv(x: torch.Tensor, w: torch.Tensor, segments: Segments, out: torch.Tensor) -> torch.Tensor:
    """Dispatch: Triton on CUDA (or with JOBRUNNER_TRITON=1), the reference elsewhere."""
    if use_triton(x):
        from jobrunner.kernels.lora.sgmv_triton import sgmv_triton
        return sgmv_triton(x, w, segments, out)
    return sgmv_ref(x, w, segments, out)
