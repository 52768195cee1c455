"""The float32 panel kernel (kernels/matmul/cpu_f32.c, PackedLinear's panel form): within the float32 bound of
the exact product (cpu_linear.packed_error) over odd shapes, strides, chunks of k and strips of rows; each row's
bits the same alone, among other rows and at any thread count; the engine packing its float32 linears into
panels (bfloat16 ones stay on oneDNN) and the switch off. Greedy parity with transformers
(test_cpu_linear.py) and the batch-invariant mode (test_determinism.py) run on this form wherever it is built.
The kernel's tests skip on a CPU without AVX-512."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from jobrunner.engine.run import cpu_kernel_build as cb
from jobrunner.kernels.matmul import cpu_f32 as cf
from jobrunner.kernels.ops import PackedLinear, pack_linear, packed_error, packing_available
from tests.cpu_builds import build_variants
from tests.tiny import engine_for, hf_model


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, cf.F32Library]:
    return build_variants(cb.F32, tmp_path_factory)


@pytest.fixture(scope="module")
def lib(builds) -> cf.F32Library:
    if builds["native"].isa == "none":
        pytest.skip("no AVX-512 here: the panel kernel is not built in")
    return builds["native"]


def run(lib, x, w, bias=None):
    panels = cf.pack_panels(w)
    return cf.f32_matmul_cpu(x, panels, cf.pad_bias(bias, panels), w.shape[0], lib)


# (N, K): whole and part panels, K off every block size, the default model's and a 1B model's widths
SHAPES = ((32, 64), (77, 100), (960, 576), (576, 1536), (33, 2048), (200, 2100), (40, 8))


@pytest.mark.parametrize("rows", [1, 2, 5, 13, 16, 64, 255, 300])
@pytest.mark.parametrize("shape", SHAPES)
def test_within_the_float32_bound_of_the_exact_product(lib, shape, rows):
    n, k = shape
    g = torch.Generator().manual_seed(n * 7 + rows)
    w, x, b = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    out = run(lib, x, w, b)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    assert packed_error(out, x, w, b) <= 1
    assert packed_error(run(lib, x, w), x, w, None) <= 1


def test_a_wrong_layout_misses_the_bound(lib):
    """The check above can fail: panels packed from the weight's columns read one apart are refused by far."""
    w, x = torch.randn(96, 300), torch.randn(7, 300)
    panels = cf.pack_panels(w.roll(1, dims=1))
    assert packed_error(cf.f32_matmul_cpu(x, panels, None, 96, lib), x, w, None) > 100


@pytest.mark.parametrize("k", [576, 2048, 2100])       # rows apart in L1 sets, crowded (copied), and chunked
def test_a_row_has_the_same_bits_alone_among_others_and_at_any_thread_count(lib, k):
    g = torch.Generator().manual_seed(k)
    w, x = torch.randn(200, k, generator=g), torch.randn(300, k, generator=g)
    panels = cf.pack_panels(w)
    want = cf.f32_matmul_cpu(x, panels, None, 200, lib)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            for m in (1, 2, 12, 13, 17, 256, 300):
                assert torch.equal(cf.f32_matmul_cpu(x[:m], panels, None, 200, lib), want[:m]), (t, m)
            assert torch.equal(cf.f32_matmul_cpu(x[150:151], panels, None, 200, lib), want[150:151])
    finally:
        torch.set_num_threads(threads)


def test_rows_at_any_stride_and_leading_shape(lib):
    w = torch.randn(70, 48)
    panels = cf.pack_panels(w)
    x = torch.randn(3, 9, 64)[:, 2:7, 5:53]                  # 3-D, rows 64 apart, columns offset
    out = cf.f32_matmul_cpu(x, panels, None, 70, lib)
    assert out.shape == (3, 5, 70)
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert cf.f32_matmul_cpu(torch.randn(0, 48), panels, None, 70, lib).shape == (0, 70)


def test_wrong_arguments_are_refused(lib):
    panels = cf.pack_panels(torch.randn(64, 32))
    with pytest.raises(TypeError, match="float32"):
        cf.f32_matmul_cpu(torch.randn(2, 32, dtype=torch.float64), panels, None, 64, lib)
    with pytest.raises(ValueError, match="K equal"):
        cf.f32_matmul_cpu(torch.randn(2, 31), panels, None, 64, lib)
    with pytest.raises(ValueError, match="covering n"):
        cf.f32_matmul_cpu(torch.randn(2, 32), panels, None, 65, lib)
    with pytest.raises(ValueError, match="pad_bias"):
        cf.f32_matmul_cpu(torch.randn(2, 32), panels, torch.zeros(63), 64, lib)


def test_the_portable_build_has_no_kernel(builds):
    assert builds["portable"].isa == "none"


@pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN")
def test_pack_linear_takes_the_panel_form_for_float32_only(lib):
    lin = nn.Linear(100, 77)
    packed = pack_linear(lin, panel_kernel=lib)
    assert packed.panel_kernel is lib and packed.row_invariant and "panels" in repr(packed)
    x = torch.randn(5, 100)
    with torch.inference_mode():
        assert packed_error(packed(x), x, lin.weight, lin.bias) <= 1
    half = pack_linear(nn.Linear(64, 64).to(torch.bfloat16), panel_kernel=lib)
    assert half.panel_kernel is None and half.weight.is_mkldnn


@pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN")
def test_the_engine_runs_float32_linears_on_panels(lib):
    """Every float32 linear, the tied head's copy too; test_cpu_linear.py's greedy parity with transformers and
    test_determinism.py's invariant mode run on this form wherever the kernel is."""
    eng = engine_for(hf_model("qwen2"))                      # tied embeddings: the head gets its own panels
    packed = [m for m in eng.rt.model.modules() if isinstance(m, PackedLinear)]
    assert packed and all(m.panel_kernel is not None for m in packed)
    assert not any(type(m) is nn.Linear for m in eng.rt.model.modules())


@pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN")
def test_switch_off_keeps_onednn(lib, monkeypatch):
    monkeypatch.setenv("JOBRUNNER_CPU_F32", "off")
    eng = engine_for(hf_model("llama"))
    packed = [m for m in eng.rt.model.modules() if isinstance(m, PackedLinear)]
    assert packed and all(m.panel_kernel is None for m in packed)
