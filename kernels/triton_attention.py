"""Triton attention over the paged KV cache: decode (with split-K) and varlen prefill.

Cache layout (see kernels/attention.py), per layer:

    k_cache, v_cache: [num_blocks, block_size, Hk, D]   float (= q.dtype), or int8 with
    k_scale, v_scale: [num_blocks, block_size, Hk]      float32 (kernels/kv_int8.py)

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
         context length (CUDA graphs capture a fixed grid).
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
when the runner sets one (fix it for graph capture), else from choose_num_splits() (kernels/attention.py).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.attention_metadata import choose_num_splits
from kernels.triton_utils import check, check_last_contiguous, check_same_device, launch, next_pow2

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
@triton.jit(do_not_specialize=["window", "num_splits", "stride_bt"])
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
    window, head_dim, num_splits,
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
    # This split's keys: [start, end), a multiple of BLOCK_N long.
    per_split = tl.cdiv(tl.cdiv(seq_len - kv_lo, num_splits), BLOCK_N) * BLOCK_N
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

@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Tiles, checked by compiling for sm_90 offline (`python -m benchmarks.kernel_bench
# --compile-only`): in 16-bit at head_dim <= 128 no kernel spills; prefill runs on
# wgmma, both use cp.async pipelining. float32 takes the FMA path ("ieee" dot, exact
# float32), far more register-hungry: smaller tiles and some spilling remain; on GPUs
# float32 is a correctness path, not a fast one.

def decode_config(D: int, group: int, dtype: torch.dtype, kv_int8: bool = False) -> dict:
    """Constexprs and launch options of _decode_kernel (without BLOCK_SIZE, SPLIT, KV_INT8).
    An int8 cache gets 3 stages: with 2, ptxas spills a few bytes at head_dim 128."""
    BLOCK_D = max(16, next_pow2(D))
    small = BLOCK_D > 128 or dtype == torch.float32
    return dict(GROUP=group, BLOCK_G=max(16, next_pow2(group)), BLOCK_N=32 if small else 64, BLOCK_D=BLOCK_D,
                PRECISION="ieee" if dtype == torch.float32 else "tf32", num_warps=4, num_stages=3 if kv_int8 else 2)


def prefill_config(D: int, group: int, dtype: torch.dtype, max_query_len: int) -> dict:
    """Constexprs and launch options of _prefill_kernel (without BLOCK_SIZE, KV_INT8).
    BLOCK_M rows = BLOCK_Q tokens x GROUP heads; shorter tiles for short chunks."""
    BLOCK_D = max(16, next_pow2(D))
    small = BLOCK_D > 128 or dtype == torch.float32
    BLOCK_M, BLOCK_N = (64, 32) if small else (128, 64)
    BLOCK_M = max(BLOCK_M, next_pow2(group))
    if max_query_len * group < BLOCK_M:
        BLOCK_M = max(16, next_pow2(max_query_len * group))
    return dict(GROUP=group, BLOCK_Q=BLOCK_M // group, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
                PRECISION="ieee" if dtype == torch.float32 else "tf32",
                num_warps=8 if BLOCK_M * BLOCK_D >= 64 * 128 else 4, num_stages=2)


def _check_meta(meta, T: int) -> None:
    B = len(meta.query_lens)
    check(len(meta.seq_lens) == B, f"meta: {len(meta.seq_lens)} seq_lens for {B} query_lens")
    check(0 <= meta.num_decodes <= B, f"meta: num_decodes {meta.num_decodes} outside [0, {B}]")
    check(meta.block_tables.dim() == 2 and meta.block_tables.shape[0] == B
          and meta.block_tables.dtype == torch.int32,
          f"meta.block_tables: expected [{B}, max_blocks] int32, got {tuple(meta.block_tables.shape)} "
          f"{meta.block_tables.dtype}")
    check(meta.block_tables.stride(1) == 1 or meta.block_tables.shape[1] <= 1,
          "meta.block_tables: rows must be contiguous")
    check(meta.query_start_loc.shape == (B + 1,) and meta.query_start_loc.dtype == torch.int32,
          f"meta.query_start_loc: expected [{B + 1}] int32, got {tuple(meta.query_start_loc.shape)} "
          f"{meta.query_start_loc.dtype}")
    check(meta.seq_lens_t.shape == (B,) and meta.seq_lens_t.dtype == torch.int32,
          f"meta.seq_lens_t: expected [{B}] int32, got {tuple(meta.seq_lens_t.shape)} {meta.seq_lens_t.dtype}")
    total, nd = _step_summary(meta)[0], meta.num_decodes
    check(total <= T, f"q has {T} tokens but meta.query_lens sum to {total}")
    check(_step_summary(meta)[3], f"meta: the first num_decodes={nd} sequences must have query_len 1")


def _step_summary(meta) -> tuple:
    """(total tokens, max decode seq_len, max prefill query_len, decodes all 1 token): host-side
    facts from meta's Python lists, computed once per step and kept on meta (every layer
    asks the same questions)."""
    cached = meta.__dict__.get("_triton_summary")
    if cached is not None and cached[0] is meta.query_lens and cached[1] is meta.seq_lens:
        return cached[2]
    nd = meta.num_decodes
    summary = (sum(meta.query_lens), max(meta.seq_lens[:nd], default=0), max(meta.query_lens[nd:], default=0),
               all(n == 1 for n in meta.query_lens[:nd]))
    meta.__dict__["_triton_summary"] = (meta.query_lens, meta.seq_lens, summary)
    return summary


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
    check(q.dim() == 3, f"q: expected [T, Hq, D], got {tuple(q.shape)}")
    T, Hq, D = q.shape
    check(q.dtype in (torch.float16, torch.bfloat16, torch.float32), f"q: dtype {q.dtype} not supported")
    check(k_cache.dim() == 4 and v_cache.shape == k_cache.shape and k_cache.shape[3] == D,
          f"caches: expected [num_blocks, block_size, Hk, {D}], got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    NB, BS, Hk, _ = k_cache.shape
    check(Hk > 0 and Hq % Hk == 0, f"num_heads {Hq} is not a multiple of num_kv_heads {Hk}")
    check(BS == meta.block_size, f"cache block_size {BS} != meta.block_size {meta.block_size}")
    check(D >= 16, f"head_dim {D} < 16 is not supported by the tensor-core kernels")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_contiguous(name, t)
    kv_int8 = k_cache.dtype == torch.int8
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=meta.block_tables,
                   query_start_loc=meta.query_start_loc, seq_lens_t=meta.seq_lens_t)
    if kv_int8:
        check(v_cache.dtype == torch.int8, f"v_cache: dtype {v_cache.dtype}, expected int8 like k_cache")
        check(k_scale is not None and v_scale is not None, "int8 caches need k_scale and v_scale")
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            check(s.shape == (NB, BS, Hk) and s.dtype == torch.float32,
                  f"{name}: expected [{NB}, {BS}, {Hk}] float32, got {tuple(s.shape)} {s.dtype}")
        check(k_scale.stride() == v_scale.stride(), "k_scale and v_scale must have the same strides")
        tensors.update(k_scale=k_scale, v_scale=v_scale)
        s_strides = k_scale.stride()
    else:
        check(k_cache.dtype == q.dtype and v_cache.dtype == q.dtype,
              f"caches: dtype {k_cache.dtype}/{v_cache.dtype} must match q {q.dtype} (or be int8)")
        check(k_scale is None and v_scale is None, "scales given for a non-int8 cache")
        k_scale = v_scale = k_cache  # unused placeholders
        s_strides = (0, 0, 0)
    device = check_same_device(**tensors)
    _check_meta(meta, T)

    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    B, nd = len(meta.query_lens), meta.num_decodes
    total, max_decode_len, max_q, _ = _step_summary(meta)
    if total < T:                      # padding rows (a padded CUDA-graph batch): zeros, not garbage
        out[total:].zero_()
    group = Hq // Hk
    check(softcap is None or softcap > 0, f"softcap must be positive, got {softcap}")
    window = int(meta.sliding_window or 0) if sliding else 0
    # with a cap, the kernel scales by scale / softcap, takes tanh, then multiplies by softcap * log2(e)
    scale_log2 = float(scale) / softcap if softcap else float(scale) * LOG2E
    softcap_log2 = float(softcap or 0.0) * LOG2E
    BLOCK_D = max(16, next_pow2(D))
    bt = meta.block_tables
    common_strides = (q.stride(0), q.stride(1),
                      k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                      v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                      *s_strides, out.stride(0), out.stride(1), bt.stride(0))

    if nd > 0:
        if num_splits is None:
            num_splits = getattr(meta, "decode_splits", None)
        if num_splits is None:
            sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device()) \
                if device.type == "cuda" else 132
            num_splits = choose_num_splits(nd, Hk, max_decode_len, sms)
        check(num_splits >= 1, f"num_splits must be >= 1, got {num_splits}")
        if num_splits > 1:
            part_o = torch.empty((nd, Hq, num_splits, D), dtype=torch.float32, device=device)
            part_lse = torch.empty((nd, Hq, num_splits), dtype=torch.float32, device=device)
        else:
            part_o = part_lse = out  # unused
        p_strides = (*part_o.stride()[:3], *part_lse.stride()[:2]) if num_splits > 1 else (0, 0, 0, 0, 0)
        launch(_decode_kernel, (nd, Hk, num_splits), device,
               q, k_cache, v_cache, k_scale, v_scale, out, part_o, part_lse,
               bt, meta.seq_lens_t, scale_log2, softcap_log2, *common_strides, *p_strides,
               window, D, num_splits, **decode_config(D, group, q.dtype, kv_int8), BLOCK_SIZE=BS,
               SPLIT=num_splits > 1, KV_INT8=kv_int8, SOFTCAP=bool(softcap))
        if num_splits > 1:
            launch(_decode_reduce_kernel, (nd, Hq), device,
                   part_o, part_lse, out, *p_strides, out.stride(0), out.stride(1), D, num_splits,
                   BLOCK_S=max(2, next_pow2(num_splits)), BLOCK_D=BLOCK_D, num_warps=4)

    if B > nd:
        cfg = prefill_config(D, group, q.dtype, max_q)
        launch(_prefill_kernel, (B - nd, triton.cdiv(max_q, cfg["BLOCK_Q"]), Hk), device,
               q, k_cache, v_cache, k_scale, v_scale, out,
               bt[nd:], meta.seq_lens_t[nd:], meta.query_start_loc[nd:],
               scale_log2, softcap_log2, *common_strides, window, D, **cfg, BLOCK_SIZE=BS, KV_INT8=kv_int8,
               SOFTCAP=bool(softcap))
    return out
