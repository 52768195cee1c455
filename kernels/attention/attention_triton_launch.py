"""Launch parameters of kernels/attention/attention_triton.py's kernels: the tiles for a head size and dtype, the
checks of paged_attention_triton's arguments, and the step's host-side summary (kept on its metadata)."""
from __future__ import annotations

import functools

import torch

from jobrunner.kernels.common.triton_utils import check, check_last_contiguous, check_same_device, next_pow2


@functools.lru_cache(maxsize=8)
def num_sms(device_index: int) -> int:
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


def check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta,
                 k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> tuple[torch.device, bool]:
    """paged_attention_triton's arguments: shapes, dtypes, strides, one device, the metadata.
    Returns (their device, whether the caches are int8)."""
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
    else:
        check(k_cache.dtype == q.dtype and v_cache.dtype == q.dtype,
              f"caches: dtype {k_cache.dtype}/{v_cache.dtype} must match q {q.dtype} (or be int8)")
        check(k_scale is None and v_scale is None, "scales given for a non-int8 cache")
    device = check_same_device(**tensors)
    check_meta(meta, T)
    return device, kv_int8


def check_meta(meta, T: int) -> None:
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
    total, nd = step_summary(meta)[0], meta.num_decodes
    check(total <= T, f"q has {T} tokens but meta.query_lens sum to {total}")
    check(step_summary(meta)[3], f"meta: the first num_decodes={nd} sequences must have query_len 1")


def step_summary(meta) -> tuple:
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
