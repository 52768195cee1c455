"""The kernel switches the Gemma, Phi-3 and Granite families added, Triton against the torch reference
(interpreter on CPU, see tests/test_kernels.py): attention soft-capping and a per-layer sliding window
(decode with split-K, prefill chunks, int8 cache), GELU-tanh-and-multiply, partial rotary."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from jobrunner.kernels.activation.activation import gelu_tanh_and_mul, gelu_tanh_and_mul_ref  # noqa: E402
from jobrunner.kernels.attention.attention import paged_attention_ref  # noqa: E402
from jobrunner.kernels.rotary.rotary import apply_rotary, apply_rotary_ref  # noqa: E402
from jobrunner.kernels.activation.activation_triton import gelu_tanh_and_mul_triton  # noqa: E402

from tests.kernel_cases import cuda_only  # noqa: E402
from tests.test_kernels import (ATTN_TOL, CASES, TOL, attention_ref_fp32, attention_triton, make_step,  # noqa: E402
                                randn)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(4321)


def _ref(q, cache, meta, scale, **switches):
    """The float32 reference of attention_ref_fp32, with the layer's switches."""
    if len(cache) == 4:
        from jobrunner.kernels.attention.kv_int8 import paged_attention_int8_ref
        kq, vq, ks, vs = cache
        return paged_attention_int8_ref(q.float(), kq, vq, ks, vs, meta, scale, **switches)
    return paged_attention_ref(q.float(), cache[0].float(), cache[1].float(), meta, scale, **switches)


# Decodes (split-K over 3) then prefill chunks over cached prefixes, longer than the window of 11.
MIXED = [(1, 60), (1, 5), (9, 9), (14, 40)]


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("sliding", [True, False], ids=["sliding-layer", "global-layer"])
@pytest.mark.parametrize("softcap", [None, 0.8], ids=["no-cap", "cap"])
@pytest.mark.parametrize("int8", [False, True], ids=["float-cache", "int8-cache"])
def test_attention_switches(device, dtype, sliding, softcap, int8, gen):
    """One step's metadata (window 11) serves a sliding and a global layer; the cap binds: scale 0.5 on
    unit-normal q, k gives scores of about 2.8, capped at 0.8."""
    q, cache, meta = make_step(MIXED, 2, 4, 2, 32, 8, dtype, device, gen, window=11, int8=int8)
    out = attention_triton(q, cache, meta, 0.5, num_splits=3, sliding=sliding, softcap=softcap)
    ref = _ref(q, cache, meta, 0.5, sliding=sliding, softcap=softcap)
    torch.testing.assert_close(out.float(), ref, **ATTN_TOL[dtype])


@pytest.mark.gpu
@cuda_only[1]
@pytest.mark.parametrize("sliding", [True, False], ids=["sliding-layer", "global-layer"])
def test_attention_gemma2_shapes_cuda(sliding, gen):
    """Gemma 2 9B's attention on the GPU in bfloat16: head_dim 256 (the small-tile configs), GQA 2,
    window 4096 against contexts past it, scale 256^-1/2 and soft-cap 50; split-K decodes and prefill."""
    seqs = [(1, 5000), (1, 300), (1, 4097), (700, 700), (64, 4500)]
    q, cache, meta = make_step(seqs, 3, 16, 8, 256, 16, torch.bfloat16, "cuda", gen, window=4096)
    q = q * 4                                          # scores up to about 20: tanh(s / 50) * 50 bends them
    for splits in (1, 4):
        out = attention_triton(q, cache, meta, 256 ** -0.5, num_splits=splits, sliding=sliding, softcap=50.0)
        ref = _ref(q, cache, meta, 256 ** -0.5, sliding=sliding, softcap=50.0)
        torch.testing.assert_close(out.float(), ref, **ATTN_TOL[torch.bfloat16])


def test_switches_change_the_reference(gen):
    """The switches bind here: a global layer differs from a sliding one, a capped layer from an uncapped one,
    and sliding=True with the window is exactly the old whole-step window."""
    q, cache, meta = make_step(MIXED, 2, 4, 2, 32, 8, torch.float32, "cpu", gen, window=11)
    plain = attention_ref_fp32(q, cache, meta, 0.5)
    assert torch.equal(_ref(q, cache, meta, 0.5, sliding=True), plain)
    assert (_ref(q, cache, meta, 0.5, sliding=False) - plain).abs().max() > 0.1
    assert (_ref(q, cache, meta, 0.5, softcap=0.8) - plain).abs().max() > 0.1


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("shape", [(5, 2 * 96), (3, 2 * 1100), (1, 2 * 7)], ids=["small", "two-blocks", "odd"])
def test_gelu_tanh_and_mul(device, dtype, shape, gen):
    x = randn(*shape, dtype=dtype, device=device, gen=gen) * 3
    torch.testing.assert_close(gelu_tanh_and_mul_triton(x), gelu_tanh_and_mul_ref(x), **TOL[dtype])
    if device == "cpu":
        torch.testing.assert_close(gelu_tanh_and_mul(x), gelu_tanh_and_mul_ref(x))


@pytest.mark.parametrize("device,dtype", CASES)
def test_partial_rotary(device, dtype, gen, monkeypatch):
    """cos/sin over the first 24 of 32 dims: those turn (Triton when forced), the last 8 pass through."""
    T, D, rd = 7, 32, 24
    q = randn(T, 4, D, dtype=dtype, device=device, gen=gen)
    k = randn(T, 2, D, dtype=dtype, device=device, gen=gen)
    ang = randn(T, rd // 2, dtype=torch.float32, device=device, gen=gen)
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
    monkeypatch.setenv("JOBRUNNER_TRITON", "1")
    qo, ko = apply_rotary(q, k, cos, sin)
    qr, kr = apply_rotary_ref(q[..., :rd], k[..., :rd], cos, sin)
    torch.testing.assert_close(qo[..., :rd], qr, **TOL[dtype])
    torch.testing.assert_close(ko[..., :rd], kr, **TOL[dtype])
    assert torch.equal(qo[..., rd:], q[..., rd:]) and torch.equal(ko[..., rd:], k[..., rd:])

