"""Triton attention over the paged KV cache: decode (with split-K) and varlen prefill.

Cache layout (see kernels/attention/attention.py), per layer:

    k_cache, v_cache: [num_blocks, block_size, Hk, D]   float (= q.dtype), or int8 with
    k_scale, v_scale: [num_blocks, block_size, Hk]      float32 (kernels/attention/kv_int8.py)

    block_tables[seq]      = [b0, b1, b2, ...]          (int32, padded)
    token j of seq lives at  slot = block_tables[seq, j // block_size] * block_size + j % block_size

Step layout: q is [T, Hq, D], the decodes first (one token each), then the prefill
chunks, each contiguous. All of the step's K/V are already in the cache (store_kv ran
first), so every key, the chunk's own included, is read through the block table.
Query token i of a sequence with query_len n and seq_len L sits at position
L - n + i and sees keys j <= that position (and j > position - sliding_window when the
layer slides: `sliding`). With `softcap` (Gemma 2), a score s = q.k * scale becomes
softcap * tanh(s / softcap) before the softmax (SOFTCAP constexpr: no cost when off).

Kernels
-------
decode   grid (num_decodes, Hk, num_splits). One program: the GROUP = Hq / Hk query
         heads sharing a KV head (padded to 16 rows so tl.dot runs on tensor cores),
         against the keys of its split. K/V of a head are read once for all its query
         heads: decode is memory bound and this is the traffic that matters.
         With num_splits > 1 (flash-decoding), each split writes a partial output and
         its log-sum-exp, and `_decode_reduce_kernel` merges them: long contexts with
         small batches then still fill the GPU's SMs. Split boundaries are computed
         on the device from seq_lens, so a fixed num_splits stays correct for any
         context length (CUDA graphs capture a fixed grid). Given split_keys, each
         split is that many keys instead, from the row's first key (the batch-invariant
         form: kernels/attention/attention_triton_invariant.py combines them in order).
prefill  grid (num_prefill_seqs, q_tiles, Hk). One program: BLOCK_Q query tokens x
         GROUP heads = BLOCK_M rows (row r: token r // GROUP, head r % GROUP), so K/V
         tiles are shared by a KV head's query heads here too. Keys are walked from the
         window start to the tile's last position, BLOCK_N at a time, with the online
         softmax (exp2 domain, scale folded into log2(e)).

Both kernels gather K/V rows through the block table per key (one table lookup per
key, cached), so any block_size works and a tile may span blocks.

Padding (CUDA-graph batches): a decode with seq_len 0 attends to nothing and gets a
zero output (never NaN); q rows past sum(query_lens) get zeros. The split-K factor
comes from `num_splits`, else from an int attribute `decode_splits` on the metadata
when the runner sets one (fix it for graph capture), else from choose_num_splits() (kernels/attention/attention.py).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from jobrunner.kernels.attention.metadata import choose_num_splits
from jobrunner.kernels.attention.attention_triton_launch import check_inputs, decode_config, num_sms, prefill_config, step_summary
from jobrunner.kernels.common.triton_utils import check, launch, next_pow2

LOG2E = 1.4426950408889634


@triton.jit
def _tanh(x):
    """tanh from exp (the interpreter and every Triton version have it): exact limits, +-1 at +-inf."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, offs, valid, visible, bt_row_ptr, kvh, d, dmask, sm_scale_log2, softcap_log2,
    k_ptr, v_ptr, ks_ptr, vs_ptr, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_sb, stride_ss, stride_sh,
    BLOCK_SIZE: tl.constexpr, KV_INT8: tl.constexpr, PRECISION: tl.constexpr, EMPTY_ROWS: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One key tile of the online softmax (exp2 domain): gathers the K/V rows of positions `offs`
    through the block table, scores them against q's rows, hides what `visible` [rows, keys]
    hides, and folds the tile into (acc, m_i, l_i). EMPTY_ROWS: a row may see no key of a tile
    (causal prefill); it then keeps m_i = -inf and adds nothing. SOFTCAP: sm_scale_log2 is then
    scale / softcap and softcap_log2 = softcap * log2(e), so s = softcap * tanh(q.k * scale / softcap)."""
    blk = tl.load(bt_row_ptr + offs // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    off = offs % BLOCK_SIZE
    kvmask = valid[:, None] & dmask[None, :]
    k = tl.load(k_ptr + blk[:, None] * stride_kb + off[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                mask=kvmask, other=0.0)                                          # [BLOCK_N, BLOCK_D]
    v = tl.load(v_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                mask=kvmask, other=0.0)
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * sm_scale_log2   # [rows, BLOCK_N]
    if KV_INT8:         # int8 values are exact in 16-bit floats: scales go on scores and probabilities
        sp = blk * stride_sb + off * stride_ss + kvh * stride_sh
        s = s * tl.load(ks_ptr + sp, mask=valid, other=0.0)[None, :]
    if SOFTCAP:
        s = _tanh(s) * softcap_log2
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = m_new
    if EMPTY_ROWS:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if KV_INT8:
        p = p * tl.load(vs_ptr + sp, mask=valid, other=0.0)[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    return acc, m_new, l_i


# window, num_splits and the block-table stride (the widest table of the step) stay runtime
# values: no recompile when a step's value changes, and a window of 1 is never folded into a
# constant mixed with tensors below.
@triton.jit(do_not_specialize=["window", "num_splits", "split_keys", "stride_bt"])
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, po_ptr, plse_ptr,
    bt_ptr, seq_lens_ptr,
    sm_scale_log2, softcap_log2,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_sb, stride_ss, stride_sh,
    stride_ot, stride_oh,
    stride_bt,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    window, head_dim, num_splits, split_keys,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr,
    KV_INT8: tl.constexpr, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_dim
    heads = kvh * GROUP + g
    gmask = g < GROUP
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)                # [BLOCK_G, BLOCK_D]

    seq_len = tl.load(seq_lens_ptr + b)
    kv_lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    # This split's keys: [start, end), a multiple of BLOCK_N long: split_keys when given (the batch-invariant
    # form: splits of a fixed size from the row's first key), else the row's keys over num_splits.
    per_split = tl.cdiv(tl.cdiv(seq_len - kv_lo, num_splits), BLOCK_N) * BLOCK_N
    per_split = tl.where(split_keys > 0, split_keys, per_split)
    start = kv_lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        valid = offs < end
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, offs, valid, valid[None, :], bt_ptr + b * stride_bt, kvh, d, dmask, sm_scale_log2,
            softcap_log2, k_ptr, v_ptr, ks_ptr, vs_ptr, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
            stride_vh, stride_sb, stride_ss, stride_sh, BLOCK_SIZE, KV_INT8, PRECISION, EMPTY_ROWS=False,
            SOFTCAP=SOFTCAP)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    omask = gmask[:, None] & dmask[None, :]
    if not SPLIT:
        tl.store(out_ptr + b * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))          # log2 domain
        tl.store(po_ptr + (b * stride_pb + heads * stride_ph + split * stride_ps)[:, None] + d[None, :], o,
                 mask=omask)
        tl.store(plse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=gmask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    po_ptr, plse_ptr, out_ptr,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    stride_ot, stride_oh,
    head_dim, num_splits,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = sp < num_splits
    lse = tl.load(plse_ptr + b * stride_lb + h * stride_lh + sp, mask=smask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)                                                          # 0 for empty splits
    o = tl.load(po_ptr + b * stride_pb + h * stride_ph + sp[:, None] * stride_ps + d[None, :],
                mask=smask[:, None] & (d[None, :] < head_dim), other=0.0)
    w_sum = tl.sum(w, axis=0)
    w_sum = tl.where(w_sum > 0, w_sum, 1.0)
    out = tl.sum(o * w[:, None], axis=0) / w_sum
    tl.store(out_ptr + b * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < head_dim)


@triton.jit(do_not_specialize=["window", "stride_bt"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr,
    bt_ptr, seq_lens_ptr, qsl_ptr,
    sm_scale_log2, softcap_log2,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_sb, stride_ss, stride_sh,
    stride_ot, stride_oh,
    stride_bt,
    window, head_dim,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    KV_INT8: tl.constexpr, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    qtile = tl.program_id(1)
    kvh = tl.program_id(2)

    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len                                                        # cached prefix length
    t0 = qtile * BLOCK_Q

    r = tl.arange(0, BLOCK_M)
    tok = t0 + r // GROUP                                                        # token within the chunk
    heads = kvh * GROUP + r % GROUP
    rmask = (r < BLOCK_Q * GROUP) & (tok < q_len)
    pos = ctx + tok                                                              # [BLOCK_M] positions
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_dim
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)                # [BLOCK_M, BLOCK_D]

    # Keys for this tile: [kv_lo, kv_hi); empty when the tile lies past the chunk's end.
    last_tok = tl.minimum(t0 + BLOCK_Q, q_len) - 1
    kv_hi = tl.where(t0 < q_len, ctx + last_tok + 1, 0)
    kv_lo = tl.where(window > 0, tl.maximum(ctx + t0 - window + 1, 0), 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(kv_lo, kv_hi, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        valid = offs < kv_hi
        visible = valid[None, :] & (offs[None, :] <= pos[:, None])
        visible = visible & ((window <= 0) | (offs[None, :] > pos[:, None] - window))
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, offs, valid, visible, bt_ptr + seq * stride_bt, kvh, d, dmask, sm_scale_log2,
            softcap_log2, k_ptr, v_ptr, ks_ptr, vs_ptr, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
            stride_vh, stride_sb, stride_ss, stride_sh, BLOCK_SIZE, KV_INT8, PRECISION, EMPTY_ROWS=True,
            SOFTCAP=SOFTCAP)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


# ----------------------------------------------------------------------------- launchers

class _Step(NamedTuple):
    """What both kernels take, in their argument order (tiles and grids apart)."""
    tensors: tuple          # q, k_cache, v_cache, k_scale, v_scale (the caches when float: unused), out
    scales: tuple           # scale_log2, softcap_log2
    strides: tuple          # q, k_cache, v_cache, the scales, out, block_tables
    window: int
    head_dim: int
    flags: dict             # BLOCK_SIZE, KV_INT8, SOFTCAP


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           num_splits: int | None = None, *, sliding: bool = True,
                           softcap: float | None = None) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D], like kernels.attention.paged_attention_ref.

    k_scale/v_scale: [num_blocks, block_size, Hk] float32, required iff the caches are int8.
    num_splits: split-K factor for the decodes; None: meta.decode_splits if set, else
    choose_num_splits() (on CUDA graphs pass a fixed value; any value is correct).
    sliding: this layer keeps to meta.sliding_window (when set); softcap: scores capped (module docstring).
    """
    step, device = make_step(q, k_cache, v_cache, meta, scale, k_scale, v_scale, sliding, softcap)
    Hk, group = k_cache.shape[2], q.shape[1] // k_cache.shape[2]
    B, nd = len(meta.query_lens), meta.num_decodes
    _, max_decode_len, max_q, _ = step_summary(meta)
    if nd > 0:
        splits = _decode_splits(num_splits, meta, Hk, max_decode_len, device)
        launch_decodes(step, meta.block_tables, meta.seq_lens_t, nd, group, splits, device)
    if B > nd:
        _launch_prefills(step, meta, Hk, group, max_q, device)
    return step.tensors[-1]


def make_step(q, k_cache, v_cache, meta, scale: float, k_scale, v_scale, sliding: bool, softcap: float | None
              ) -> tuple[_Step, torch.device]:
    """The arguments checked and laid out for the kernels, with the output (its padding rows zeroed)."""
    device, kv_int8 = check_inputs(q, k_cache, v_cache, meta, k_scale, v_scale)
    T, Hq, D = q.shape
    if kv_int8:
        s_strides = k_scale.stride()
    else:
        k_scale = v_scale = k_cache  # unused placeholders
        s_strides = (0, 0, 0)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if step_summary(meta)[0] < T:      # padding rows (a padded CUDA-graph batch): zeros, not garbage
        out[step_summary(meta)[0]:].zero_()
    check(softcap is None or softcap > 0, f"softcap must be positive, got {softcap}")
    # with a cap, the kernel scales by scale / softcap, takes tanh, then multiplies by softcap * log2(e)
    scale_log2 = float(scale) / softcap if softcap else float(scale) * LOG2E
    softcap_log2 = float(softcap or 0.0) * LOG2E
    step = _Step(tensors=(q, k_cache, v_cache, k_scale, v_scale, out), scales=(scale_log2, softcap_log2),
                 strides=(q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                          v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                          *s_strides, out.stride(0), out.stride(1), meta.block_tables.stride(0)),
                 window=int(meta.sliding_window or 0) if sliding else 0, head_dim=D,
                 flags=dict(BLOCK_SIZE=k_cache.shape[1], KV_INT8=kv_int8, SOFTCAP=bool(softcap)))
    return step, device


def _decode_splits(num_splits: int | None, meta, Hk: int, max_decode_len: int, device: torch.device) -> int:
    """The split-K factor: the one given, else meta.decode_splits, else choose_num_splits()."""
    if num_splits is None:
        num_splits = getattr(meta, "decode_splits", None)
    if num_splits is None:
        sms = num_sms(device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else 132
        num_splits = choose_num_splits(meta.num_decodes, Hk, max_decode_len, sms)
    check(num_splits >= 1, f"num_splits must be >= 1, got {num_splits}")
    return num_splits


def launch_decodes(step: _Step, tables: torch.Tensor, seq_lens: torch.Tensor, rows: int, group: int,
                   num_splits: int, device: torch.device, split_keys: int = 0):
    """The first `rows` rows of q as decodes over tables [rows, W] and seq_lens [rows]: one program per (row,
    KV head, split). split_keys == 0: the splits' partial outputs merged by _decode_reduce_kernel when there
    are several. split_keys > 0: splits of that many keys each, and the partials (part_o [rows, Hq, S, D],
    part_lse [rows, Hq, S]) are returned unmerged, for the caller's combine (the batch-invariant form)."""
    q, out = step.tensors[0], step.tensors[-1]
    Hq, D = q.shape[1], q.shape[2]
    partial = num_splits > 1 or split_keys > 0
    if partial:
        part_o = torch.empty((rows, Hq, num_splits, D), dtype=torch.float32, device=device)
        part_lse = torch.empty((rows, Hq, num_splits), dtype=torch.float32, device=device)
        p_strides = (*part_o.stride()[:3], *part_lse.stride()[:2])
    else:
        part_o = part_lse = out  # unused
        p_strides = (0, 0, 0, 0, 0)
    launch(_decode_kernel, (rows, Hq // group, num_splits), device,
           *step.tensors, part_o, part_lse, tables, seq_lens, *step.scales, *step.strides[:-1], tables.stride(0),
           *p_strides, step.window, D, num_splits, split_keys,
           **decode_config(D, group, q.dtype, step.flags["KV_INT8"]), SPLIT=partial, **step.flags)
    if split_keys > 0:
        return part_o, part_lse
    if partial:
        launch(_decode_reduce_kernel, (rows, Hq), device,
               part_o, part_lse, out, *p_strides, out.stride(0), out.stride(1), D, num_splits,
               BLOCK_S=max(2, next_pow2(num_splits)), BLOCK_D=max(16, next_pow2(D)), num_warps=4)
    return None


def _launch_prefills(step: _Step, meta, Hk: int, group: int, max_q: int, device: torch.device) -> None:
    """The prefill chunks (the sequences after the decodes): one program per (chunk, query tile, KV head)."""
    q, nd = step.tensors[0], meta.num_decodes
    cfg = prefill_config(step.head_dim, group, q.dtype, max_q)
    launch(_prefill_kernel, (len(meta.query_lens) - nd, triton.cdiv(max_q, cfg["BLOCK_Q"]), Hk), device,
           *step.tensors, meta.block_tables[nd:], meta.seq_lens_t[nd:], meta.query_start_loc[nd:],
           *step.scales, *step.strides, step.window, step.head_dim, **cfg, **step.flags)
