"""The CPU w4a8 matmul (int4 weights x int8 activations, kernels/matmul/cpu_w4a8.py and .c) against its contract:
the torch reference on the original int4 layout (w4a8_matmul_ref, float32 rounding apart), exact integer sums
where the activations' quantization is known, the activations' quantization bit for bit, the weights' repacking
and its inverse, and the float matmul within what int8 activations allow.

Three builds: "native" (-march=native: the AVX-512 VNNI loop on this CPU where it has one), the same library told
to run its portable loop, and the "portable" build (no -march: the plain C loop whatever the CPU).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from jobrunner.engine.run import cpu_kernel_build as cb
from jobrunner.kernels.matmul import cpu_w4a8 as cw
from jobrunner.kernels.matmul import quant_matmul as qm
from tests.cpu_builds import build_variants

SHAPES = ((40, 100), (40, 96), (19, 200), (130, 64))     # (N, K): N off the 16-column blocks, K off the groups
BUILDS = ("native", "portable", "native-portable-loop")


@pytest.fixture(scope="session")
def libs(tmp_path_factory) -> dict[str, cw.W4A8Library]:
    out = build_variants(cb.W4A8, tmp_path_factory)
    out["native-portable-loop"] = cw.W4A8Library(out["native"].path, portable=True)
    return out


def make(n, k, group, scale_dtype=torch.float16, zeros=True, seed=0):
    """Random int4 weights in our layout: (packed, scales, zeros or None)."""
    g = torch.Generator().manual_seed(seed)
    kp = -(-k // group) * group
    q = torch.randint(0, 16, (n, kp), dtype=torch.uint8, generator=g)
    s = (torch.rand(n, kp // group, generator=g) * 0.1 + 0.01).to(scale_dtype)
    z = (torch.randn(n, kp // group, generator=g) * 0.1).to(scale_dtype) if zeros else None
    return qm.pack_int4(q, group), s, z


def close(got, ref):
    """The kernel's documented tolerance against the reference: relative to the output's largest magnitude."""
    scale = ref.abs().max().clamp(min=1.0)
    assert got.shape == ref.shape
    assert (got - ref).abs().max() <= cw.ATOL * scale + cw.RTOL * ref.abs().max(), (got - ref).abs().max()


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 3, 16, 64])
def test_kernel_matches_the_reference(libs, build, group, m):
    lib = libs[build]
    for i, (n, k) in enumerate(SHAPES):
        scale_dtype = cw.SCALE_DTYPES[i % 2]
        for zeros in (True, False):
            packed, s, z = make(n, k, group, scale_dtype, zeros, seed=n + k)
            w = cw.w4a8_pack(packed, s, z, group, k)
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k))
            b = torch.randn(n) if zeros else None
            close(cw.w4a8_matmul_cpu(x, w, b, lib), cw.w4a8_matmul_ref(x, packed, s, z, group, b))


def test_many_rows_quantized_by_the_threads(libs):
    """Past 32,768 activations the rows are quantized inside the parallel region (fewer: before it)."""
    packed, s, z = make(24, 704, 32)
    w = cw.w4a8_pack(packed, s, z, 32, 704)
    x = torch.randn(48, 704)
    for build in BUILDS:
        close(cw.w4a8_matmul_cpu(x, w, None, libs[build]), cw.w4a8_matmul_ref(x, packed, s, z, 32))


@pytest.mark.parametrize("group", [2, 6, 10, 16, 48])
def test_other_group_sizes(libs, group):
    """Multiples of 8 run the VNNI loop, other even sizes the portable loop; both builds, the same answer."""
    for k in (90, 95):
        packed, s, z = make(23, k, group, torch.float32)
        w = cw.w4a8_pack(packed, s, z, group, k)
        x = torch.randn(5, k)
        for build in BUILDS:
            close(cw.w4a8_matmul_cpu(x, w, None, libs[build]), cw.w4a8_matmul_ref(x, packed, s, z, group))


@pytest.mark.parametrize("build", BUILDS)
def test_integer_sums_are_exact(libs, build):
    """Integer activations whose every group holds +-127 quantize to themselves (inv = sa = 1); with power-of-two
    scales every term is exact in float32, so the output is the integer product, to the bit."""
    n, k, group = 37, 160, 32
    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    x = torch.randint(-127, 128, (20, k), generator=g)
    x.view(20, -1, group)[:, :, 5] = 127 * (1 - 2 * torch.randint(0, 2, (20, k // group), generator=g))
    s = torch.full((n, k // group), 0.125, dtype=torch.float16)
    packed = qm.pack_int4(q, group)
    for m in (1, 4, 20):
        xm = x[:m]
        free = cw.w4a8_matmul_cpu(xm.float(), cw.w4a8_pack(packed, s, torch.zeros_like(s), group, k), None, libs[build])
        assert torch.equal(free, (xm @ q.long().t()).float() * 0.125)
        sym = cw.w4a8_matmul_cpu(xm.float(), cw.w4a8_pack(packed, s, None, group, k), None, libs[build])
        assert torch.equal(sym, (xm @ (q.long() - 8).t()).float() * 0.125)


@pytest.mark.parametrize("build", BUILDS)
def test_quantization_bits_match_the_reference(libs, build):
    """xq and sa bit for bit (half to even at the ties, a group of zeros, K off the groups); xsum to rounding."""
    for k, group in ((100, 32), (96, 48), (90, 10)):
        x = torch.randn(9, k) * torch.logspace(-3, 3, 9)[:, None]
        x[1, :group] = 0.0                                       # amax 0: xq 0, sa 0
        x[2, :group] = torch.tensor([127.0, 2.5, 3.5, -2.5, -0.5, 0.5, 1.5, -1.5] * (group // 8)
                                    + [0.0] * (group % 8))       # inv 1: the ties round to even
        x[3] = 1e-30                                              # tiny, not zero
        got = cw.w4a8_quantize_cpu(x, group, libs[build])
        ref = cw.quantize_activations_ref(x, group)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=1e-5 * x.abs().max().item())
        assert got[0][2, 1:4].tolist() == [2, 4, -2] and got[1][1, 0] == 0 and not got[0][1, :group].any()


def test_zero_groups_strided_and_batched_rows(libs):
    packed, s, z = make(40, 100, 32)
    w = cw.w4a8_pack(packed, s, z, 32, 100)
    wide = torch.randn(2, 3, 150)
    wide[0, 1, 10:42] = 0.0                                      # one group of zeros
    wide[1, :, 42:74] = 0.0
    x = wide[..., 10:110]                                        # rows 150 apart: the kernel reads the row stride
    for build in BUILDS:
        got = cw.w4a8_matmul_cpu(x, w, None, libs[build])
        assert got.shape == (2, 3, 40)
        close(got, cw.w4a8_matmul_ref(x.contiguous(), packed, s, z, 32))
        one = wide[0, 1:2, 10:110]
        close(cw.w4a8_matmul_cpu(one, w, None, libs[build]), cw.w4a8_matmul_ref(one, packed, s, z, 32))
    assert cw.w4a8_matmul_cpu(torch.zeros(0, 100), w, None, libs["native"]).shape == (0, 40)


@pytest.mark.parametrize("group", [32, 128])
def test_error_against_float_is_what_int8_activations_allow(libs, group):
    """Against the dequantized weight in float64 the one difference is the activations' rounding (1/254 of each
    group's largest |x| at most): ~1% of the output's scale, where a layout bug would be ~100%."""
    n, k = 72, 320
    packed, s, z = make(n, k, group, torch.float32)
    w = cw.w4a8_pack(packed, s, z, group, k)
    x = torch.randn(16, k)
    ref = F.linear(x.double(), qm.dequantize_int4(packed, s, z, group, k, torch.float64))
    for build in BUILDS:
        err = (cw.w4a8_matmul_cpu(x, w, None, libs[build]).double() - ref).abs().max()
        assert err <= 2e-2 * ref.abs().max(), err


def test_pack_unpack_round_trip():
    for n, k, group, dtype, zeros in ((40, 100, 32, torch.float16, True), (16, 64, 64, torch.float32, False),
                                      (23, 95, 10, torch.float32, True), (1, 2, 2, torch.float16, False)):
        packed, s, z = make(n, k, group, dtype, zeros)
        w = cw.w4a8_pack(packed, s, z, group, k)
        assert w.qweight.shape == (-(-n // 16), -(-packed.shape[1] * 2 // 8), 64) and w.scales.dtype == dtype
        p2, s2, z2 = cw.w4a8_unpack(w)
        assert torch.equal(p2, packed) and torch.equal(s2, s) and (z2 is None) == (z is None)
        assert z is None or torch.equal(z2, z)
        rows, kp = -(-n // 16) * 16, -(-packed.shape[1] * 2 // 8) * 8        # padded to blocks and chunks
        per_row = kp // 2 + s.shape[1] * s.element_size() * (1 if z is None else 2)
        assert w.nbytes == rows * per_row                      # the int4 form's bytes but for the padding
    packed, s, z = make(64, 576, 32)
    int4_bytes = packed.numel() + 2 * s.numel() * s.element_size()
    assert cw.w4a8_pack(packed, s, z, 32, 576).nbytes == int4_bytes


def test_layout_one_chunk():
    """Column c's k = 0..3 in byte 4 c's low nibbles, k = 4..7 in their high nibbles."""
    q = torch.arange(16 * 8, dtype=torch.uint8).view(16, 8) % 16
    w = cw.w4a8_pack(qm.pack_int4(q, 8), torch.ones(16, 1), None, 8, 8)
    chunk = w.qweight[0, 0].view(16, 4)
    assert torch.equal(chunk & 15, q[:, :4]) and torch.equal(chunk >> 4, q[:, 4:])


def test_builds_run_the_loop_they_say(libs):
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text() if cpuinfo.exists() else ""
    assert libs["portable"].isa == "portable" and libs["native-portable-loop"].isa == "portable"
    assert libs["native"].isa == ("avx512_vnni" if " avx512_vnni" in flags and " avx512bw" in flags else "portable")
    assert cw.w4a8_library_name("native") != cw.w4a8_library_name("portable")
    assert libs["native"].covers(torch.zeros(2, 3)) and not libs["native"].covers(torch.zeros(2, 3).double())


def test_refuses_what_the_kernel_cannot_take(libs):
    packed, s, z = make(8, 64, 32)
    w = cw.w4a8_pack(packed, s, z, 32, 64)
    with pytest.raises(TypeError, match="float32"):
        cw.w4a8_matmul_cpu(torch.randn(2, 64, dtype=torch.bfloat16), w, None, libs["native"])
    with pytest.raises(ValueError, match="in_features"):
        cw.w4a8_matmul_cpu(torch.randn(2, 60), w, None, libs["native"])
    with pytest.raises(ValueError, match="rounded up"):
        cw.w4a8_pack(packed, s, z, 32, 30)                       # K 30: Kp would be 32
    with pytest.raises(TypeError, match="zeros"):
        cw.w4a8_pack(packed, s, z.float(), 32, 64)
    with pytest.raises(ValueError, match="w4a8_pack's form"):
        cw.W4A8Weights(w.qweight, w.scales[:, :1], None, 8, 64, 32)
    with pytest.raises(ValueError, match="w4a8_pack's form"):
        cw.W4A8Weights(w.qweight, w.scales.double(), None, 8, 64, 32)
