"""The CPU fp8 (e4m3) weight matmul (kernels/matmul/cpu_int8.c's fp8 form, cpu_int8.fp8_matmul_cpu) against the
torch reference (dequantize_fp8 + F.linear: shipped_quant.fp8_weight_matmul_ref), every e4m3 byte decoded exactly,
fp8_weight_matmul's dispatch (the kernel for the float32 calls it takes, activations fake-quantized as the
scheme says, as before) and the engine's side (engine/run/cpu_kernel_build.py's FP8 entry, JOBRUNNER_CPU_FP8):
greedy tokens of llmcompressor fp8 checkpoints (FP8 static, FP8_DYNAMIC, FP8_BLOCK) kernel on against off.
Parity with transformers on those checkpoints, through the kernel now: tests/test_shipped_checkpoints.py.

Builds: "native" (-march=native: the AVX-512 loop here), the same library told to run its portable loop, and the
"portable" build (no -march), from tests/test_cpu_int8.py's session fixture (one library serves both forms).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jobrunner.engine.api.request import Request, SamplingParams
from jobrunner.engine.config.engine_config import EngineConfig
from jobrunner.engine.core.engine import Engine
from jobrunner.engine.run import cpu_kernel_build as cb
from jobrunner.engine.shipped.shipped_linear import Fp8WeightLinear
from jobrunner.kernels.matmul import cpu_int8 as c8
from jobrunner.kernels.matmul import shipped_quant as sq
from test_cpu_int8 import libs  # noqa: F401 - the session's three builds

BUILDS = ["native", "portable", "native-portable-loop"]
# (N, K, block): per channel with N off the 4-column tiles and K off the 16 lanes; blocks whose last row block
# and last column block are short (the default model's 576 = 4.5 x 128); a block width off the 16 lanes
CASES = ((37, 100, None), (5, 33, None), (64, 576, None), (19, 577, None), (130, 192, (128, 128)),
         (200, 300, (128, 128)), (576, 576, (128, 128)), (70, 96, (32, 64)), (23, 72, (8, 24)))
NAN_BYTES = (0x7F, 0xFF)


def fp8_weight(n, k, block, seed=0):
    """Random e4m3 bytes (NaN excepted) and float32 scales: [N, 1] per channel or the block grid."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
    q[(q & 0x7F) == 0x7F] = 0
    grid = (n, 1) if block is None else (-(-n // block[0]), -(-k // block[1]))
    return q.view(torch.float8_e4m3fn), torch.rand(grid, generator=g) * 0.01 + 1e-3


def reference(x, q, s, block, bias=None):
    return F.linear(x, sq.dequantize_fp8(q, s, block, torch.float32), bias)


def close(got, ref):
    """The kernel's documented tolerance (cpu_int8.RTOL/ATOL), relative to the output's largest magnitude."""
    scale = ref.abs().max().clamp(min=1.0)
    assert (got - ref).abs().max() <= c8.ATOL * scale + c8.RTOL * ref.abs().max(), (got - ref).abs().max()


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("m", [1, 3, 15, 16, 37, 300])   # 16 on: the panel path (37: tiles of 9 and 10), 300 over three slabs
def test_kernel_matches_the_dequantized_reference(libs, build, m):  # noqa: F811
    for n, k, block in CASES:
        q, s = fp8_weight(n, k, block, seed=n + k)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k))
        bias = torch.randn(n) if n % 2 else None
        close(c8.fp8_matmul_cpu(x, q, s, block, bias, libs[build]), reference(x, q, s, block, bias))


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("block", [None, (2, 16)])
def test_every_byte_decodes_exactly(libs, build, block):  # noqa: F811
    """Each of the 254 non-NaN bytes in a row, read back through one-hot rows: W's values exactly (subnormals,
    zeros of both signs, the largest 448), times scales that are powers of two. 32 weight rows and 254 one-hot
    activation rows: the panel path on AVX-512 (the tile loop for the portable builds)."""
    values = torch.tensor([b for b in range(256) if b not in NAN_BYTES], dtype=torch.uint8)
    k = values.numel()
    q = torch.stack([values.roll(37 * i) if i % 2 else values.flip(0).roll(i) for i in range(32)])
    q = q.view(torch.float8_e4m3fn)
    powers = torch.tensor([2.0 ** (i % 7 - 3) for i in range(32)])
    s = powers[:, None] if block is None else powers[:16, None].expand(16, 16).contiguous()
    want = sq.dequantize_fp8(q.contiguous(), s, block, torch.float32)
    assert torch.isfinite(want).all() and want.abs().max() == 448 * s.max()
    got = c8.fp8_matmul_cpu(torch.eye(k), q.contiguous(), s, block, None, libs[build])
    assert torch.equal(got.t(), want)


@pytest.mark.parametrize("build", BUILDS)
def test_activations_fake_quantized_bit_for_bit(libs, build):  # noqa: F811
    """The library's fake-quantizer against fake_quantize_fp8: per token, per group, static; magnitudes from
    1e-12 (e4m3's subnormals after scaling) to 1e3, zero rows, and every midpoint of the e4m3 grid (ties to
    even) and values past 448 under a unit scale."""
    lib = libs[build]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 256, generator=g) * torch.logspace(-12, 3, 256)
    x[3], x[5, :128], x[7] = 0.0, 0.0, 1e-30
    for static, group in ((None, None), (None, 64), (None, 128), (torch.tensor([0.37]), None),
                          (torch.tensor([1e-3]), None)):
        assert torch.equal(c8.fake_quantize_fp8_cpu(x, static, group, lib), sq.fake_quantize_fp8(x, static, group))
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    ties = torch.cat([mids, -mids, grid, torch.tensor([500.0, -1000.0, 464.0, -464.0, 480.0])])[None]
    one = torch.tensor([1.0])
    assert torch.equal(c8.fake_quantize_fp8_cpu(ties, one, None, lib), sq.fake_quantize_fp8(ties, one))
    wide = torch.randn(4, 300, generator=g)
    assert torch.equal(c8.fake_quantize_fp8_cpu(wide[:, 10:266], None, 128, lib),
                       sq.fake_quantize_fp8(wide[:, 10:266].contiguous(), None, 128))


def test_strided_rows_and_refusals(libs):  # noqa: F811
    lib = libs["native"]
    q, s = fp8_weight(40, 96, (16, 32))
    wide = torch.randn(2, 3, 150)
    x = wide[..., 10:106]                                   # rows 150 apart: the kernel reads the row stride
    got = c8.fp8_matmul_cpu(x, q, s, (16, 32), None, lib)
    assert got.shape == (2, 3, 40)
    close(got, reference(x.contiguous(), q, s, (16, 32)))
    with pytest.raises(TypeError, match="float32"):
        c8.fp8_matmul_cpu(torch.randn(2, 96, dtype=torch.bfloat16), q, s, (16, 32), None, lib)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        c8.fp8_matmul_cpu(torch.randn(2, 96), q.view(torch.uint8), s, (16, 32), None, lib)
    with pytest.raises(ValueError, match="block grid"):
        c8.fp8_matmul_cpu(torch.randn(2, 96), q, s, (32, 32), None, lib)
    with pytest.raises(ValueError, match="block grid"):
        c8.fp8_matmul_cpu(torch.randn(2, 96), q, s[:, :1].contiguous(), None, None, lib)


@pytest.mark.parametrize("act,group", [(None, None), ("dynamic", None), ("dynamic", 32), ("static", None)])
def test_fp8_weight_matmul_runs_the_kernel_with_the_schemes_activations(libs, act, group):  # noqa: F811
    """Activations fake-quantized in the library (bit for bit as before), then the kernel: equal to the old path
    (fake_quantize_fp8, a float slice, F.linear) within the kernel's tolerance."""
    q, s = fp8_weight(150, 192, (128, 32) if group else None)
    block = (128, 32) if group else None
    x = torch.randn(5, 192) * 3
    static = torch.tensor([0.02]) if act == "static" else None
    old = sq.fp8_weight_matmul(x, q, s, block, None, act, static, group)
    close(sq.fp8_weight_matmul(x, q, s, block, None, act, static, group, libs["native"]), old)
    close(old, sq.fp8_weight_matmul_ref(x, q, s, block, None, act, static, group))


def test_linear_takes_the_kernel_for_the_float32_rows_it_covers(libs, monkeypatch):  # noqa: F811
    calls = []
    real = sq.fp8_matmul_cpu
    monkeypatch.setattr(sq, "fp8_matmul_cpu", lambda *a: calls.append(a[0].shape) or real(*a))
    q, s = fp8_weight(16, 64, None)                                       # 16 columns: no panel path
    lin = Fp8WeightLinear(q, s, None, torch.randn(16), act="dynamic")
    lin.cpu_kernel = c8.Int8Library(libs["native"].path, fp8_dot=False)     # the float32 form (the bf16 one:
                                                                            # tests/test_cpu_fp8_bf16.py)
    for rows in (1, c8.FP8_KERNEL_ROWS, c8.FP8_KERNEL_ROWS + 1):
        x = torch.randn(rows, 64)
        close(lin(x), lin.forward_ref(x))
    for rows in (2, c8.FP8_BF16_KERNEL_ROWS + 1):                        # bfloat16: the kernel in float32, then
        xb = torch.randn(rows, 64, dtype=torch.bfloat16)                 # slices and F.linear in bfloat16
        ref = lin.forward_ref(xb).float()
        assert (lin(xb).float() - ref).abs().max() <= 2 ** -7 * ref.abs().max()
    lin.cpu_kernel = None
    lin(torch.randn(2, 64))                                              # no library handed: the old path
    assert calls == [(1, 64), (c8.FP8_KERNEL_ROWS, 64), (2, 64)]
    q, s = fp8_weight(48, 64, None)                                       # 48: the panel path takes any rows
    lin = Fp8WeightLinear(q, s, None, torch.randn(48), act="dynamic")
    lin.cpu_kernel = c8.Int8Library(libs["native"].path, fp8_dot=False)
    x = torch.randn(c8.FP8_KERNEL_ROWS + 1, 64)
    close(lin(x), lin.forward_ref(x))
    assert calls[3:] == ([(c8.FP8_KERNEL_ROWS + 1, 64)] if lin.cpu_kernel.isa == "avx512" else [])


@pytest.mark.parametrize("build", BUILDS)
def test_many_rows_take_slices_the_library_dequantizes_bit_for_bit(libs, build):  # noqa: F811
    """Past FP8_KERNEL_ROWS without the panel path (fewer than 32 columns, groups off the lanes, the portable
    builds), and for bfloat16 rows, the old path's slices and F.linear, the slices dequantized by the library:
    dequantize_fp8's values exactly, so the old path's results exactly. With it, the kernel (its tolerance)."""
    for n, k, block in ((37, 100, None), (300, 3600, None), (200, 300, (128, 128)), (23, 72, (8, 24))):
        q, s = fp8_weight(n, k, block, seed=k)
        for rows in (slice(0, n), slice(5, n - 3)):
            assert torch.equal(c8.fp8_dequantize_cpu(q, s, block, rows, libs[build]),
                               sq.dequantize_fp8(q, s, block, torch.float32, rows))
        lib = c8.Int8Library(libs[build].path, libs[build].portable, fp8_dot=False)    # no bf16 form
        panel = lib.fp8_panel_path(n, k, block)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(c8.FP8_KERNEL_ROWS + 3, k).to(dtype)
            got = sq.fp8_weight_matmul(x, q, s, block, act="dynamic", cpu_kernel=lib)
            old = sq.fp8_weight_matmul(x, q, s, block, act="dynamic")
            if panel and dtype == torch.float32:
                close(got, old)
            else:
                assert torch.equal(got, old)


def _greedy(path, mode, monkeypatch):
    monkeypatch.setenv("JOBRUNNER_CPU_FP8", mode)
    eng = Engine(EngineConfig(model=str(path), dtype="float32", kv_cache_memory=4 * 2**20))
    served = [m for m in eng.rt.model.modules() if isinstance(m, Fp8WeightLinear)]
    reqs = [Request(str(i), p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(([5, 6, 7, 8], [11, 200, 3, 3, 64, 90, 17], [9] * 20, [1, 2]))]
    outs = {o.id: o.token_ids for o in eng.generate(reqs)}
    return [outs[str(i)] for i in range(len(reqs))], served


@pytest.mark.parametrize("scheme", ["FP8", "FP8_DYNAMIC", "FP8_BLOCK"])
def test_llmcompressor_fp8_checkpoint_same_tokens_kernel_on_and_off(tmp_path, monkeypatch, scheme):
    pytest.importorskip("compressed_tensors")
    from quantized_checkpoints import make_compressed
    path = make_compressed(tmp_path / "ckpt", "llama", scheme)
    calls = []
    real = sq.fp8_matmul_cpu
    monkeypatch.setattr(sq, "fp8_matmul_cpu", lambda *a: calls.append(a[2].shape) or real(*a))
    old, served = _greedy(path, "off", monkeypatch)
    assert len(served) >= 2 * 4 and all(m.cpu_kernel is None for m in served) and not calls
    for mode, isa in (("auto", None), ("portable", "portable")):
        new, served = _greedy(path, mode, monkeypatch)
        assert all(m.cpu_kernel is not None for m in served) and (isa is None or served[0].cpu_kernel.isa == isa)
        assert new == old, mode
    assert {shape for shape in calls} == {m.scales.shape for m in served}     # every fp8 linear ran it


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("scheme", ["FP8", "FP8_DYNAMIC", "FP8_BLOCK"])
def test_kernel_tokens_follow_transformers_up_to_near_ties(tmp_path, monkeypatch, family, scheme):
    """Through the kernel, against transformers on the compressed directory (it fake-quantizes each linear's
    input, then F.linear over the decompressed weight): on our greedy sequence, each chosen token's logprob
    within 0.1 of transformers' (test_shipped_checkpoints.py's bound for activation-quantized schemes), and
    wherever our token is not transformers' argmax, the two within 0.1 of each other there (a near-tie that a
    sum rounded in another order can tip: quantizing the next layer's input turns rounding into whole steps).
    Token-for-token parity with transformers is test_shipped_checkpoints.py's, on the old path (its F.linear
    is transformers' own, bit for bit)."""
    pytest.importorskip("compressed_tensors")
    import test_shipped_checkpoints as shipped
    from quantized_checkpoints import make_compressed
    path = make_compressed(tmp_path / "ckpt", family, scheme)
    hf, _ = shipped._hf(path)
    monkeypatch.setenv("JOBRUNNER_CPU_FP8", "auto")
    for prompt, (tokens, logprobs) in zip(shipped.PROMPTS, shipped._ours(path)):
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float(), -1)
        chosen = lp[torch.arange(len(tokens)), torch.tensor(tokens)]
        assert (chosen - torch.tensor(logprobs)).abs().max() < 0.1
        assert (lp.max(-1).values - chosen).max() < 0.1


def test_fp8_switch(monkeypatch, tmp_path):
    monkeypatch.setenv("JOBRUNNER_CACHE", str(tmp_path))
    monkeypatch.setenv("JOBRUNNER_CPU_FP8", "off")
    q, s = fp8_weight(8, 64, None)
    lin = Fp8WeightLinear(q, s, None)
    assert cb.attach_cpu_kernels(torch.nn.Sequential(lin))["fp8"] == 0 and lin.cpu_kernel is None
    monkeypatch.setenv("JOBRUNNER_CPU_FP8", "auto")
    assert cb.attach_cpu_kernels(torch.nn.Sequential(lin))["fp8"] == 1
    assert lin.cpu_kernel.path == cb.kernel_library_path(cb.INT8, "native")      # the int8 library, shared
    monkeypatch.setenv("JOBRUNNER_CPU_FP8", "fast")
    with pytest.raises(ValueError, match="JOBRUNNER_CPU_FP8"):
        cb.kernel_mode(cb.FP8)


def test_benchmark_times_every_fp8_path(libs):  # noqa: F811
    """benchmarks/cpu_int8_bench.py's fp8 case on small shapes: each path timed (no speed asserted)."""
    from benchmarks.cpu_int8_bench import fp8_case
    for block in (None, (32, 32)):
        times = fp8_case(64, 40, 3, block, 1, libs["native"])
        assert set(times) == {"oneDNN f32", "fp8 old", "fp8 kernel"} and min(times.values()) > 0


def test_activation_groups_that_do_not_divide_a_layer_are_refused_at_load():
    """An FP8_BLOCK checkpoint of a shape whose inputs its 128-column activation groups do not divide (the
    default model's 576): a ConfigError when the layer is built, before any row, not a RuntimeError mid-job."""
    from jobrunner.engine.config.engine_config import ConfigError
    from jobrunner.engine.shipped.build import _module
    from jobrunner.engine.shipped.scheme import ActArgs, ModuleScheme, WeightArgs
    from jobrunner.engine.shipped.unpack import FloatLevels

    q = torch.zeros(256, 576).to(torch.float8_e4m3fn)
    levels = FloatLevels(q, torch.ones(2, 5), (128, 128))
    block = ModuleScheme("float-quantized", WeightArgs("float", 8, "block", block=(128, 128)),
                         ActArgs("float", "group", True, 128))
    with pytest.raises(ConfigError, match="groups of 128 columns, but a linear has 576 inputs"):
        _module(block, levels, "cpu", None)
    per_token = ModuleScheme("float-quantized", WeightArgs("float", 8, "channel"), ActArgs("float", "token", True))
    assert _module(per_token, FloatLevels(q, torch.ones(256, 1), None), "cpu", None) is not None
