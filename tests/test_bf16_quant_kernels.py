"""bfloat16 calls of up to BF16_KERNEL_ROWS rows on the float32 CPU int4 and int8 kernels (kernels/matmul/
quant_matmul.widened_bf16): widened exactly, multiplied in float32, rounded back once, so within a bfloat16
rounding of the exact product, where the old path dequantized a bfloat16 slice of the weight at every call.
More rows keep the slices. A shipped GPTQ checkpoint in bfloat16 ran 0.4x its float32 speed before (RESULTS.md)."""
from __future__ import annotations

import pytest
import torch

from jobrunner.engine.quant.formats import quantize_int4, quantize_int8
from jobrunner.engine.quant.linear import Int4Linear, Int8Linear
from jobrunner.engine.run.cpu_kernel_build import INT4, INT8, kernel_library
from jobrunner.kernels.matmul import quant_matmul as qm
import jobrunner.engine.quant.linear as ql

K, N = 192, 80


def _check(y, x, w, on_kernel: bool) -> None:
    """On the kernel, y within one bfloat16 rounding (plus float32 sums') of the exact product; on the slices (the
    old path, kept past BF16_KERNEL_ROWS: the weight or the output rounded to bfloat16 on the way) within a few."""
    exact = x.double() @ w.double().T
    magnitude = x.double().abs() @ w.double().abs().T
    eps = torch.finfo(torch.bfloat16).eps
    bound = eps * exact.abs() + 1e-5 * magnitude if on_kernel else 4 * eps * magnitude
    assert ((y.double() - exact).abs() <= bound).all()


@pytest.fixture
def int4_linear():
    lib = kernel_library(INT4)
    if lib is None:
        pytest.skip("no C compiler for the int4 kernel")
    m = Int4Linear(*quantize_int4(torch.randn(N, K, generator=torch.Generator().manual_seed(0)) * 0.1, 64), 64, K)
    m.cpu_kernel = lib
    return m


@pytest.fixture
def int8_linear():
    lib = kernel_library(INT8)
    if lib is None:
        pytest.skip("no C compiler for the int8 kernel")
    m = Int8Linear(*quantize_int8(torch.randn(N, K, generator=torch.Generator().manual_seed(1)) * 0.1))
    m.cpu_kernel = lib
    return m


@pytest.mark.parametrize("rows", [1, 5, qm.BF16_KERNEL_ROWS, qm.BF16_KERNEL_ROWS + 1, 40])
def test_int4_bfloat16_calls(int4_linear, monkeypatch, rows):
    calls = []
    real = qm.int4_matmul_cpu
    monkeypatch.setattr(qm, "int4_matmul_cpu", lambda x, *a: calls.append(x.dtype) or real(x, *a))
    x = torch.randn(rows, K).bfloat16()
    with torch.inference_mode():
        y = int4_linear(x)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, N)
    assert calls == ([torch.float32] if rows <= qm.BF16_KERNEL_ROWS else [])
    _check(y, x, int4_linear.dequantize(torch.float32), on_kernel=rows <= qm.BF16_KERNEL_ROWS)


@pytest.mark.parametrize("rows", [1, qm.BF16_KERNEL_ROWS, qm.BF16_KERNEL_ROWS + 1])
def test_int8_bfloat16_calls(int8_linear, monkeypatch, rows):
    calls = []
    real = ql.int8_matmul_cpu
    monkeypatch.setattr(ql, "int8_matmul_cpu", lambda x, *a: calls.append(x.dtype) or real(x, *a))
    x = torch.randn(rows, K).bfloat16()
    with torch.inference_mode():
        y = int8_linear(x)
    assert y.dtype == torch.bfloat16 and calls == ([torch.float32] if rows <= qm.BF16_KERNEL_ROWS else [])
    _check(y, x, int8_linear.dequantize(torch.float32), on_kernel=rows <= qm.BF16_KERNEL_ROWS)
