"""Triton kernels against their pure-torch references.

Without CUDA, every kernel runs in Triton's interpreter on CPU tensors, in float16 and
float32 (bfloat16 gives garbage in the interpreter). With CUDA, the `cuda` cases run
the same comparisons on the GPU, bfloat16 included.

Interpreter mode: kernels.triton_utils.launch() interprets any launch on CPU tensors,
whatever TRITON_INTERPRET said when triton was imported, so this module works even if
another test module imported triton first. The env var is still set here (before any
triton import in this module) as belt and braces for a run of this file alone.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from jobrunner.kernels.activation.activation import silu_and_mul, silu_and_mul_ref  # noqa: E402
from jobrunner.kernels.attention.attention import AttentionMetadata, paged_attention, paged_attention_ref, store_kv, store_kv_ref
from jobrunner.kernels.attention.kv_int8 import dequantize_kv_int8_ref, paged_attention_int8_ref, quantize_int8_ref, store_kv_int8, store_kv_int8_ref
from jobrunner.kernels.norm.norm import rms_norm, rms_norm_ref  # noqa: E402
from jobrunner.kernels.rotary.rotary import apply_rotary, apply_rotary_ref, inverse_frequencies, rotary_cos_sin  # noqa: E402
from jobrunner.kernels.activation.activation_triton import silu_and_mul_triton  # noqa: E402
from jobrunner.kernels.attention.attention_triton import choose_num_splits, paged_attention_triton  # noqa: E402
from jobrunner.kernels.attention.kv_cache_triton import store_kv_triton  # noqa: E402
from jobrunner.kernels.norm.norm_triton import rms_norm_triton  # noqa: E402
from jobrunner.kernels.rotary.rotary_triton import apply_rotary_triton  # noqa: E402

from tests.kernel_cases import HAS_CUDA, cuda_only, device_dtype_cases  # noqa: E402

CASES = device_dtype_cases(cuda_fp32=True)
# Elementwise ops: the kernels round like the references, so about one ulp apart.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}
# Attention: kernel output (rounded once, probabilities in q.dtype for P @ V) against a
# float32 reference computed from the same low-precision inputs.
ATTN_TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=3e-3, rtol=3e-3),
            torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def randn(*shape, dtype, device, gen):
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


# ----------------------------------------------------------------------------- rms norm

@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("shape", [(1, 8), (7, 100), (2, 3, 65)], ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm(device, dtype, shape, with_residual, gen):
    x = randn(*shape, dtype=dtype, device=device, gen=gen)
    w = randn(shape[-1], dtype=dtype, device=device, gen=gen)
    r = randn(*shape, dtype=dtype, device=device, gen=gen) if with_residual else None
    out, res = rms_norm_triton(x, w, 1e-5, r)
    ref_out, ref_res = rms_norm_ref(x, w, 1e-5, r)
    assert out.dtype == ref_out.dtype and out.shape == ref_out.shape
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    torch.testing.assert_close(res, ref_res, **TOL[dtype])
    if r is None:
        assert res is x


@pytest.mark.parametrize("device,dtype", CASES)
def test_rms_norm_strided_heads_and_fp32_weight(device, dtype, gen):
    """q/k norm (Qwen3) on a [T, H, D] slice of a fused qkv output, weight kept in float32."""
    qkv = randn(5, (4 + 2 * 2) * 16, dtype=dtype, device=device, gen=gen)
    q = qkv[:, :64].view(5, 4, 16)
    w = randn(16, dtype=torch.float32, device=device, gen=gen)
    out, _ = rms_norm_triton(q, w, 1e-6)
    ref, _ = rms_norm_ref(q, w, 1e-6)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, **TOL[dtype])


# ----------------------------------------------------------------------------- silu * up

@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("shape", [(1, 16), (5, 74), (2, 3, 260)], ids=str)
def test_silu_and_mul(device, dtype, shape, gen):
    x = randn(*shape, dtype=dtype, device=device, gen=gen) * 3
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x), **TOL[dtype])


# ----------------------------------------------------------------------------- rotary

@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("T,Hq,Hk,D", [(1, 1, 1, 8), (7, 5, 1, 24), (9, 6, 2, 64)], ids=str)
def test_rotary(device, dtype, T, Hq, Hk, D, gen):
    # q, k as strided views of a fused qkv projection output, as the model passes them.
    qkv = randn(T, (Hq + 2 * Hk) * D, dtype=dtype, device=device, gen=gen)
    q = qkv[:, :Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D:(Hq + Hk) * D].view(T, Hk, D)
    pos = torch.arange(T, device=device) * 37 + 5
    cos, sin = rotary_cos_sin(pos, inverse_frequencies(D, 10000.0, None).to(device), dtype)
    qo, ko = apply_rotary_triton(q, k, cos, sin)
    qr, kr = apply_rotary_ref(q, k, cos, sin)
    torch.testing.assert_close(qo, qr, **TOL[dtype])
    torch.testing.assert_close(ko, kr, **TOL[dtype])


@pytest.mark.parametrize("device,dtype", CASES)
def test_rotary_inplace(device, dtype, gen):
    q = randn(4, 3, 32, dtype=dtype, device=device, gen=gen)
    k = randn(4, 1, 32, dtype=dtype, device=device, gen=gen)
    cos, sin = rotary_cos_sin(torch.arange(4, device=device), inverse_frequencies(32, 1e4, None).to(device), dtype)
    qr, kr = apply_rotary_ref(q, k, cos, sin)
    qo, ko = apply_rotary_triton(q, k, cos, sin, inplace=True)
    assert qo is q and ko is k
    torch.testing.assert_close(q, qr, **TOL[dtype])
    torch.testing.assert_close(k, kr, **TOL[dtype])


# ----------------------------------------------------------------------------- store kv

@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("T,Hk,D,BS", [(1, 1, 16, 4), (13, 3, 40, 16)], ids=str)
def test_store_kv(device, dtype, T, Hk, D, BS, gen):
    nb = (T + BS - 1) // BS + 2
    slots = torch.randperm(nb * BS, generator=gen)[:T].to(device)
    kv = randn(T, 2 * Hk, D, dtype=dtype, device=device, gen=gen)
    k, v = kv[:, :Hk], kv[:, Hk:]                     # strided views, like the model's
    caches = [randn(nb, BS, Hk, D, dtype=dtype, device=device, gen=gen) for _ in range(2)]
    ref = [c.clone() for c in caches]
    store_kv_triton(k, v, *caches, slots)
    store_kv_ref(k, v, *ref, slots)
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])


@pytest.mark.parametrize("device", [pytest.param("cpu"), pytest.param("cuda", marks=cuda_only)])
def test_store_kv_skips_negative_slots(device, gen):
    k = randn(3, 2, 16, dtype=torch.float32, device=device, gen=gen)
    v = randn(3, 2, 16, dtype=torch.float32, device=device, gen=gen)
    kc, vc = torch.zeros(2, 4, 2, 16, device=device), torch.zeros(2, 4, 2, 16, device=device)
    store_kv_triton(k, v, kc, vc, torch.tensor([5, -1, 0], device=device))
    assert torch.equal(kc.view(-1, 2, 16)[5], k[0]) and torch.equal(vc.view(-1, 2, 16)[0], v[2])
    assert int((kc.view(-1, 2, 16).abs().sum((1, 2)) > 0).sum()) == 2


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("T,Hk,D,BS", [(2, 1, 16, 4), (11, 3, 48, 8)], ids=str)
def test_store_kv_int8(device, dtype, T, Hk, D, BS, gen):
    nb = (T + BS - 1) // BS + 1
    slots = torch.randperm(nb * BS, generator=gen)[:T].to(device)
    k = randn(T, Hk, D, dtype=dtype, device=device, gen=gen) * 3
    v = randn(T, Hk, D, dtype=dtype, device=device, gen=gen)
    k[0, 0] = 0                                        # an all-zero vector stays finite
    caches = [torch.zeros(nb, BS, Hk, D, dtype=torch.int8, device=device) for _ in range(2)]
    scales = [torch.zeros(nb, BS, Hk, dtype=torch.float32, device=device) for _ in range(2)]
    ref_c, ref_s = [c.clone() for c in caches], [s.clone() for s in scales]
    store_kv_triton(k, v, *caches, slots, k_scale=scales[0], v_scale=scales[1])
    store_kv_int8_ref(k, v, *ref_c, *ref_s, slots)
    for c, rc, s, rs, x in zip(caches, ref_c, scales, ref_s, (k, v)):
        torch.testing.assert_close(s, rs, atol=0, rtol=1e-6)
        diff = (c.int() - rc.int()).abs()
        assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.01   # ties may round apart
        deq = dequantize_kv_int8_ref(c, s, torch.float32).view(-1, Hk, D)[slots]
        err = (deq - x.float()).abs()
        assert bool((err <= s.view(-1, Hk)[slots][..., None] * 0.5 + 1e-2 * x.float().abs() + 1e-6).all())


# ----------------------------------------------------------------------------- attention

def make_step(seqs, num_decodes, Hq, Hk, D, BS, dtype, device, gen, window=None, int8=False):
    """seqs: [(query_len, seq_len)], decodes first. Fills a shuffled paged cache with random
    K/V for every position (the step's own tokens included, as store_kv would have)."""
    nb = sum((L + BS - 1) // BS for _, L in seqs) + 3
    free = torch.randperm(nb, generator=gen).tolist()
    tables, slots = [], []
    for ql, L in seqs:
        table = [free.pop() for _ in range((L + BS - 1) // BS)]
        tables.append(table)
        slots += [table[p // BS] * BS + p % BS for p in range(L - ql, L)]
    meta = AttentionMetadata.build(BS, num_decodes, [q for q, _ in seqs], [L for _, L in seqs], slots, tables,
                                   device, window)
    T = sum(q for q, _ in seqs)
    q = randn(T, Hq, D, dtype=dtype, device=device, gen=gen)
    k = randn(nb, BS, Hk, D, dtype=dtype, device=device, gen=gen)
    v = randn(nb, BS, Hk, D, dtype=dtype, device=device, gen=gen)
    if not int8:
        return q, (k, v), meta
    (kq, ks), (vq, vs) = quantize_int8_ref(k), quantize_int8_ref(v)
    return q, (kq, vq, ks, vs), meta


def attention_triton(q, cache, meta, scale, **kw):
    if len(cache) == 4:
        kq, vq, ks, vs = cache
        return paged_attention_triton(q, kq, vq, meta, scale, k_scale=ks, v_scale=vs, **kw)
    return paged_attention_triton(q, cache[0], cache[1], meta, scale, **kw)


def attention_ref_fp32(q, cache, meta, scale):
    if len(cache) == 4:
        kq, vq, ks, vs = cache
        return paged_attention_int8_ref(q.float(), kq, vq, ks, vs, meta, scale)
    return paged_attention_ref(q.float(), cache[0].float(), cache[1].float(), meta, scale)


DECODE_SHAPES = [  # Hq, Hk, D, block_size, seqs
    (2, 2, 16, 4, [(1, 1), (1, 7), (1, 33)]),          # MHA, tiny blocks, a length-1 context
    (6, 2, 40, 16, [(1, 50), (1, 17)]),                 # GQA 3, head_dim not a power of two
    (9, 3, 64, 16, [(1, 130), (1, 3), (1, 64)]),        # SmolLM2's heads
]


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=["mha", "gqa3-d40", "smollm"])
@pytest.mark.parametrize("splits", [1, 3], ids=["nosplit", "split3"])
def test_decode_attention(device, dtype, shape, splits, gen):
    Hq, Hk, D, BS, seqs = shape
    q, cache, meta = make_step(seqs, len(seqs), Hq, Hk, D, BS, dtype, device, gen)
    out = attention_triton(q, cache, meta, D ** -0.5, num_splits=splits)
    torch.testing.assert_close(out.float(), attention_ref_fp32(q, cache, meta, D ** -0.5), **ATTN_TOL[dtype])


@pytest.mark.parametrize("device,dtype", CASES)
def test_decode_attention_many_splits_and_window(device, dtype, gen):
    """More splits than some sequences have key tiles (empty splits), plus a sliding window."""
    q, cache, meta = make_step([(1, 200), (1, 9), (1, 70)], 3, 4, 2, 32, 8, dtype, device, gen, window=45)
    out = attention_triton(q, cache, meta, 0.2, num_splits=5)
    torch.testing.assert_close(out.float(), attention_ref_fp32(q, cache, meta, 0.2), **ATTN_TOL[dtype])


PREFILL_SHAPES = [  # Hq, Hk, D, block_size, seqs (query_len, seq_len), window
    (2, 2, 16, 4, [(5, 5)], None),                      # a whole prompt, no cached prefix
    (6, 2, 40, 16, [(9, 9), (5, 40), (45, 60)], None),  # varlen chunks over cached prefixes, GQA 3,
                                                        # the long chunk over 2 q tiles of 42 tokens
    (4, 1, 32, 8, [(40, 40), (3, 64)], None),           # MQA (group 4); 2 q tiles of 32 tokens
    (4, 2, 32, 8, [(23, 40), (6, 6)], 11),              # sliding window
]


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("shape", PREFILL_SHAPES, ids=["prompt", "chunks-gqa", "mqa", "window"])
def test_prefill_attention(device, dtype, shape, gen):
    Hq, Hk, D, BS, seqs, window = shape
    q, cache, meta = make_step(seqs, 0, Hq, Hk, D, BS, dtype, device, gen, window=window)
    out = attention_triton(q, cache, meta, D ** -0.5)
    torch.testing.assert_close(out.float(), attention_ref_fp32(q, cache, meta, D ** -0.5), **ATTN_TOL[dtype])


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("int8", [False, True], ids=["float-cache", "int8-cache"])
def test_mixed_step_attention(device, dtype, int8, gen):
    """Decodes then prefill chunks in one step, the way the runner lays them out."""
    seqs = [(1, 21), (1, 90), (7, 7), (12, 35)]
    q, cache, meta = make_step(seqs, 2, 6, 3, 32, 16, dtype, device, gen, window=None, int8=int8)
    out = attention_triton(q, cache, meta, 32 ** -0.5, num_splits=2)
    torch.testing.assert_close(out.float(), attention_ref_fp32(q, cache, meta, 32 ** -0.5), **ATTN_TOL[dtype])


def attention_one_by_one(q, k, v, meta, scale, window=None, softcap=None):
    """Each decode sequence alone, its keys read straight from its table: what grouping must not change."""
    out = torch.empty_like(q)
    bs, (_, _, hk, d) = meta.block_size, k.shape
    for i in range(meta.num_decodes):
        L = meta.seq_lens[i]
        slots = torch.tensor([int(meta.block_tables[i, p // bs]) * bs + p % bs for p in range(L)])
        lo = max(0, L - window) if window else 0
        ks, vs = k.view(-1, hk, d)[slots[lo:]], v.view(-1, hk, d)[slots[lo:]]          # [L', Hk, D]
        qi = q[i].view(hk, -1, d)                                                       # [Hk, G, D]
        s = torch.einsum("hgd,lhd->hgl", qi, ks) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        out[i] = torch.einsum("hgl,lhd->hgd", torch.softmax(s, -1), vs).reshape(-1, d)
    return out


@pytest.mark.parametrize("window,softcap", [(None, None), (40, None), (None, 30.0)], ids=["plain", "window", "softcap"])
def test_decode_gather_groups_rows_by_length(window, softcap, gen):
    """One long row among short ones: the gather path pads each group of like length to its own longest,
    not every row to the long one, and computes what each sequence alone would (issue 41)."""
    from jobrunner.kernels.attention.metadata import length_groups
    lens = [5, 900, 12, 7, 30, 33, 2000, 9]
    q, (k, v), meta = make_step([(1, L) for L in lens], len(lens), 4, 2, 16, 16, torch.float32, "cpu", gen,
                                window=window)
    groups = meta.decode_groups()
    assert len(groups) > 1 and sorted(int(r) for rows, _ in groups for r in rows) == list(range(len(lens)))
    padded = sum(len(rows) * -(-max(lens[int(r)] for r in rows) // 16) for rows, _ in groups)
    assert padded <= 2 * sum(-(-L // 16) for L in lens) + 32 * len(groups)               # not 8 x 125 blocks
    out = paged_attention_ref(q, k, v, meta, 0.25, softcap=softcap)
    torch.testing.assert_close(out, attention_one_by_one(q, k, v, meta, 0.25, window, softcap), atol=1e-5, rtol=1e-5)
    # like lengths stay one group, in order (no extra calls, the gather path as it was)
    assert length_groups([40, 33, 47, 35], 16) == [[0, 1, 2, 3]]
    (kq, ks), (vq, vs) = quantize_int8_ref(k), quantize_int8_ref(v)
    out8 = paged_attention_int8_ref(q, kq, vq, ks, vs, meta, 0.25, softcap=softcap)
    deq = dequantize_kv_int8_ref(kq, ks, torch.float32), dequantize_kv_int8_ref(vq, vs, torch.float32)
    torch.testing.assert_close(out8, attention_one_by_one(q, *deq, meta, 0.25, window, softcap), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@cuda_only[1]
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_attention_llama_shapes_cuda(dtype):
    """Production tiles (head_dim 128, GQA 4, 128-row prefill tiles, automatic split-K)."""
    gen = torch.Generator().manual_seed(7)
    seqs = [(1, 3000), (1, 17), (1, 1500), (1, 4096), (300, 1000), (257, 257), (64, 2048)]
    q, cache, meta = make_step(seqs, 4, 32, 8, 128, 16, dtype, "cuda", gen)
    out = attention_triton(q, cache, meta, 128 ** -0.5)
    torch.testing.assert_close(out.float(), attention_ref_fp32(q, cache, meta, 128 ** -0.5), **ATTN_TOL[dtype])
    for splits in (1, 7, 32):
        out = attention_triton(q, cache, meta, 128 ** -0.5, num_splits=splits)
        torch.testing.assert_close(out.float(), attention_ref_fp32(q, cache, meta, 128 ** -0.5), **ATTN_TOL[dtype])


def test_choose_num_splits():
    assert choose_num_splits(256, 8, 4096, num_sms=132) == 1          # big batch: no split
    assert choose_num_splits(4, 8, 300, num_sms=132) == 1             # short contexts: no split
    assert choose_num_splits(4, 8, 32768, num_sms=132) == 9           # small batch, long context
    assert choose_num_splits(1, 1, 1 << 20, num_sms=132) == 32        # capped
    assert choose_num_splits(1, 8, 1024, num_sms=132) == 4            # >= 256 keys a split


# ----------------------------------------------------------------------------- launcher checks

def test_launchers_reject_bad_inputs():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="dtype"):
        rms_norm_triton(x.long(), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm_triton(torch.randn(8, 4).t(), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="even"):
        silu_and_mul_triton(torch.randn(3, 5))
    with pytest.raises(ValueError, match="cos/sin"):
        apply_rotary_triton(torch.randn(2, 2, 8), torch.randn(2, 1, 8), torch.randn(2, 4), torch.randn(2, 4))
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv_triton(torch.randn(2, 1, 16), torch.randn(2, 1, 16), torch.zeros(2, 4, 1, 16),
                        torch.zeros(2, 4, 1, 16), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="k_scale"):
        store_kv_triton(torch.randn(2, 1, 16), torch.randn(2, 1, 16), torch.zeros(2, 4, 1, 16, dtype=torch.int8),
                        torch.zeros(2, 4, 1, 16, dtype=torch.int8), torch.tensor([0, 1]))
    gen = torch.Generator().manual_seed(0)
    q, (k, v), meta = make_step([(1, 5)], 1, 4, 2, 16, 4, torch.float32, "cpu", gen)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention_triton(q[:, :3], k, v, meta, 1.0)
    with pytest.raises(ValueError, match="must match q"):
        paged_attention_triton(q, k.half(), v.half(), meta, 1.0)
    with pytest.raises(ValueError, match="block_size"):
        paged_attention_triton(q, k.view(-1, 2, 2, 16), v.view(-1, 2, 2, 16), meta, 1.0)
    meta.block_tables = meta.block_tables.long()
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention_triton(q, k, v, meta, 1.0)


# ----------------------------------------------------------------------------- dispatch

def test_dispatch_follows_env(monkeypatch, gen):
    """CPU tensors: references unless JOBRUNNER_TRITON=1, then the Triton kernels (interpreted)."""
    import jobrunner.kernels.norm.norm_triton as tn
    calls = []
    real = tn.rms_norm_triton
    monkeypatch.setattr(tn, "rms_norm_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, w = torch.randn(3, 16, generator=gen), torch.randn(16, generator=gen)
    monkeypatch.delenv("JOBRUNNER_TRITON", raising=False)
    assert torch.equal(rms_norm(x, w, 1e-6)[0], rms_norm_ref(x, w, 1e-6)[0]) and not calls
    monkeypatch.setenv("JOBRUNNER_TRITON", "1")
    torch.testing.assert_close(rms_norm(x, w, 1e-6)[0], rms_norm_ref(x, w, 1e-6)[0])
    assert calls == [1]
    xs = torch.randn(3, 32, generator=gen)
    torch.testing.assert_close(silu_and_mul(xs), silu_and_mul_ref(xs))
    q, k = torch.randn(3, 2, 16, generator=gen), torch.randn(3, 1, 16, generator=gen)
    cos, sin = rotary_cos_sin(torch.arange(3), inverse_frequencies(16, 1e4, None), torch.float32)
    for got, want in zip(apply_rotary(q, k, cos, sin), apply_rotary_ref(q, k, cos, sin)):
        torch.testing.assert_close(got, want)


def test_dispatch_store_and_attention_int8(monkeypatch, gen):
    """The int8 cache through the dispatch functions, both paths."""
    T, Hk, D, BS = 5, 2, 16, 4
    k, v = torch.randn(T, Hk, D, generator=gen), torch.randn(T, Hk, D, generator=gen)
    q = torch.randn(T, 4, D, generator=gen)
    meta = AttentionMetadata.build(BS, 0, [T], [T], list(range(T)), [[0, 1]], "cpu")
    results = []
    for force in ("0", "1"):
        monkeypatch.setenv("JOBRUNNER_TRITON", force)
        kc, vc = torch.zeros(2, BS, Hk, D, dtype=torch.int8), torch.zeros(2, BS, Hk, D, dtype=torch.int8)
        ks, vs = torch.zeros(2, BS, Hk), torch.zeros(2, BS, Hk)
        store_kv_int8(k, v, kc, vc, ks, vs, meta.slot_mapping)
        results.append(paged_attention(q, kc, vc, meta, 0.25, k_scale=ks, v_scale=vs))
    torch.testing.assert_close(results[0], results[1], atol=1e-4, rtol=1e-4)
    monkeypatch.setenv("JOBRUNNER_TRITON", "1")
    kc, vc = torch.zeros(2, BS, Hk, D), torch.zeros(2, BS, Hk, D)
    store_kv(k, v, kc, vc, meta.slot_mapping)
    float_out = paged_attention(q, kc, vc, meta, 0.25)
    torch.testing.assert_close(results[1], float_out, atol=0.05, rtol=0.05)   # int8 is close to float


def test_import_kernels_without_triton():
    """The kernels' public names and every dispatch work where triton is missing: references only."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import os; os.environ['JOBRUNNER_TRITON'] = '1'\n"
        "import torch\nimport jobrunner.kernels.ops as kernels\n"
        "x = torch.randn(2, 8)\n"
        "out, _ = kernels.rms_norm(x, torch.ones(8), 1e-6)\n"
        "assert kernels.silu_and_mul(x).shape == (2, 4)\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


def _nvidia_toolchain() -> bool:
    base = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia")
    return os.path.exists(os.path.join(base, "bin", "ptxas"))


@pytest.mark.skipif(not _nvidia_toolchain(), reason="triton's bundled NVIDIA toolchain (ptxas) is missing")
@pytest.mark.skipif(HAS_CUDA, reason="on a GPU the cuda cases compile and run the kernels for real")
def test_kernels_compile_for_hopper():
    """The interpreter skips the compiler; this compiles every kernel for sm_90 (no GPU
    needed) so a compile error or a register spill in the GPU path shows up on CPU CI."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    res = subprocess.run([sys.executable, "-m", "benchmarks.kernel_bench", "--compile-only", "--check"],
                         capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "prefill llama8b bf16" in res.stdout


def test_kernel_bench_smoke(capsys):
    """benchmarks/kernel_bench.py runs end to end (toy shapes, interpreted on CPU)."""
    from benchmarks.kernel_bench import _print_timings, main, run_timings
    rows = run_timings(device="cuda" if HAS_CUDA else "cpu", tiny=True)
    _print_timings(rows)
    assert {r[0] for r in rows} >= {"rms_norm + residual", "silu_and_mul", "rotary (q and k)", "store_kv",
                                    "store_kv int8", "decode", "decode int8 cache", "prefill"}
    if not HAS_CUDA:
        assert main([]) == 0 and "no CUDA device" in capsys.readouterr().out


# ----------------------------------------------------------------------------- whole model

def test_tiny_model_greedy_matches_reference(monkeypatch):
    """A tiny random Llama, run step by step (prefill chunks, mixed steps, decodes) on the
    reference path and on the Triton path (interpreted on CPU): same greedy tokens."""
    from tests.tiny import step_tiny_llama
    plan = [[(0, 4)], [(0, 3), (1, 5)], [(0, 1), (1, 1)], [(0, 1), (1, 1)], [(0, 1), (1, 1)]]

    def run(force: str) -> list[list[int]]:
        monkeypatch.setenv("JOBRUNNER_TRITON", force)
        return step_tiny_llama(plan)

    assert run("1") == run("0")
