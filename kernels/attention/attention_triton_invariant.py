"""Batch-invariant Triton attention over the paged KV cache: the GPU form of the CPU mode's
kernels/attention/attention.py _invariant_cpu (engine/run/batch_invariance.py says what the mode covers).

Every token of the step, decode or prefill, is a row of its own over its own position's keys
(meta.token_rows(): its sequence's block table, keys [0, position]; a sliding window keeps the last
`window` of them). A row's keys are reduced in splits of a fixed size, INVARIANT_SPLIT keys from its
first visible key (not a fixed count of splits: a count would follow the batch through
choose_num_splits), each split by kernels/attention/attention_triton.py's _decode_kernel with
split_keys set; then `_combine_in_order_kernel` merges the row's own splits one after the other, in
split order. So a row's bits depend on its query and its keys alone: not on the rows beside it, the
number of splits the longest row of the step needs, how its prompt was chunked or whether its prefix
came from the cache (a prefill token and a decode at the same position run the same program).

Cost against the ordinary kernels: a prefill chunk reads its keys once per token instead of once per
query tile, and the split factor no longer grows to fill the GPU with small batches of long rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from jobrunner.kernels.attention.attention_triton import launch_decodes, make_step
from jobrunner.kernels.attention.cpu_attention import INVARIANT_SPLIT
from jobrunner.kernels.attention.attention_triton_launch import decode_config
from jobrunner.kernels.common.triton_utils import check, launch, next_pow2


@triton.jit(do_not_specialize=["window", "split_keys"])
def _combine_in_order_kernel(
    po_ptr, plse_ptr, out_ptr, seq_lens_ptr,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    stride_ot, stride_oh,
    window, head_dim, split_keys,
    BLOCK_D: tl.constexpr,
):
    """One (row, head): its own splits' partial outputs o_s and log2-sum-exps lse_s, merged in split order:
    out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M), M the largest lse_s (a max: any order gives it)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_dim
    seq_len = tl.load(seq_lens_ptr + t)
    kv_lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    n = tl.cdiv(seq_len - kv_lo, split_keys)                                     # this row's splits
    lse_row = plse_ptr + t * stride_lb + h * stride_lh
    o_row = po_ptr + t * stride_pb + h * stride_ph
    m = float("-inf")
    for s in range(0, n):
        m = tl.maximum(m, tl.load(lse_row + s))
    m = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([BLOCK_D], tl.float32)
    w_sum = 0.0
    for s in range(0, n):
        w = tl.exp2(tl.load(lse_row + s) - m)                                    # 0 for a split that saw nothing
        acc += w * tl.load(o_row + s * stride_ps + d, mask=dmask, other=0.0)
        w_sum += w
    out = acc / tl.where(w_sum > 0, w_sum, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=dmask)


def paged_attention_triton_invariant(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta,
                                     scale: float, k_scale: torch.Tensor | None = None,
                                     v_scale: torch.Tensor | None = None, *, sliding: bool = True,
                                     softcap: float | None = None, split: int = INVARIANT_SPLIT) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D], like paged_attention_triton (the same arguments and layout), each token's
    bits a function of its own query and keys (module docstring). split: keys a split, a multiple of the
    decode kernel's key tile (32 or 64)."""
    step, device = make_step(q, k_cache, v_cache, meta, scale, k_scale, v_scale, sliding, softcap)
    Hk, D = k_cache.shape[2], q.shape[2]
    group = q.shape[1] // Hk
    block_n = decode_config(D, group, q.dtype, step.flags["KV_INT8"])["BLOCK_N"]
    check(split > 0 and split % block_n == 0, f"split {split}: a positive multiple of the key tile {block_n}")
    tables, seq_lens = meta.token_rows()
    rows = int(seq_lens.shape[0])
    if rows == 0:
        return step.tensors[-1]
    longest = max(meta.seq_lens)
    if step.window:
        longest = min(longest, step.window)
    num_splits = max(1, triton.cdiv(longest, split))                  # the grid's; each row combines its own
    part_o, part_lse = launch_decodes(step, tables, seq_lens, rows, group, num_splits, device, split_keys=split)
    out = step.tensors[-1]
    launch(_combine_in_order_kernel, (rows, q.shape[1]), device,
           part_o, part_lse, out, seq_lens, *part_o.stride()[:3], *part_lse.stride()[:2],
           out.stride(0), out.stride(1), step.window, D, split, BLOCK_D=max(16, next_pow2(D)), num_warps=4)
    return out
