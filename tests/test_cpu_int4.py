"""The CPU int4 matmul over packed nibbles (kernels/matmul/cpu_int4.py and .c) against the dequantized reference
(int4_matmul_ref), its dispatch (int4_matmul: the kernel for float32 calls, of any size where it runs its panel path),
and the engine's side (engine/run/cpu_kernel_build.py: the build, the modes, the fallback, the int4 linears it
serves: ours and the shipped GPTQ ones, act order included).

Three builds: "native" (-march=native: the AVX-512 loop on this CPU where it has one), the same library told to
run its portable loop, and the "portable" build (no -march: the plain C loop whatever the CPU).
"""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from jobrunner.engine.config.engine_config import EngineConfig
from jobrunner.engine.api.request import Request, SamplingParams
from jobrunner.engine.core.engine import Engine
from jobrunner.engine.quant.linear import Int4Linear
from jobrunner.engine.run import cpu_kernel_build as cb
from jobrunner.engine.shipped.shipped_linear import PermutedInput
from jobrunner.kernels.matmul import cpu_int4 as ci
from jobrunner.kernels.matmul import quant_matmul as qm
from tests.cpu_builds import build_variants

SHAPES = ((37, 100), (130, 200), (64, 576), (5, 33), (19, 160))     # (N, K): K not a multiple of 64 mostly


@pytest.fixture(scope="session")
def libs(tmp_path_factory) -> dict[str, ci.Int4Library]:
    out = build_variants(cb.INT4, tmp_path_factory, ci.VARIANTS)
    out["native-portable-loop"] = ci.Int4Library(out["native"].path, portable=True)
    return out


def make(n, k, group, scale_dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    kp = -(-k // group) * group
    q = torch.randint(0, 16, (n, kp), dtype=torch.uint8, generator=g)
    s = (torch.rand(n, kp // group, generator=g) * 0.1 + 0.01).to(scale_dtype)
    z = (torch.randn(n, kp // group, generator=g) * 0.1).to(scale_dtype)
    return qm.pack_int4(q, group), s, z


def at_odd_offset(t: torch.Tensor) -> torch.Tensor:
    """t's values in a view one element into a larger buffer: a float16 tensor starting at an odd half."""
    buf = torch.zeros(t.numel() + 1, dtype=t.dtype)
    buf[1:] = t.flatten()
    return buf[1:].view(t.shape)


def close(got, ref):
    """The kernel's documented tolerance: relative to the output's largest magnitude."""
    scale = ref.abs().max().clamp(min=1.0)
    assert (got - ref).abs().max() <= ci.ATOL * scale + ci.RTOL * ref.abs().max(), (got - ref).abs().max()


@pytest.mark.parametrize("build", ["native", "portable", "native-portable-loop"])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 3, 17, 64, 400])      # 64 and 400: the panel path, 400 over two slabs of rows
def test_kernel_matches_dequantized_reference(libs, build, group, m):
    lib = libs[build]
    for n, k in SHAPES:
        for scale_dtype in ci.SCALE_DTYPES:
            packed, s, z = make(n, k, group, scale_dtype, seed=n + k)
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            b = torch.randn(n)
            close(ci.int4_matmul_cpu(x, packed, s, z, group, b, lib), qm.int4_matmul_ref(x, packed, s, z, group, b))
            # without zero points: symmetric, W = (q - 8) s (Q4_0's and GPTQ's form)
            sym = (s.float() * -8).to(scale_dtype)
            close(ci.int4_matmul_cpu(x, packed, s, None, group, None, lib), qm.int4_matmul_ref(x, packed, s, sym, group))


def test_panel_path_reads_float16_scales_at_any_offset(libs):
    """The panel path gathers float16 scales and zeros by the dword that holds each: a tensor starting at an odd
    half (a view into a larger buffer) reads the same values."""
    packed, s, z = make(96, 200, 32, torch.float16, seed=5)
    shifted = [at_odd_offset(s), at_odd_offset(z)]
    assert shifted[0].storage_offset() == 1 and shifted[0].is_contiguous()
    x = torch.randn(40, 200)
    ref = qm.int4_matmul_ref(x, packed, s, z, 32)
    close(ci.int4_matmul_cpu(x, packed, *shifted, 32, None, libs["native"]), ref)
    sym = (s.float() * -8).to(torch.float16)
    close(ci.int4_matmul_cpu(x, packed, shifted[0], None, 32, None, libs["native"]),
          qm.int4_matmul_ref(x, packed, s, sym, 32))


def test_builds_run_the_loop_they_say(libs):
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text() if cpuinfo.exists() else ""
    assert libs["portable"].isa == "portable" and libs["native-portable-loop"].isa == "portable"
    assert libs["native"].isa == ("avx512" if " avx512bw" in flags else "portable")


@pytest.mark.parametrize("group", [8, 16, 48])
def test_other_even_group_sizes_take_the_portable_loop(libs, group):
    packed, s, z = make(23, 90, group)
    x = torch.randn(5, 90)
    close(ci.int4_matmul_cpu(x, packed, s, z, group, None, libs["native"]), qm.int4_matmul_ref(x, packed, s, z, group))


def test_strided_and_batched_activations(libs):
    packed, s, z = make(40, 96, 32)
    wide = torch.randn(2, 3, 150)
    x = wide[..., 10:106]                                   # rows 150 apart: the kernel reads the row stride
    got = ci.int4_matmul_cpu(x, packed, s, z, 32, None, libs["native"])
    assert got.shape == (2, 3, 40)
    close(got, qm.int4_matmul_ref(x.contiguous(), packed, s, z, 32))
    one = wide[0, :1, 10:106]                               # a single row of a strided view
    close(ci.int4_matmul_cpu(one, packed, s, z, 32, None, libs["native"]), qm.int4_matmul_ref(one.contiguous(), packed, s, z, 32))


def test_launcher_refuses_what_the_kernel_cannot_take(libs):
    lib = libs["native"]
    packed, s, z = make(8, 64, 32)
    with pytest.raises(TypeError, match="float32"):
        ci.int4_matmul_cpu(torch.randn(2, 64, dtype=torch.bfloat16), packed, s, z, 32, None, lib)
    with pytest.raises(ValueError, match="rounded up"):
        ci.int4_matmul_cpu(torch.randn(2, 30), packed, s, z, 32, None, lib)     # K 30: Kp would be 32
    with pytest.raises(TypeError, match="zeros"):
        ci.int4_matmul_cpu(torch.randn(2, 64), packed, s, z.float(), 32, None, lib)


def test_act_order_permutes_the_activations_once(libs):
    """GPTQ desc_act: the columns stored in group order, the input permuted by PermutedInput."""
    n, k, group = 24, 96, 32
    packed, s, z = make(n, k, group, torch.float32)
    inner = Int4Linear(packed, s, z, group, k)
    inner.cpu_kernel = libs["native"]
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(3))
    lin = PermutedInput(inner, perm)
    x = torch.randn(7, k)
    close(lin(x), F.linear(x, lin.dequantize()))


def test_dispatch_takes_the_kernel_for_any_rows_where_it_has_the_panel_path(libs, monkeypatch):
    calls = []
    real = qm.int4_matmul_cpu
    monkeypatch.setattr(qm, "int4_matmul_cpu", lambda *a: calls.append(a[0].shape) or real(*a))
    rows = qm.CPU_INT4_MAX_ROWS + 1
    for group, n, lib in ((32, 64, "native"), (48, 64, "native"), (32, 16, "native"), (32, 64, "portable")):
        packed, s, z = make(n, 96, group)
        x = torch.randn(rows, 96)
        close(qm.int4_matmul(x, packed, s, z, group, None, libs[lib]), qm.int4_matmul_ref(x, packed, s, z, group))
    panel = libs["native"].isa == "avx512"                  # group 32, 64 columns: the panel path, any rows
    assert calls == ([(rows, 96)] if panel else [])         # group 48, 16 columns, the portable build: slices


def test_dispatch_takes_the_kernel_for_decode_rows_only(libs, monkeypatch):
    calls = []
    real = qm.int4_matmul_cpu
    monkeypatch.setattr(qm, "int4_matmul_cpu", lambda *a: calls.append(a[0].shape) or real(*a))
    packed, s, z = make(16, 64, 32)                         # 16 columns: no panel path
    for rows in (1, qm.CPU_INT4_MAX_ROWS, qm.CPU_INT4_MAX_ROWS + 1):
        x = torch.randn(rows, 64)
        close(qm.int4_matmul(x, packed, s, z, 32, None, libs["native"]), qm.int4_matmul_ref(x, packed, s, z, 32))
    qm.int4_matmul(torch.randn(2, 64, dtype=torch.float16), packed, s, z, 32, None, libs["native"])   # the old path
    qm.int4_matmul(torch.randn(3, 64, dtype=torch.bfloat16), packed, s, z, 32, None, libs["native"])  # widened
    qm.int4_matmul(torch.randn(qm.BF16_KERNEL_ROWS + 1, 64, dtype=torch.bfloat16), packed, s, z, 32, None,
                   libs["native"])                                            # past BF16_KERNEL_ROWS: the old path
    qm.int4_matmul(torch.randn(2, 64), packed, s, z, 32)                      # no library handed: the old path
    assert calls == [(1, 64), (qm.CPU_INT4_MAX_ROWS, 64), (3, 64)]


def _greedy(model_dir, mode, monkeypatch, **engine):
    monkeypatch.setenv("JOBRUNNER_CPU_INT4", mode)
    eng = Engine(EngineConfig(model=str(model_dir), dtype="float32", kv_cache_memory=4 * 2**20, **engine))
    served = [m.cpu_kernel for m in eng.rt.model.modules() if isinstance(m, Int4Linear)]
    reqs = [Request(str(i), p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(([5, 6, 7, 8], [11, 200, 3, 3, 64, 90, 17], [9] * 20, [1, 2]))]
    outs = {o.id: o.token_ids for o in eng.generate(reqs)}
    return [outs[str(i)] for i in range(len(reqs))], served


@pytest.mark.parametrize("scheme", ["int4", "int4-g128"])
def test_engine_int4_greedy_matches_the_old_path(tiny_hf_model_dir, monkeypatch, scheme):
    path = tiny_hf_model_dir("llama")
    old, served = _greedy(path, "off", monkeypatch, quantization=scheme)
    assert served and all(k is None for k in served)
    for mode, isa in (("auto", None), ("portable", "portable")):
        new, served = _greedy(path, mode, monkeypatch, quantization=scheme)
        assert all(k is not None for k in served) and (isa is None or served[0].isa == isa)
        assert new == old, mode


def test_float_model_builds_no_int4_library(tiny_hf_model_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("JOBRUNNER_CACHE", str(tmp_path))
    _, served = _greedy(tiny_hf_model_dir("llama"), "auto", monkeypatch)
    assert served == [] and not cb.kernel_library_path(cb.INT4, "native").exists()


def test_shipped_gptq_act_order_runs_the_kernel(tmp_path, monkeypatch):
    """GPTQ, asymmetric, desc_act, group 32: the engine's int4 linears take the kernel and greedy tokens stay
    those of the old path (which tests/test_shipped_checkpoints.py holds to transformers)."""
    pytest.importorskip("compressed_tensors")
    from quantized_checkpoints import make_gptq
    path = make_gptq(tmp_path / "ckpt", "llama", bits=4, group_size=32, desc_act=True, sym=False)
    old, _ = _greedy(path, "off", monkeypatch)
    new, served = _greedy(path, "auto", monkeypatch)
    assert served and all(k is not None for k in served) and new == old


def test_no_compiler_warns_and_keeps_the_old_path(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("JOBRUNNER_CACHE", str(tmp_path))
    monkeypatch.setenv("JOBRUNNER_CPU_INT4", "auto")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    lin = Int4Linear(*make(8, 64, 32), 32, 64)
    model = torch.nn.Sequential(lin)
    with caplog.at_level(logging.WARNING, logger="jobrunner"):
        assert cb.attach_cpu_kernels(model)["int4"] == 0
    assert lin.cpu_kernel is None and "not available" in caplog.text and "no-such-cc" in caplog.text
    x = torch.randn(3, 64)
    close(lin(x), lin.forward_ref(x))


def test_library_kept_under_the_cache_root_by_variant(monkeypatch, tmp_path):
    monkeypatch.setenv("JOBRUNNER_CACHE", str(tmp_path))
    assert ci.int4_library_name("native") != ci.int4_library_name("portable")
    for mode, variant in (("auto", "native"), ("portable", "portable")):
        monkeypatch.setenv("JOBRUNNER_CPU_INT4", mode)
        lib = cb.kernel_library(cb.INT4)
        assert lib is not None and lib.path == cb.kernel_library_path(cb.INT4, variant) and lib.path.is_relative_to(tmp_path)
    monkeypatch.setenv("JOBRUNNER_CPU_INT4", "off")
    assert cb.kernel_library(cb.INT4) is None
    monkeypatch.setenv("JOBRUNNER_CPU_INT4", "fast")
    with pytest.raises(ValueError, match="JOBRUNNER_CPU_INT4"):
        cb.kernel_mode(cb.INT4)
