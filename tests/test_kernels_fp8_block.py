"""The FP8 block-scaled GEMM (kernels/matmul/fp8_block_triton.py) against kernels.shipped_quant's reference.

CPU tensors run in Triton's interpreter (see tests/test_kernels.py). The interpreter loads float8 and
dots it correctly, but its float -> float8 cast truncates and loses carries and its float32 ->
bfloat16 cast truncates; the kernel encodes levels and rounds bfloat16 with integer ops there, so
the interpreter runs the same arithmetic as the GPU (the levels are checked bit for bit against
torch's casts below). The `cuda` cases repeat the comparisons on a GPU, bigger shapes included,
and also force the integer-encoding / float16-dot path of GPUs before sm_89.

Tolerances are bounds, elementwise, not fitted constants. With u the unit roundoff of x's dtype
(2^-24 float32, 2^-8 bfloat16, 2^-11 float16), gamma = (K + 8) * 2^-24 (float32 sums of at most K
exact fp8 products, plus the block scalings and the bias) and |xw| = |x_deq| @ |W_deq|^T:
  * against the exact float64 product of the same levels (torch's), y is its float32 accumulator
    (within gamma |xw|) rounded once:      |y - exact| <= u |exact| + (1 + u) gamma |xw|
  * against fp8_weight_matmul_ref, which rounds the dequantized x and W to x's dtype (u each) and
    its output (u), and sums in float32:    |y - ref| <= 2 * ((2u + 2 gamma) |xw| + 2u |ref|)
    (the factor 2: the reference's summation order and its library's internals are not ours).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from jobrunner.kernels.matmul.shipped_quant import FP8_MAX, _nonzero, fake_quantize_fp8, fp8_weight_matmul, fp8_weight_matmul_ref
from jobrunner.kernels.matmul.fp8_block_triton import _fp8_block_matmul, fp8_block_matmul_triton, quantize_act_fp8_triton

from tests.kernel_cases import HAS_CUDA, cuda_only  # noqa: E402

UNIT = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=cuda_only)]
# (M, N, K, block): aligned with M = 1; N and K not multiples of the block; bn neither a multiple of
# the kernel's BLOCK_N nor a power of two, bk = 96 (K steps of 32, groups masked to 96 of 128 lanes)
SHAPES = [(1, 256, 384, (128, 128)), (37, 200, 300, (128, 128)), (37, 100, 200, (48, 96))]


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(2024)


def block_weights(n, k, block, gen, device):
    """A float weight quantized as FP8_BLOCK checkpoints are: q [N, K] e4m3, scales [Nb, Kb] float32."""
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    w = F.pad(torch.randn(n, k, generator=gen) * 0.05, (0, kb * bk - k, 0, nb * bn - n)).view(nb, bn, kb, bk)
    s = w.abs().amax((1, 3)).clamp_min(1e-12) / FP8_MAX
    q = (w / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(nb * bn, kb * bk)[:n, :k].contiguous().to(device), s.float().to(device)


def activations(m, k, bk, dtype, gen, device):
    """Unit normal, one outlier column (groups get different scales), the first row's first group zero
    (its scale is eps), a row 1000x smaller than the rest."""
    x = torch.randn(m, k, generator=gen)
    x[:, 5] *= 30
    x[0, :bk] = 0
    if m > 2:
        x[2] *= 1e-3
    return x.to(device, dtype)


def torch_levels(x, group):
    """fake_quantize_fp8's levels and scales (its arithmetic, in x's dtype), K padded with zeros to a
    multiple of the group (which leaves every group's max and the products unchanged)."""
    m, k = x.shape
    kp = -(-k // group) * group
    xg = F.pad(x, (0, kp - k)).unflatten(-1, (kp // group, group))
    s = _nonzero(xg.abs().amax(-1, keepdim=True) / FP8_MAX)
    q = torch.clamp(xg / s, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    # the same as fake_quantize_fp8 itself, bit for bit
    assert torch.equal((q.to(x.dtype) * s).reshape(m, kp), fake_quantize_fp8(F.pad(x, (0, kp - k)), None, group))
    return q.reshape(m, kp)[:, :k], s.squeeze(-1)


def exact(x, qweight, scales, block, bias):
    """(y, |x||W|) in float64 from torch's levels: the product the kernel rounds once."""
    bn, bk = block
    n, k = qweight.shape
    q, s = torch_levels(x, bk)
    xd = q.double() * s.double().repeat_interleave(bk, 1)[:, :k]
    wd = qweight.double() * scales.double().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    y = xd @ wd.t()
    if bias is not None:
        y += bias.to(x.dtype).double()
    return y, xd.abs() @ wd.abs().t()


def reference(x, qweight, scales, block, bias):
    """fp8_weight_matmul_ref with dynamic per-group activations; K zero-padded to a multiple of bk
    (fake_quantize_fp8 needs whole groups; the padding changes no group's max and no product)."""
    k = x.shape[1]
    kp = -(-k // block[1]) * block[1]
    wq = F.pad(qweight.view(torch.uint8), (0, kp - k)).view(torch.float8_e4m3fn)
    return fp8_weight_matmul_ref(F.pad(x, (0, kp - k)), wq, scales, block, bias, act="dynamic", act_group=block[1])


def assert_within_bounds(y, x, qweight, scales, block, bias):
    dtype, k = x.dtype, x.shape[1]
    u, gamma = UNIT[dtype], (k + 8) * 2.0 ** -24
    y64 = y.double()
    ex, xw = exact(x, qweight, scales, block, bias)
    err = (y64 - ex).abs()
    bound = u * ex.abs() + (1 + u) * gamma * xw
    assert (err <= bound).all(), f"vs exact: worst excess {(err - bound).max().item():.3g}, max {err.max().item():.3g}"
    ref = reference(x, qweight, scales, block, bias).double()
    err = (y64 - ref).abs()
    bound = 2 * ((2 * u + 2 * gamma) * xw + 2 * u * ref.abs())
    assert (err <= bound).all(), f"vs ref: worst excess {(err - bound).max().item():.3g}, max {err.max().item():.3g}"


# ----------------------------------------------------------------------------- activation levels

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_act_levels_match_fake_quantize(device, dtype, gen):
    """Levels and scales bit for bit those of fake_quantize_fp8, a group past K included (K = 300)."""
    x = activations(37, 300, 128, dtype, gen, device)
    q, s = quantize_act_fp8_triton(x, 128)
    rq, rs = torch_levels(x, 128)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (37, 3)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s, rs.float())
    assert s[0, 0] == torch.finfo(dtype).eps                                       # the zero group


def _e4m3_probe_values():
    """Every finite e4m3 value, every midpoint between neighbours (ties: to even), a value just either
    side of each midpoint, both signs, values below the smallest subnormal: fp32, |v| <= 448."""
    levels = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()        # 0 .. 448
    mids = (levels[1:] + levels[:-1]) / 2
    near = torch.cat([mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9))])
    tiny = torch.tensor([2.0 ** -11, 2.0 ** -10, 2.0 ** -10 * 1.0001, 2.0 ** -6 * 0.99, 1e-30])
    v = torch.cat([levels, mids, near, tiny])
    return torch.cat([v, -v])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("soft", [False, True], ids=["native", "soft"])
def test_e4m3_encoding_rounds_like_torch(device, soft):
    """Each row leads with 448, so its scale is exactly 1 and the levels are the values' own casts."""
    v = _e4m3_probe_values()
    rows = -(-v.numel() // 127)
    x = torch.zeros(rows * 127)
    x[:v.numel()] = v
    x = torch.cat([torch.full((rows, 1), FP8_MAX), x.view(rows, 127)], 1).to(device)
    q, s = quantize_act_fp8_triton(x, 128, soft=soft or device == "cpu")
    assert (s == 1).all()
    assert torch.equal(q.view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8))


# ----------------------------------------------------------------------------- the GEMM

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,n,k,block", SHAPES, ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_matches_reference(device, dtype, m, n, k, block, with_bias, gen):
    qw, sc = block_weights(n, k, block, gen, device)
    x = activations(m, k, block[1], dtype, gen, device)
    bias = torch.randn(n, generator=gen).to(device, dtype) if with_bias else None
    y = fp8_block_matmul_triton(x, qw, sc, block, bias)
    assert y.dtype == dtype and y.shape == (m, n) and y.device == x.device
    assert_within_bounds(y, x, qw, sc, block, bias)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_float16_dot_path(device, dtype, gen):
    """The path of GPUs before sm_89: levels encoded with integer ops, fp8 bytes decoded to float16 / 256
    for a float16 dot. float32 bias on 16-bit x: the reference adds it rounded to x's dtype."""
    m, n, k, block = 37, 200, 300, (128, 128)
    qw, sc = block_weights(n, k, block, gen, device)
    x = activations(m, k, block[1], dtype, gen, device)
    bias = torch.randn(n, generator=gen).to(device)
    y = _fp8_block_matmul(x, qw, sc, block, bias, soft=True)
    assert_within_bounds(y, x, qw, sc, block, bias)


@pytest.mark.gpu
@cuda_only[1]
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 2048, 7168), (16, 1536, 2048), (300, 1536, 2048), (1000, 576, 7168)], ids=str)
def test_deepseek_shapes_cuda(dtype, m, n, k, gen):
    """DeepSeek-V3-like widths, 128 x 128 blocks, every tile size the launcher picks."""
    block = (128, 128)
    qw, sc = block_weights(n, k, block, gen, "cuda")
    x = activations(m, k, 128, dtype, gen, "cuda")
    bias = torch.randn(n, generator=gen).to("cuda", dtype)
    assert_within_bounds(fp8_block_matmul_triton(x, qw, sc, block, bias), x, qw, sc, block, bias)


# ----------------------------------------------------------------------------- dispatch and checks

def test_dispatch_passes_unquantized_x(monkeypatch, gen):
    """fp8_weight_matmul takes the kernel (JOBRUNNER_TRITON=1 on CPU) for dynamic groups of bk, before
    any fake quantization: the kernel gets x itself; other activation schemes keep the torch path."""
    import jobrunner.kernels.matmul.fp8_block_triton as fb
    seen = []
    real = fb.fp8_block_matmul_triton

    def spy(x2, *args):
        seen.append(x2)
        return real(x2, *args)

    monkeypatch.setattr(fb, "fp8_block_matmul_triton", spy)
    monkeypatch.setenv("JOBRUNNER_TRITON", "1")
    block = (128, 128)
    qw, sc = block_weights(64, 256, block, gen, "cpu")
    x = activations(6, 256, 128, torch.float32, gen, "cpu").view(2, 3, 256)
    y = fp8_weight_matmul(x, qw, sc, block, None, act="dynamic", act_group=128)
    assert len(seen) == 1 and torch.equal(seen[0], x.reshape(6, 256)) and y.shape == (2, 3, 64)
    assert_within_bounds(y.view(6, 64), x.view(6, 256), qw, sc, block, None)
    fp8_weight_matmul(x, qw, sc, block, None, act="dynamic", act_group=64)          # groups other than bk
    fp8_weight_matmul(x, qw, sc, block, None, act=None)                              # weight-only
    monkeypatch.setenv("JOBRUNNER_TRITON", "0")
    fp8_weight_matmul(x, qw, sc, block, None, act="dynamic", act_group=128)
    assert len(seen) == 1


def test_launcher_rejects_bad_inputs(gen):
    qw, sc = block_weights(64, 256, (128, 128), gen, "cpu")
    x = torch.randn(3, 256)
    cases = [
        (dict(x2=x.long()), "x2: dtype"),
        (dict(x2=torch.randn(3, 255)), "x2: expected"),
        (dict(qweight=qw.view(torch.uint8)), "qweight: float8_e4m3fn"),
        (dict(scales=sc[:, :1]), "scales: expected"),
        (dict(block=(128, 48), scales=torch.ones(1, 6)), "multiple of 32"),
        (dict(bias=torch.randn(63)), "bias: expected"),
    ]
    for change, msg in cases:
        args = dict(x2=x, qweight=qw, scales=sc, block=(128, 128), bias=None) | change
        with pytest.raises(ValueError, match=msg):
            fp8_block_matmul_triton(**args)
    assert fp8_block_matmul_triton(torch.randn(0, 256), qw, sc, (128, 128)).shape == (0, 64)


def _nvidia_toolchain() -> bool:
    base = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return all(os.path.exists(os.path.join(base, t)) for t in ("ptxas", "cuobjdump"))


# Compiled in a fresh process: with TRITON_INTERPRET set when triton.language was imported (this module
# sets it on CPU), the kernels' @triton.jit helpers are interpreter functions the compiler refuses.
_COMPILE_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from benchmarks.kernel_bench import cubin_resources
from jobrunner.kernels.matmul import fp8_block_triton as fb

def compile_(fn, types, constexprs, arch, warps):
    sig = {a: ("constexpr" if a in constexprs else types.get(a, "i32")) for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if sig[a].startswith("*") or a.startswith("stride") or a in ("N", "K")}
    k = triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs),
                       target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps, num_stages=3))
    return cubin_resources(k.asm["cubin"]), "mma" in k.asm["ptx"]

print("quant bf16 sm90", *compile_(fb._act_quant_kernel, dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32",
      eps="fp32"), dict(GROUP=128, BLOCK=128, ROWS=16, SOFT_FP8=False, SOFT_BF16=False), 90, 4))
for m, arch, soft in ((1, 90, False), (64, 90, False), (64, 80, True)):
    bm, bn, warps = fb._tiles(m)
    ptr = "*u8" if soft else "*fp8e4nv"
    print(f"gemm M<={m} sm{arch}", *compile_(fb._fp8_block_gemm_kernel, dict(a_ptr=ptr, as_ptr="*fp32", w_ptr=ptr,
          ws_ptr="*fp32", b_ptr="*bf16", y_ptr="*bf16"), dict(BN_Q=128, BK_Q=128, HAS_BIAS=True, FP16_DOT=soft,
          SOFT_BF16=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128), arch, warps))
"""


@pytest.mark.skipif(not _nvidia_toolchain(), reason="triton's bundled NVIDIA toolchain (ptxas, cuobjdump) is missing")
@pytest.mark.skipif(HAS_CUDA, reason="on a GPU the cuda cases compile and run the kernels for real")
def test_kernels_compile_for_hopper():
    """The interpreter skips the compiler: compile the fp8 kernels for sm_90 (native fp8 casts and dots)
    and the float16-dot GEMM for sm_80, no GPU needed; no register spills on sm_90. Strides and K, N are
    marked divisible by 16, as Triton specializes them at launch for real widths (without that the fp8
    tiles' loads do not vectorize, and spill)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    res = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], capture_output=True, text=True, env=env,
                         cwd=root, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 4, res.stdout
    for line in lines:                       # "<name> (registers, spill bytes) <uses mma>"
        regs, spill = (int(v) for v in line[line.index("(") + 1:line.index(")")].split(","))
        assert "sm90" not in line or spill == 0, line
        assert "gemm" not in line or line.endswith("True"), line           # the dot is a tensor-core mma
