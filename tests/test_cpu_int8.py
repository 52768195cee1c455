"""The CPU weight-only int8 matmul (kernels/matmul/cpu_int8.py and .c) against the dequantized reference
(Int8Linear.forward_ref: the weight dequantized in float32, then F.linear), Int8Linear's dispatch (the kernel for
float32 calls, of any size where it runs its panel path), and the engine's side (engine/run/cpu_kernel_build.py: the build,
JOBRUNNER_CPU_INT8, the fallback, the int8 linears it serves: `--quantization int8`, GGUF Q8_0, a shipped
asymmetric int8 checkpoint, and the lm_head of int4 mode), greedy tokens kernel on against off.

Three builds: "native" (-march=native: the AVX-512 loop on this CPU where it has one), the same library told to
run its portable loop, and the "portable" build (no -march: the plain C loop whatever the CPU).
"""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from jobrunner.engine.api.request import Request, SamplingParams
from jobrunner.engine.config.engine_config import EngineConfig
from jobrunner.engine.core.engine import Engine
from jobrunner.engine.quant import linear as ql
from jobrunner.engine.quant.linear import Int8Linear
from jobrunner.engine.run import cpu_kernel_build as cb
from jobrunner.kernels.matmul import cpu_int8 as c8
from jobrunner.kernels.matmul import quant_matmul as qm
from tests.cpu_builds import build_variants

SHAPES = ((37, 96), (130, 192), (5, 128), (19, 384), (64, 576))     # (N, K): N off the 4-column tiles
ODD_K = ((37, 100), (3, 33), (50, 577))                             # per channel only: K off the 16 lanes


@pytest.fixture(scope="session")
def libs(tmp_path_factory) -> dict[str, c8.Int8Library]:
    out = build_variants(cb.INT8, tmp_path_factory, c8.VARIANTS)
    out["native-portable-loop"] = c8.Int8Library(out["native"].path, portable=True)
    return out


def make(n, k, group=None, zeros=False, bias=False, seed=0) -> Int8Linear:
    """An Int8Linear over random levels in the full int8 range; group None: one scale per channel."""
    g = torch.Generator().manual_seed(seed)
    groups = 1 if group is None else k // group
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    s = torch.rand(n, groups, generator=g) * 0.02 + 0.001
    z = torch.randn(n, groups, generator=g) * 0.5 if zeros else None
    return Int8Linear(q, s, torch.randn(n, generator=g) if bias else None, zeros=z)


def run(lin: Int8Linear, x: torch.Tensor, lib) -> torch.Tensor:
    return c8.int8_matmul_cpu(x, lin.qweight, lin.scales, lin.zeros, lin.bias, lib)


def close(got, ref):
    """The kernel's documented tolerance: relative to the output's largest magnitude."""
    scale = ref.abs().max().clamp(min=1.0)
    assert (got - ref).abs().max() <= c8.ATOL * scale + c8.RTOL * ref.abs().max(), (got - ref).abs().max()


@pytest.mark.parametrize("build", ["native", "portable", "native-portable-loop"])
@pytest.mark.parametrize("m", [1, 3, 15, 16, 37, 300])   # 16 on: the panel path (37: tiles of 9 and 10), 300 over three slabs
def test_kernel_matches_dequantized_reference(libs, build, m):
    lib = libs[build]
    x_of = lambda k: torch.randn(m, k, generator=torch.Generator().manual_seed(m + k))  # noqa: E731
    for n, k in SHAPES:
        for group in (None, 32, 64, 128):
            if group is not None and k % group:
                continue
            for zeros in (False, True):
                lin = make(n, k, group, zeros, bias=zeros, seed=n + k)
                x = x_of(k)
                close(run(lin, x, lib), lin.forward_ref(x))
    for n, k in ODD_K:
        lin = make(n, k, bias=True, seed=k)
        x = x_of(k)
        close(run(lin, x, lib), lin.forward_ref(x))


def test_builds_run_the_loop_they_say(libs):
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text() if cpuinfo.exists() else ""
    assert libs["portable"].isa == "portable" and libs["native-portable-loop"].isa == "portable"
    assert libs["native"].isa == ("avx512" if " avx512bw" in flags and " avx512vl" in flags else "portable")


@pytest.mark.parametrize("group", [8, 24, 33])
def test_groups_off_the_lanes_take_the_portable_loop(libs, group):
    for zeros in (False, True):
        lin = make(23, group * 4, group, zeros)
        x = torch.randn(5, group * 4)
        close(run(lin, x, libs["native"]), lin.forward_ref(x))


def test_strided_and_batched_activations(libs):
    lin = make(40, 96, 32)
    wide = torch.randn(2, 3, 150)
    x = wide[..., 10:106]                                   # rows 150 apart: the kernel reads the row stride
    got = run(lin, x, libs["native"])
    assert got.shape == (2, 3, 40)
    close(got, lin.forward_ref(x.contiguous()))
    one = wide[0, :1, 10:106]
    close(run(lin, one, libs["native"]), lin.forward_ref(one.contiguous()))


def test_launcher_refuses_what_the_kernel_cannot_take(libs):
    lib, lin = libs["native"], make(8, 64, 32, zeros=True)
    with pytest.raises(TypeError, match="float32"):
        c8.int8_matmul_cpu(torch.randn(2, 64, dtype=torch.bfloat16), lin.qweight, lin.scales, None, None, lib)
    with pytest.raises(ValueError, match="qweight"):
        c8.int8_matmul_cpu(torch.randn(2, 60), lin.qweight, lin.scales, None, None, lib)
    with pytest.raises(TypeError, match="zeros"):
        c8.int8_matmul_cpu(torch.randn(2, 64), lin.qweight, lin.scales, lin.zeros[:, :1], None, lib)
    with pytest.raises(ValueError, match="scales"):
        c8.int8_matmul_cpu(torch.randn(2, 64), lin.qweight, torch.rand(8, 3), None, None, lib)


def test_linear_takes_the_kernel_for_float32_rows_it_covers(libs, monkeypatch):
    calls = []
    real = ql.int8_matmul_cpu
    monkeypatch.setattr(ql, "int8_matmul_cpu", lambda *a: calls.append(a[0].shape) or real(*a))
    lin = make(16, 64, zeros=True, bias=True)
    lin.cpu_kernel = libs["native"]
    for rows in (1, c8.CPU_INT8_MAX_ROWS, c8.CPU_INT8_MAX_ROWS + 1):
        x = torch.randn(rows, 64)
        close(lin(x), lin.forward_ref(x))
    lin(torch.randn(2, 64, dtype=torch.float16))                         # another dtype: the old path
    lin(torch.randn(3, 64, dtype=torch.bfloat16))                        # widened (quant_matmul.widened_bf16)
    lin(torch.randn(17, 64, dtype=torch.bfloat16))                       # past BF16_KERNEL_ROWS: the old path
    lin.cpu_kernel = None
    lin(torch.randn(2, 64))                                              # no library handed: the old path
    assert calls == [(1, 64), (c8.CPU_INT8_MAX_ROWS, 64), (3, 64)]     # 16 columns: no panel path


def test_the_panel_path_takes_any_rows(libs, monkeypatch):
    """32 columns or more, per channel or groups of a multiple of 16, AVX-512: every float32 call; groups off the
    lanes and the portable build keep the row limit."""
    calls = []
    real = ql.int8_matmul_cpu
    monkeypatch.setattr(ql, "int8_matmul_cpu", lambda *a: calls.append(a[0].shape) or real(*a))
    rows = c8.CPU_INT8_MAX_ROWS + 1
    for group, lib in ((None, "native"), (32, "native"), (24, "native"), (None, "portable")):
        lin = make(48, 96, group, zeros=group is not None, bias=True)
        lin.cpu_kernel = c8.Int8Library(libs[lib].path, libs[lib].portable, fp8_dot=False)   # bfloat16: no dot form
        x = torch.randn(rows, 96)
        close(lin(x), lin.forward_ref(x))
        # bfloat16 past BF16_KERNEL_ROWS: widened where the panel path runs (float32's rate), else the old path
        # (bfloat16 slices and zero terms: a few bfloat16 roundings of the magnitude)
        xb = x.bfloat16()
        got, w = lin(xb), lin.dequantize(torch.float64)
        terms = qm.dequantize_int8(lin.qweight, lin.scales, torch.float64).abs() + (
            0 if lin.zeros is None else lin.zeros.double().abs().repeat_interleave(96 // lin.zeros.shape[1], dim=1))
        magnitude = xb.double().abs() @ terms.T + lin.bias.double().abs()      # q s and the zero term apart
        err = (got.double() - (xb.double() @ w.T + lin.bias.double())).abs()
        assert got.dtype == torch.bfloat16 and (err <= 4 * torch.finfo(torch.bfloat16).eps * magnitude).all()
    panel = libs["native"].isa == "avx512"
    assert calls == ([(rows, 96)] * 4 if panel else [])


def _greedy(model, int8_mode, monkeypatch, int4_mode="auto", **engine):
    monkeypatch.setenv("JOBRUNNER_CPU_INT8", int8_mode)
    monkeypatch.setenv("JOBRUNNER_CPU_INT4", int4_mode)
    eng = Engine(EngineConfig(model=str(model), dtype="float32", kv_cache_memory=4 * 2**20, **engine))
    served = [m for m in eng.rt.model.modules() if isinstance(m, Int8Linear)]
    reqs = [Request(str(i), p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(([5, 6, 7, 8], [11, 200, 3, 3, 64, 90, 17], [9] * 20, [1, 2]))]
    outs = {o.id: o.token_ids for o in eng.generate(reqs)}
    return [outs[str(i)] for i in range(len(reqs))], served


def _same_tokens_kernel_on_and_off(model, monkeypatch, **engine) -> list:
    calls = []
    real = ql.int8_matmul_cpu
    monkeypatch.setattr(ql, "int8_matmul_cpu", lambda *a: calls.append(a[2].shape) or real(*a))
    old, served = _greedy(model, "off", monkeypatch, **engine)
    assert served and all(m.cpu_kernel is None for m in served) and not calls
    for mode, isa in (("auto", None), ("portable", "portable")):
        new, served = _greedy(model, mode, monkeypatch, **engine)
        assert all(m.cpu_kernel is not None for m in served) and (isa is None or served[0].cpu_kernel.isa == isa)
        assert new == old, mode
    assert {shape for shape in calls} == {m.scales.shape for m in served}     # every int8 linear ran it
    return served


@pytest.mark.parametrize("tied", [False, True])
def test_engine_int8_greedy_matches_the_old_path(tiny_hf_model_dir, monkeypatch, tied):
    served = _same_tokens_kernel_on_and_off(tiny_hf_model_dir("llama", tie_word_embeddings=tied), monkeypatch,
                                            quantization="int8")
    assert len(served) == 1 + 2 * 4          # the lm_head and each layer's qkv, o, gate_up, down


def test_int4_mode_lm_head_runs_the_int8_kernel(tiny_hf_model_dir, monkeypatch):
    served = _same_tokens_kernel_on_and_off(tiny_hf_model_dir("llama"), monkeypatch, quantization="int4")
    assert len(served) == 1                  # its one int8 linear: the lm_head


def test_gguf_q8_0_groups_run_the_kernel(tiny_gguf_path, monkeypatch):
    """GGUF Q8_0 loaded as int8: groups of 32, the grouped loop."""
    served = _same_tokens_kernel_on_and_off(tiny_gguf_path("llama", "Q8_0"), monkeypatch, quantization="int8")
    assert all(lin.group_size == 32 for lin in served)


def test_shipped_asymmetric_int8_runs_the_kernel(tmp_path, monkeypatch):
    """A GPTQ int8 checkpoint with zero points: Int8Linear with zeros, group 32."""
    pytest.importorskip("compressed_tensors")
    from quantized_checkpoints import make_gptq
    path = make_gptq(tmp_path / "ckpt", "llama", bits=8, group_size=32, sym=False)
    served = _same_tokens_kernel_on_and_off(path, monkeypatch)
    assert all(lin.zeros is not None and lin.group_size == 32 for lin in served)


def test_float_model_builds_no_int8_library(tiny_hf_model_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("JOBRUNNER_CACHE", str(tmp_path))
    _, served = _greedy(tiny_hf_model_dir("llama"), "auto", monkeypatch)
    assert served == [] and not cb.kernel_library_path(cb.INT8, "native").exists()


def test_no_compiler_warns_and_keeps_the_old_path(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("JOBRUNNER_CACHE", str(tmp_path))
    monkeypatch.setenv("JOBRUNNER_CPU_INT8", "auto")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    lin = make(8, 64)
    with caplog.at_level(logging.WARNING, logger="jobrunner"):
        assert cb.attach_cpu_kernels(torch.nn.Sequential(lin)) == {"int4": 0, "int8": 0, "fp8": 0, "w4a8": 0}
    assert lin.cpu_kernel is None and "int8 matmul is not available" in caplog.text and "no-such-cc" in caplog.text
    x = torch.randn(3, 64)
    close(lin(x), lin.forward_ref(x))


def test_attach_hands_the_kernel_float32_contiguous_scales(monkeypatch, tmp_path):
    """A checkpoint's float16 scales, transposed: upcast (exact) and made contiguous for the kernel."""
    monkeypatch.setenv("JOBRUNNER_CACHE", str(tmp_path))
    monkeypatch.setenv("JOBRUNNER_CPU_INT8", "auto")
    ref = make(24, 96, 32, zeros=True)
    lin = Int8Linear(ref.qweight, ref.scales.half().t().contiguous().t(), zeros=ref.zeros)
    x = torch.randn(4, 96)
    want = lin.forward_ref(x)
    assert cb.attach_cpu_kernels(torch.nn.Sequential(lin))["int8"] == 1
    assert lin.scales.dtype == torch.float32 and lin.scales.is_contiguous() and lin.cpu_kernel.takes(x, lin.scales, lin.zeros)
    close(lin(x), want)


def test_library_kept_under_the_cache_root_by_variant(monkeypatch, tmp_path):
    monkeypatch.setenv("JOBRUNNER_CACHE", str(tmp_path))
    assert c8.int8_library_name("native") != c8.int8_library_name("portable")
    for mode, variant in (("auto", "native"), ("portable", "portable")):
        monkeypatch.setenv("JOBRUNNER_CPU_INT8", mode)
        lib = cb.kernel_library(cb.INT8)
        assert lib is not None and lib.path == cb.kernel_library_path(cb.INT8, variant) and lib.path.is_relative_to(tmp_path)
    monkeypatch.setenv("JOBRUNNER_CPU_INT8", "off")
    assert cb.kernel_library(cb.INT8) is None
    monkeypatch.setenv("JOBRUNNER_CPU_INT8", "fast")
    with pytest.raises(ValueError, match="JOBRUNNER_CPU_INT8"):
        cb.kernel_mode(cb.INT8)


def test_benchmark_times_every_path(libs):
    """benchmarks/cpu_int8_bench.py's kernel case on a small shape: each path timed (no speed asserted)."""
    from benchmarks.cpu_int8_bench import kernel_case
    times = kernel_case(64, 40, 3, None, 1, libs["native"])
    assert set(times) == {"F.linear f32", "oneDNN f32", "int8 old", "int8 kernel"} and min(times.values()) > 0
