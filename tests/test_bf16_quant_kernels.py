"""bfloat16 calls of up to BF16_KERNEL_ROWS rows on the float32 CPU int4 and int8 kernels (kernels/matmul/
quant_matmul.widened_bf16): widened exactly, multiplied in float32, rounded back once, so within a bfloat16
rounding of the exact product, where the old path dequantized a bfloat16 slice of the weight at every call.
More rows keep the slices, except where the int8 kernel runs its panel path (float32's GEMM rate: any rows).
A shipped GPTQ checkpoint in bfloat16 ran 0.4x its float32 speed before (RESULTS.md). The int4 kernel's bf16
form (whole panels of 32 columns) is tests/test_cpu_int4_bf16.py's; N here is off the panels."""
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


def _linear(kind: str):
    """An int4 (group 64) or int8 (per channel) linear with its CPU kernel, and (module, name) of the kernel call
    its bfloat16 rows reach."""
    lib = kernel_library(INT4 if kind == "int4" else INT8)
    if lib is None:
        pytest.skip(f"no C compiler for the {kind} kernel")
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(0)) * 0.1
    m = Int4Linear(*quantize_int4(w, 64), 64, K) if kind == "int4" else Int8Linear(*quantize_int8(w))
    # int8: without the bf16 dot form (tests/test_cpu_fp8_bf16.py's), which takes bfloat16 rows where it runs
    m.cpu_kernel = lib if kind == "int4" else type(lib)(lib.path, fp8_dot=False)
    return m, (qm, "int4_matmul_cpu") if kind == "int4" else (ql, "int8_matmul_cpu")


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("rows", [1, 5, qm.BF16_KERNEL_ROWS, qm.BF16_KERNEL_ROWS + 1, 40])
def test_bfloat16_calls(kind, monkeypatch, rows):
    linear, (module, name) = _linear(kind)
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda x, *a: calls.append(x.dtype) or real(x, *a))
    x = torch.randn(rows, K).bfloat16()
    with torch.inference_mode():
        y = linear(x)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, N)
    on_kernel = rows <= qm.BF16_KERNEL_ROWS or (kind == "int8" and linear.cpu_kernel.panel_path_for(K, linear.scales, linear.zeros))
    assert calls == ([torch.float32] if on_kernel else [])
    _check(y, x, linear.dequantize(torch.float32), on_kernel=on_kernel)
