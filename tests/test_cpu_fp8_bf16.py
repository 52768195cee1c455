"""The CPU fp8 matmul's bf16 form (kernels/matmul/cpu_fp8_dot.c, cpu_int8.fp8_dot_cpu): e4m3 activations times
e4m3 weights in AVX512_BF16 dot products, for the schemes that quantize activations to e4m3 (FP8_DYNAMIC per token,
FP8_BLOCK per token and group, static). Against the torch reference (shipped_quant.fp8_weight_matmul_ref: the
fake-quantized activations times the dequantized weight) within cpu_int8.RTOL/ATOL; every e4m3 byte widened to
bfloat16 exactly; the activations' e4m3 values and scales bit for bit fake_quantize_fp8's; fp8_weight_matmul's
dispatch (which calls take the form); greedy tokens of llmcompressor fp8 checkpoints identical through the form
and through the reference path; bfloat16 rows as they are (weight-only fp8 under --dtype bfloat16) and
symmetric int8 weights through the same form. The form's tests skip on a CPU (or compiler) without AVX512_BF16.
"""
from __future__ import annotations

import pytest
import torch

from jobrunner.engine.api.request import Request, SamplingParams
from jobrunner.engine.config.engine_config import EngineConfig
from jobrunner.engine.core.engine import Engine
from jobrunner.engine.shipped.shipped_linear import Fp8WeightLinear
from jobrunner.kernels.matmul import cpu_int8 as c8
from jobrunner.kernels.matmul import shipped_quant as sq
from jobrunner.engine.quant import linear as ql
from test_cpu_fp8 import CASES, close, fp8_weight
from test_cpu_int8 import libs  # noqa: F401 - the session's builds
from test_cpu_int8 import make as make_int8


def _cpu_flags() -> str:
    try:
        return next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
    except OSError:
        return ""


@pytest.fixture(scope="module")
def lib(libs):  # noqa: F811
    native = libs["native"]
    if not native.fp8_dot:
        pytest.skip("the native build has no bf16 fp8 form: "
                    + ("the compiler did not enable AVX512_BF16" if "avx512_bf16" in _cpu_flags()
                       else "this CPU has no avx512_bf16"))
    return native


def test_builds_that_have_no_bf16_form_say_so(libs):  # noqa: F811
    """The portable build and portable=True never take the form; fp8_dot_cpu refuses where it is absent."""
    assert not libs["portable"].fp8_dot and not libs["native-portable-loop"].fp8_dot
    off = c8.Int8Library(libs["native"].path, fp8_dot=False)
    assert not off.fp8_dot
    q, s = fp8_weight(8, 32, None)
    for lib_ in (libs["portable"], off):
        with pytest.raises(RuntimeError, match="no bf16 form"):
            c8.fp8_dot_cpu(torch.randn(2, 32), q, s, None, None, None, None, lib_)


def test_every_byte_widens_to_its_bfloat16_exactly(lib):
    """All 256 bytes (signed zeros, the 7 subnormals, 448) through the kernel's own widening, against torch's
    exact float8_e4m3fn -> bfloat16 cast; the two NaN bytes read as +-480 (no checkpoint holds them); lengths
    off the 32 lanes."""
    b = torch.arange(256, dtype=torch.uint8)
    want = b.view(torch.float8_e4m3fn).to(torch.bfloat16)
    got = c8.fp8_dot_widen_cpu(b, lib)
    nan = torch.isnan(want)
    assert nan.sum() == 2 and torch.equal(got[nan].float(), torch.tensor([480.0, -480.0]))
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
    for n in (1, 31, 33, 77):
        part = b.roll(n)[:n].contiguous()
        ok = ~torch.isnan(part.view(torch.float8_e4m3fn).float())
        assert torch.equal(c8.fp8_dot_widen_cpu(part, lib)[ok], part.view(torch.float8_e4m3fn).to(torch.bfloat16)[ok])


def test_activations_quantized_bit_for_bit(lib):
    """e4m3 values (as bfloat16) and scales whose product is fake_quantize_fp8's, bit for bit: per token, per
    group, static; magnitudes 1e-12..1e3, zero rows, every midpoint of the e4m3 grid (ties to even), values past
    448; and the values are e4m3 values (they survive a round trip through float8_e4m3fn)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 256, generator=g) * torch.logspace(-12, 3, 256)
    x[3], x[5, :128], x[7] = 0.0, 0.0, 1e-30
    for static, group in ((None, None), (None, 64), (None, 128), (torch.tensor([0.37]), None),
                          (torch.tensor([1e-3]), None), (torch.tensor([0.5]), 64)):
        xq, xs = c8.fp8_dot_quantize_cpu(x, static, group, lib)
        assert xs.shape == (37, 1 if static is not None or group is None else 256 // group)
        assert torch.equal(xq, xq.to(torch.float8_e4m3fn).to(torch.bfloat16))
        xg = xq.float().unflatten(1, (xs.shape[1], -1)) * xs[..., None]
        assert torch.equal(xg.flatten(1), sq.fake_quantize_fp8(x, static, group))
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    ties = torch.cat([mids, -mids, grid, torch.tensor([500.0, -1000.0, 464.0, -464.0, 480.0])])[None]
    xq, xs = c8.fp8_dot_quantize_cpu(ties, torch.tensor([1.0]), None, lib)
    assert torch.equal(xq.float() * xs, sq.fake_quantize_fp8(ties, torch.tensor([1.0])))


def _acts(k: int, block):
    """(act, static scale, act group) the reference takes at this K: per token, static, and groups of 32 (and of
    the block width) where they divide K."""
    out = [("dynamic", None, None), ("static", torch.tensor([0.02]), None)]
    out += [("dynamic", None, g) for g in {32, block[1] if block else 32} if k % g == 0]
    return out


@pytest.mark.parametrize("m", [1, 3, 16, 64])
def test_form_matches_the_reference(lib, m):
    """Odd N (off the 4-column tiles) and K (off the 32 lanes), per channel and block scales whose last blocks
    are short, block widths off the lanes, activation groups that cut the weight's blocks: within the
    documented tolerance of fp8_weight_matmul_ref with the same act."""
    for n, k, block in CASES:
        q, s = fp8_weight(n, k, block, seed=n + k)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)) * 3
        bias = torch.randn(n) if n % 2 else None
        for act, static, group in _acts(k, block):
            got = c8.fp8_dot_cpu(x, q, s, block, bias, static, group, lib)
            close(got, sq.fp8_weight_matmul_ref(x, q, s, block, bias, act, static, group))


def test_strided_batched_rows_and_refusals(lib):
    q, s = fp8_weight(40, 96, (16, 32))
    wide = torch.randn(2, 3, 150)
    x = wide[..., 10:106]                                   # rows 150 apart: the kernel reads the row stride
    got = c8.fp8_dot_cpu(x, q, s, (16, 32), None, None, 32, lib)
    assert got.shape == (2, 3, 40)
    close(got, sq.fp8_weight_matmul_ref(x.contiguous(), q, s, (16, 32), None, "dynamic", None, 32))
    with pytest.raises(ValueError, match="do not divide"):
        c8.fp8_dot_cpu(torch.randn(2, 96), q, s, (16, 32), None, None, 64, lib)
    with pytest.raises(TypeError, match="float32"):
        c8.fp8_dot_cpu(torch.randn(2, 96, dtype=torch.bfloat16), q, s, (16, 32), None, None, None, lib)
    with pytest.raises(ValueError, match="block grid"):
        c8.fp8_dot_cpu(torch.randn(2, 96), q, s, (32, 32), None, None, None, lib)


def test_fp8_weight_matmul_takes_the_form_for_e4m3_activations(lib, monkeypatch):
    """float32 rows whose scheme quantizes them to e4m3, any count (past FP8_KERNEL_ROWS too): the form.
    Weight-only float32 rows (act None: the activations are not e4m3), a library told fp8_dot=False, and
    shipped_quant.FP8_DOT off: the float32 form or the slices, as before (bfloat16 rows:
    test_bfloat16_rows_take_the_form_as_they_are)."""
    calls = []
    real = sq.fp8_dot_cpu
    monkeypatch.setattr(sq, "fp8_dot_cpu", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    q, s = fp8_weight(48, 64, None)
    static = torch.tensor([0.05])
    taken = [(1, "dynamic", None), (16, "dynamic", 32), (16, "static", None), (c8.FP8_KERNEL_ROWS + 3, "dynamic", None)]
    for rows, act, group in taken:
        x = torch.randn(rows, 64)
        close(sq.fp8_weight_matmul(x, q, s, None, None, act, static, group, lib),
              sq.fp8_weight_matmul_ref(x, q, s, None, None, act, static, group))
    assert calls == [r for r, *_ in taken]
    off = c8.Int8Library(lib.path, fp8_dot=False)
    for x, act, lib_ in ((torch.randn(16, 64), None, lib), (torch.randn(16, 64), "dynamic", off)):
        sq.fp8_weight_matmul(x, q, s, None, None, act, None, None, lib_)
    monkeypatch.setattr(sq, "FP8_DOT", False)
    sq.fp8_weight_matmul(torch.randn(16, 64), q, s, None, None, "dynamic", None, None, lib)
    assert len(calls) == len(taken)


@pytest.mark.parametrize("m", [1, 5, 16, 300])
def test_bfloat16_rows_take_the_form_as_they_are(lib, monkeypatch, m):
    """Bfloat16 rows of weight-only fp8 (under --dtype bfloat16) times the e4m3 weight, exact products summed in
    float32: the float32 reference over the same bfloat16 values within the kernel's tolerance plus the output's
    one bfloat16 rounding; fp8_weight_matmul takes that form for them at any row count, and not where the library
    has none. Bfloat16 rows of an e4m3-activation scheme are widened (exactly) to the float32 entry."""
    calls, dot = [], []
    real, real_dot = sq.fp8_dot_bf16_cpu, sq.fp8_dot_cpu
    monkeypatch.setattr(sq, "fp8_dot_bf16_cpu", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    monkeypatch.setattr(sq, "fp8_dot_cpu", lambda *a: dot.append(a[0].dtype) or real_dot(*a))
    for n, k, block in CASES:
        q, s = fp8_weight(n, k, block, seed=n + k)
        x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)) * 3).bfloat16()
        bias = torch.randn(n) if n % 2 else None
        for act in (None, "dynamic"):
            got = sq.fp8_weight_matmul(x, q, s, block, bias, act, None, None, lib)
            ref = sq.fp8_weight_matmul_ref(x.float(), q, s, block, bias, act)
            assert got.dtype == torch.bfloat16
            scale = ref.abs().max().clamp(min=1.0)
            assert ((got.float() - ref).abs() <= c8.ATOL * scale + c8.RTOL * ref.abs().max() + 2 ** -8 * ref.abs()).all()
    assert calls == [m] * len(CASES) and dot == [torch.float32] * len(CASES)
    sq.fp8_weight_matmul(torch.randn(4, 64).bfloat16(), *fp8_weight(8, 64, None), None, None, None, None, None,
                         c8.Int8Library(lib.path, fp8_dot=False))
    assert len(calls) == len(CASES)


def _greedy(path, monkeypatch, mode: str, reference: bool = False):
    monkeypatch.setenv("JOBRUNNER_CPU_FP8", mode)
    if reference:                                    # compressed-tensors' arithmetic, the whole weight dequantized
        monkeypatch.setattr(Fp8WeightLinear, "forward", Fp8WeightLinear.forward_ref)
    eng = Engine(EngineConfig(model=str(path), dtype="float32", kv_cache_memory=4 * 2**20))
    served = [m for m in eng.rt.model.modules() if isinstance(m, Fp8WeightLinear)]
    reqs = [Request(str(i), p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(([5, 6, 7, 8], [11, 200, 3, 3, 64, 90, 17], [9] * 20, [1, 2]))]
    outs = {o.id: o.token_ids for o in eng.generate(reqs)}
    monkeypatch.undo()
    return [outs[str(i)] for i in range(len(reqs))], served


@pytest.mark.parametrize("scheme", ["FP8", "FP8_DYNAMIC", "FP8_BLOCK"])
def test_checkpoint_greedy_tokens_through_the_form_equal_the_reference(tmp_path, monkeypatch, lib, scheme):
    pytest.importorskip("compressed_tensors")
    from quantized_checkpoints import make_compressed
    path = make_compressed(tmp_path / "ckpt", "llama", scheme)
    want, _ = _greedy(path, monkeypatch, "off", reference=True)
    calls = []
    real = sq.fp8_dot_cpu
    monkeypatch.setattr(sq, "fp8_dot_cpu", lambda *a: calls.append(a[1].shape) or real(*a))
    got, served = _greedy(path, monkeypatch, "auto")
    assert served and all(m.cpu_kernel is not None and m.cpu_kernel.fp8_dot for m in served)
    assert {m.qweight.shape for m in served} <= set(calls)           # every fp8 linear ran the form
    assert got == want


def test_benchmark_times_both_forms(lib):
    """benchmarks/cpu_int8_bench.py's fp8-dot case on small shapes: each path timed (no speed asserted)."""
    from benchmarks.cpu_int8_bench import fp8_dot_case
    for block in (None, (32, 32)):
        times = fp8_dot_case(64, 40, 3, block, 1, lib)
        assert set(times) == {"F.linear f32", "oneDNN f32", "fp8 f32 form", "fp8 bf16 form"}
        assert min(times.values()) > 0


@pytest.mark.parametrize("m", [1, 5, 16, 130])
def test_int8_weights_through_the_form(lib, m):
    """Symmetric int8 weights (per channel, groups of 32) times bfloat16 rows through the same form: each int8
    value widened to its bfloat16 exactly (-128 included), the products exact, summed in float32, rounded once."""
    for n, k, group in ((37, 100, None), (64, 577, None), (48, 192, 32), (130, 256, 64)):
        lin = make_int8(n, k, group, bias=True, seed=n + k)
        x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)) * 3).bfloat16()
        got = c8.int8_dot_bf16_cpu(x, lin.qweight, lin.scales, lin.bias, lib)
        w = lin.dequantize(torch.float64)
        want = x.double() @ w.T + lin.bias.double()
        magnitude = x.double().abs() @ w.abs().T + lin.bias.double().abs()
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        assert ((got.double() - want).abs() <= 2 ** -8 * want.abs() + 1e-5 * magnitude).all()


def test_int8_linear_takes_the_form_for_bfloat16_rows(lib, monkeypatch):
    """Int8Linear: bfloat16 rows on a symmetric weight take the form; float32 rows, a weight with zero points
    and a library without the form keep the int8 kernel's paths."""
    calls = []
    real = ql.int8_dot_bf16_cpu
    monkeypatch.setattr(ql, "int8_dot_bf16_cpu", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    sym, affine = make_int8(64, 96, 32, bias=True), make_int8(64, 96, 32, zeros=True)
    for lin in (sym, affine):
        lin.cpu_kernel = lib
    xb = torch.randn(c8.INT8_DOT_MIN_ROWS + 3, 96).bfloat16()
    sym(xb), sym(xb.float()), affine(xb)
    sym.cpu_kernel = c8.Int8Library(lib.path, fp8_dot=False)
    sym(xb)
    assert calls == [xb.shape[0]]
    with pytest.raises(TypeError, match="bfloat16"):
        c8.int8_dot_bf16_cpu(xb.float(), sym.qweight, sym.scales, None, lib)
