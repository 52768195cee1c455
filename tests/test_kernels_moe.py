"""The fused-MoE Triton kernel against its torch reference (kernels/moe/moe.py), in Triton's interpreter
on CPU (float16, float32) and compiled on CUDA when there is one; see tests/test_kernels.py."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from jobrunner.kernels.moe.moe import fused_moe, fused_moe_ref, route_topk  # noqa: E402
from jobrunner.kernels.moe.moe_triton import align_to_blocks, fused_moe_triton  # noqa: E402

from tests.kernel_cases import cuda_only, device_dtype_cases  # noqa: E402

# The kernel rounds once (float32 accumulators, silu-and-mul and the routing weight applied before
# the store); the reference rounds each projection to x.dtype, as HF does.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.float16: dict(atol=1e-2, rtol=1e-2),
       torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _problem(t, e, k, h, inter, dtype, device, seed=0, only_experts=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, h, 2 * inter, generator=g) * h ** -0.5           # input-major, as kernels/moe/moe.py
    w2 = torch.randn(e, inter, h, generator=g) * inter ** -0.5
    logits = torch.randn(t, e, generator=g)
    if only_experts is not None:           # the other experts get no token
        logits[:, [i for i in range(e) if i not in only_experts]] = -1e4
    weights, ids = route_topk(logits, k, renormalize=True)
    return [v.to(device) for v in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)]


@pytest.mark.parametrize("device,dtype", device_dtype_cases())
@pytest.mark.parametrize("t,e,k,h,inter", [
    (1, 8, 2, 64, 32),          # one decode token
    (7, 4, 1, 48, 40),          # top-1, odd token count, sizes not multiples of the tiles
    (33, 16, 8, 32, 24),        # top-8, 264 slots
    (5, 64, 2, 32, 16),         # most of 64 experts get no token
])
def test_fused_moe_matches_reference(device, dtype, t, e, k, h, inter):
    x, w13, w2, weights, ids = _problem(t, e, k, h, inter, dtype, device)
    out = fused_moe_triton(x, w13, w2, weights, ids)
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)
    assert out.dtype == dtype and out.shape == (t, h)
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])


@pytest.mark.parametrize("device,dtype", device_dtype_cases(cuda_fp32=False))
def test_fused_moe_with_empty_experts_between_used_ones(device, dtype):
    """Only experts 1 and 5 of 8 get tokens: blocks of experts 0, 2-4, 6, 7 do not exist."""
    x, w13, w2, weights, ids = _problem(9, 8, 2, 32, 32, dtype, device, only_experts=(1, 5))
    assert set(ids.unique().tolist()) == {1, 5}
    torch.testing.assert_close(fused_moe_triton(x, w13, w2, weights, ids).float(),
                               fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids), **TOL[dtype])


@pytest.mark.parametrize("device,dtype", device_dtype_cases(cuda_fp32=False))
@pytest.mark.parametrize("qdtype", [torch.int8, pytest.param(torch.float8_e4m3fn, marks=cuda_only)])
def test_fused_moe_quantized_weights(device, dtype, qdtype):
    """int8 or float8 experts with a scale per output channel, as engine/quant stores them."""
    x, w13, w2, weights, ids = _problem(11, 8, 2, 64, 32, torch.float32, device)
    qmax = 127 if qdtype == torch.int8 else 448.0

    def quantize(w):
        scale = w.abs().amax(1) / qmax                                       # [E, N]
        q = w / scale[:, None]
        return (q.round() if qdtype == torch.int8 else q).to(qdtype), scale

    (q13, s13), (q2, s2) = quantize(w13), quantize(w2)
    out = fused_moe_triton(x.to(dtype), q13, q2, weights, ids, s13, s2)
    ref = fused_moe_ref(x.to(dtype).float(), q13, q2, weights, ids, s13, s2)
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])


def test_align_to_blocks_groups_slots_by_expert():
    ids = torch.tensor([[0, 2], [2, 0], [2, 3]])            # slots 0..5
    sorted_slots, block_expert = align_to_blocks(ids, num_experts=4, block_m=4)
    pad = 6
    assert sorted_slots.tolist()[:12] == [0, 3, pad, pad, 1, 2, 4, pad, 5, pad, pad, pad]
    assert block_expert.tolist() == [0, 2, 3, -1, -1, -1]   # expert 1: no block; 6 blocks, an upper bound


def test_dispatch_takes_the_reference_on_cpu():
    x, w13, w2, weights, ids = _problem(3, 4, 2, 16, 8, torch.float32, "cpu")
    assert torch.equal(fused_moe(x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids))


def test_launcher_checks_shapes():
    x, w13, w2, weights, ids = _problem(3, 4, 2, 16, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="w2: expected"):
        fused_moe_triton(x, w13, w2[:, :4].contiguous(), weights, ids)
    with pytest.raises(ValueError, match="float weights must be x.dtype"):
        fused_moe_triton(x.half(), w13, w2, weights, ids)


@pytest.mark.parametrize("device,dtype", device_dtype_cases(cuda_fp32=False))
def test_foreign_slots_contribute_nothing(device, dtype):
    """Expert parallelism: a rank holding experts 4..7 of 8 sees ids 0..3 as foreign (id 4 here); the
    result is the same as the whole model's with the foreign experts' weights zeroed."""
    x, w13, w2, weights, ids = _problem(11, 8, 2, 32, 24, dtype, device, seed=3)
    local = ids - 4
    local = torch.where((local >= 0) & (local < 4), local, 4)
    zeroed = w2.clone()
    zeroed[:4] = 0
    want = fused_moe_ref(x.float(), w13.float(), zeroed.float(), weights, ids)
    ref = fused_moe_ref(x.float(), w13[4:].float(), w2[4:].float(), weights, local, foreign=True)
    torch.testing.assert_close(ref, want, atol=1e-6, rtol=1e-6)
    out = fused_moe_triton(x, w13[4:].contiguous(), w2[4:].contiguous(), weights, local, foreign=True)
    torch.testing.assert_close(out.float(), want, **TOL[dtype])
