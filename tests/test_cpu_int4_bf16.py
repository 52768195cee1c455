"""The CPU int4 matmul's bf16 form (kernels/matmul/cpu_int4_bf16.c, cpu_int4.int4_bf16_matmul_cpu): bfloat16
activations times int4 nibbles in AVX512_BF16 dot products. Against the exact product in float64 (the
activations' bfloat16 values times the dequantized weight) within a float32 summation's bound; each row's result
the same bits alone, among other rows and at any thread count; float16 scales read at any offset; int4_matmul's
dispatch (which calls take the form); greedy tokens of a bfloat16 int4 model the same with the form as with the
bfloat16 slices of the old path. The form's tests skip on a CPU (or compiler) without AVX512_BF16.
"""
from __future__ import annotations

import pytest
import torch

from jobrunner.engine.api.request import Request, SamplingParams
from jobrunner.engine.config.engine_config import EngineConfig
from jobrunner.engine.core.engine import Engine
from jobrunner.engine.quant.linear import Int4Linear
from jobrunner.kernels.matmul import cpu_int4 as ci
from jobrunner.kernels.matmul import quant_matmul as qm
from test_cpu_int4 import at_odd_offset, libs, make  # noqa: F401 - libs: the session's builds

SHAPES = ((32, 100), (64, 576), (96, 200), (32, 33), (128, 1536))    # (N, K): whole panels; K off the 128s


@pytest.fixture(scope="module")
def lib(libs):  # noqa: F811
    native = libs["native"]
    if not native.bf16:
        pytest.skip("the native build has no bf16 int4 form (no AVX512_BF16 here, or the compiler did not enable it)")
    return native


def exact(x, packed, s, z, group, bias=None):
    """x's bfloat16 values times the dequantized weight in float64, and the magnitude a float32 sum of the form's
    terms is bounded by: |x| times |q s| + |z| (its chain: k products and two scalings a group)."""
    k = x.shape[-1]
    q = qm.unpack_int4(packed, group).double()[:, :k]
    zero = -8 * s.double() if z is None else z.double()
    sg, zg = (t.repeat_interleave(group, dim=1)[:, :k] for t in (s.double(), zero))
    w = q * sg + zg
    want = x.double() @ w.T + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ (q.abs() * sg.abs() + zg.abs()).T + (0 if bias is None else bias.double().abs())
    n = k + 2 * (k // group + 1) + 1
    u = torch.finfo(torch.float32).eps / 2
    return want, n * u / (1 - n * u) * magnitude


def check(got, x, packed, s, z, group, bias=None):
    """got (float32 from the kernel) within the bound of the exact product."""
    want, bound = exact(x, packed, s, z, group, bias)
    err = (got.double() - want).abs()
    assert (err <= bound + 1e-30).all(), (err / bound.clamp_min(1e-300)).max()


def raw(lib, x, packed, s, z, group, bias=None, threads=None, dtype=torch.float32):
    """The kernel's output in float32 (its sums before rounding), or bfloat16 (what int4_bf16_matmul_cpu asks)."""
    n, kp = packed.shape[0], packed.shape[1] * 2
    out = torch.empty(x.shape[0], n, dtype=dtype)
    b = None if bias is None else bias.float().contiguous()
    rc = lib.bf16_function(x.data_ptr(), x.stride(0), packed.data_ptr(), s.data_ptr(),
                           None if z is None else z.data_ptr(), int(s.dtype == torch.float32),
                           None if b is None else b.data_ptr(), out.data_ptr(), int(dtype == torch.bfloat16),
                           x.shape[0], n, x.shape[1], kp, group, threads or torch.get_num_threads())
    assert rc == 0, rc
    return out


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 4, 7, 16, 130])        # 130: over one slab of 128 rows
def test_form_is_the_exact_product_within_float32_rounding(lib, group, m):
    for n, k in SHAPES:
        for scale_dtype in ci.SCALE_DTYPES:
            packed, s, z = make(n, k, group, scale_dtype, seed=n + k)
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
            b = torch.randn(n)
            check(raw(lib, x, packed, s, z, group, b), x, packed, s, z, group, b)
            check(raw(lib, x, packed, s, None, group), x, packed, s, None, group)     # symmetric: (q - 8) s


def test_launcher_rounds_to_bfloat16_and_keeps_shapes(lib):
    packed, s, z = make(64, 200, 64, torch.float32)
    x = torch.randn(2, 3, 200).bfloat16()
    got = ci.int4_bf16_matmul_cpu(x, packed, s, z, 64, None, lib)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 3, 64)
    assert torch.equal(got, raw(lib, x.reshape(6, 200), packed, s, z, 64).bfloat16().view(2, 3, 64))


@pytest.mark.parametrize("m, k", [(5, 576), (140, 2304)])      # 140 x 2304: k in chunks, sums kept between
def test_bfloat16_out_is_the_float32_sums_rounded_to_nearest_even(lib, m, k):
    packed, s, z = make(96, k, 32, torch.float16, seed=7)
    x = torch.randn(m, k).bfloat16()
    b = torch.randn(96)
    for zeros in (z, None):
        assert torch.equal(raw(lib, x, packed, s, zeros, 32, b, dtype=torch.bfloat16),
                           raw(lib, x, packed, s, zeros, 32, b).bfloat16())


def test_a_rows_result_does_not_depend_on_the_rows_beside_it_or_the_threads(lib):
    packed, s, z = make(96, 576, 32, torch.float16, seed=2)
    x = torch.randn(150, 576).bfloat16()
    full = raw(lib, x, packed, s, z, 32)
    for rows in (1, 5, 17, 64):
        assert torch.equal(raw(lib, x[:rows], packed, s, z, 32), full[:rows]), rows
    assert torch.equal(raw(lib, x, packed, s, z, 32, threads=1), full)
    assert torch.equal(raw(lib, x[40:41], packed, s, z, 32), full[40:41])


def test_float16_scales_at_an_odd_offset(lib):
    packed, s, z = make(64, 256, 32, torch.float16, seed=5)
    x = torch.randn(9, 256).bfloat16()
    assert torch.equal(raw(lib, x, packed, at_odd_offset(s), at_odd_offset(z), 32), raw(lib, x, packed, s, z, 32))


def test_refusals(lib, libs):  # noqa: F811
    packed, s, z = make(64, 96, 32)
    with pytest.raises(TypeError, match="bfloat16"):
        ci.int4_bf16_matmul_cpu(torch.randn(4, 96), packed, s, z, 32, None, lib)
    odd, so, zo = make(48, 96, 32)                       # 48 columns: not whole panels, the kernel says -3
    with pytest.raises(ValueError, match=r"refused its arguments \(-3\)"):
        ci.int4_bf16_matmul_cpu(torch.randn(4, 96).bfloat16(), odd, so, zo, 32, None, lib)
    assert not libs["portable"].bf16 and not libs["native-portable-loop"].bf16
    assert not ci.Int4Library(lib.path, bf16_form=False).bf16


def test_dispatch_takes_the_form_for_bfloat16_calls_it_covers(lib, monkeypatch):
    calls = []
    real = qm.int4_bf16_matmul_cpu
    monkeypatch.setattr(qm, "int4_bf16_matmul_cpu", lambda *a: calls.append(tuple(a[0].shape)) or real(*a))
    cases = ((64, 32, ci.BF16_FORM_MIN_ROWS, True), (64, 32, 300, True), (64, 128, 16, True),
             (64, 32, ci.BF16_FORM_MIN_ROWS - 1, False),      # too few rows: widened to float32
             (48, 32, 16, False),                             # not whole panels
             (64, 48, 16, False))                             # a group the form does not take
    for n, group, rows, taken in cases:
        packed, s, z = make(n, 192, group)
        x = torch.randn(rows, 192).bfloat16()
        got = qm.int4_matmul(x, packed, s, z, group, None, lib)
        assert got.dtype == torch.bfloat16
        want, _ = exact(x, packed, s, z, group)
        assert (got.double() - want).abs().max() <= 2 ** -7 * want.abs().max()      # bfloat16 rounding
        assert calls.pop() == (rows, 192) if taken else not calls
    off = ci.Int4Library(lib.path, bf16_form=False)
    qm.int4_matmul(torch.randn(8, 192).bfloat16(), *make(64, 192, 32), 32, None, off)
    assert not calls


def _greedy(model_dir, lib_form: bool, monkeypatch):
    monkeypatch.setenv("JOBRUNNER_CPU_INT4", "auto")
    calls = []
    real = qm.int4_bf16_matmul_cpu
    monkeypatch.setattr(qm, "int4_bf16_matmul_cpu", lambda *a: calls.append(a[0].shape) or real(*a))
    eng = Engine(EngineConfig(model=str(model_dir), dtype="bfloat16", quantization="int4",
                              kv_cache_memory=4 * 2**20))
    linears = [m for m in eng.rt.model.modules() if isinstance(m, Int4Linear)]
    assert linears and all(m.cpu_kernel is not None for m in linears)
    if not lib_form:
        off = ci.Int4Library(linears[0].cpu_kernel.path, bf16_form=False)
        for m in linears:
            m.cpu_kernel = off
    reqs = [Request(str(i), p, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2))
            for i, p in enumerate(([5, 6, 7, 8], [11, 200, 3, 3, 64, 90, 17], [9] * 20, [1, 2], [4] * 9,
                                   [3, 1, 4, 1, 5], [100] * 3, [7, 7], list(range(20, 31))))]
    outs = {o.id: o.completions[0] for o in eng.generate(reqs)}
    assert bool(calls) == lib_form
    return [outs[str(i)] for i in range(len(reqs))]


def assert_same_greedy_up_to_ties(a, b, tie=0.05):
    """Rows of greedy completions with top-2 logprobs: the same tokens, or the same up to a step where each
    run's token is within `tie` of the other's in both runs' logprobs (bfloat16 logits tie exactly at times:
    the two forms round differently, and a tie breaks either way); after it the rows are not compared."""
    for x, y in zip(a, b):
        if x.token_ids == y.token_ids:
            continue
        j = next(i for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids)) if s != t)
        for own, other in ((x, y), (y, x)):
            top = dict(own.logprobs[j].top)
            assert other.token_ids[j] in top, (j, own.logprobs[j], other.token_ids[j])
            assert top[own.token_ids[j]] - top[other.token_ids[j]] <= tie, (j, own.logprobs[j])


def test_engine_bfloat16_int4_greedy_same_through_the_form(tiny_hf_model_dir, monkeypatch, lib):
    """A bfloat16 int4 model: the form (prefill and 9-row decode) against the widened float32 kernel and the
    bfloat16 slices it replaces: the same greedy tokens, up to a tie."""
    path = tiny_hf_model_dir("llama")
    form, widened = _greedy(path, True, monkeypatch), _greedy(path, False, monkeypatch)
    assert_same_greedy_up_to_ties(form, widened)
    assert sum(x.token_ids == y.token_ids for x, y in zip(form, widened)) >= len(form) - 2


def test_the_form_without_vbmi(lib, tmp_path):
    """The nibble placement for CPUs with AVX512_BF16 but no VBMI (Cooper Lake: two shifts and a blend, not
    vpmultishiftqb), built here with -mno-avx512vbmi: the same exact product, the same bits as the VBMI build."""
    from jobrunner.engine.run import cpu_decode as cd
    path = tmp_path / "int4-no-vbmi.so"
    cd.build_library(path, lambda cc, o: ci.int4_compile_command(cc, o, "native") + ["-mno-avx512vbmi"])
    plain = ci.Int4Library(path)
    assert plain.bf16
    for n, k, group in ((64, 576, 32), (96, 200, 64), (32, 300, 128)):
        packed, s, z = make(n, k, group, torch.float16, seed=n + k)
        x = torch.randn(19, k).bfloat16()
        for zeros in (z, None):
            got = raw(plain, x, packed, s, zeros, group)
            check(got, x, packed, s, zeros, group)
            assert torch.equal(got, raw(lib, x, packed, s, zeros, group))
