"""Triton grammar mask: logits of tokens whose bit is clear become -inf, in place.

    logits: [rows, vocab] float; bitmask: [rows, words] int32 (bit t % 32 of word t // 32)

Matches `kernels.token_mask.apply_token_bitmask_ref`. Grid: (rows, column blocks); each program
reads BLOCK logits and the BLOCK / 32 words that cover them, so a 150k vocabulary of a
256-row batch is one launch that touches each logit once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from jobrunner.kernels.common.triton_utils import check, check_float, check_last_contiguous, launch


@triton.jit
def _token_bitmask_kernel(logits_ptr, mask_ptr, stride_l, stride_m, vocab, words, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < vocab
    word = cols // 32
    bits = tl.load(mask_ptr + row * stride_m + word, mask=in_vocab & (word < words), other=0)
    allowed = ((bits >> (cols % 32)) & 1) != 0
    ptrs = logits_ptr + row * stride_l + cols
    x = tl.load(ptrs, mask=in_vocab, other=0.0)
    tl.store(ptrs, tl.where(allowed, x, float("-inf")).to(x.dtype), mask=in_vocab & ~allowed)


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits: [rows, vocab] (changed in place and returned); bitmask: [rows, words] int32, same device."""
    check_float("logits", logits)
    check(logits.dim() == 2 and bitmask.dim() == 2 and bitmask.shape[0] == logits.shape[0],
          f"logits [rows, vocab] and bitmask [rows, words] expected, got {tuple(logits.shape)} and "
          f"{tuple(bitmask.shape)}")
    check(bitmask.dtype == torch.int32, f"bitmask must be int32, got {bitmask.dtype}")
    check(bitmask.device == logits.device, "bitmask and logits must be on one device")
    check_last_contiguous("logits", logits)
    check_last_contiguous("bitmask", bitmask)
    rows, vocab = logits.shape
    if rows == 0 or vocab == 0:
        return logits
    BLOCK = 1024
    launch(_token_bitmask_kernel, (rows, triton.cdiv(vocab, BLOCK)), logits.device,
           logits, bitmask, logits.stride(0), bitmask.stride(0), vocab, bitmask.shape[1], BLOCK=BLOCK, num_warps=4)
    return logits
