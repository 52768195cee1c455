"""Grammar masks on logits: tokens a row's bitmask forbids get -inf before sampling.

    logits:  [rows, vocab] float (changed in place)
    bitmask: [rows, ceil(vocab / 32)] int32; bit t % 32 of word t // 32 set = token t allowed
             (the layout llguidance and xgrammar fill); tokens past the mask's width stay forbidden.
"""
from __future__ import annotations

import torch

from jobrunner.kernels.common.triton_utils import use_triton

_BIT = torch.arange(32, dtype=torch.int32)


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The torch reference: unpacks the bits (one bool per token) and fills the forbidden ones."""
    rows, vocab = logits.shape
    bits = (bitmask.to(logits.device)[:, :, None] >> _BIT.to(logits.device)) & 1      # [rows, words, 32]
    allowed = bits.reshape(rows, -1)[:, :vocab].bool()
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    return logits.masked_fill_(~allowed, float("-inf"))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Dispatch: Triton on CUDA (or with JOBRUNNER_TRITON=1), the reference elsewhere."""
    if use_triton(logits):
        from jobrunner.kernels.token_mask.token_mask_triton import apply_token_bitmask_triton
        return apply_token_bitmask_triton(logits, bitmask)
    return apply_token_bitmask_ref(logits, bitmask)
