"""Quantization: weight transforms, quantized matmuls against their references, the module swap,
GGUF blocks loaded without a float round trip, and the default model end to end (slow).

Triton kernels run in the interpreter on CPU tensors (float16, float32); the `cuda` cases run
on a GPU when there is one.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from jobrunner.engine.config.engine_config import ConfigError, EngineConfig  # noqa: E402
from jobrunner.engine.load.gguf import RawTensor, dequantize  # noqa: E402
from jobrunner.engine.quant import Fp8Linear, Int4Linear, Int8Linear, QuantEmbedding, W8A8Linear, check_quantization, parse_scheme, quantize_model, w8a8_backend
from jobrunner.engine.quant import formats  # noqa: E402
from jobrunner.kernels.matmul import quant_matmul as qm  # noqa: E402

from tests.kernel_cases import HAS_CUDA, device_dtype_cases  # noqa: E402

CASES = device_dtype_cases(cuda_fp32=False)
# Kernel vs reference: the same dequantized weights, float32 accumulation on both sides; the
# reference's matmul may round differently in float16/bfloat16.
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=5e-3),
       torch.bfloat16: dict(atol=1e-1, rtol=2e-2)}


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def randn(*shape, gen, scale=1.0):
    return torch.randn(*shape, generator=gen) * scale


# ----------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("n,k,group", [(5, 37, None), (67, 96, 32), (3, 128, 64)], ids=str)
def test_int8_round_trip(n, k, group, gen):
    w = randn(n, k, gen=gen)
    w[0] = 0.0                                     # an all-zero row keeps a finite scale
    q, s = formats.quantize_int8(w, group)
    assert q.dtype == torch.int8 and q.shape == (n, k) and s.shape == (n, k // (group or k))
    assert q.abs().max() <= 127
    back = qm.dequantize_int8(q, s)
    bound = s.repeat_interleave(group or k, dim=1) / 2 + 1e-7
    assert (back - w).abs().le(bound).all()
    assert torch.equal(back[0], torch.zeros(k))


def test_int8_narrow_range_for_w8a8(gen):
    q, s = formats.quantize_int8(randn(9, 50, gen=gen), qmax=63)
    assert q.abs().max() == 63


@pytest.mark.parametrize("n,k,group", [(5, 64, 32), (7, 40, 32), (3, 200, 64), (2, 128, 128)], ids=str)
def test_int4_round_trip(n, k, group, gen):
    w = randn(n, k, gen=gen, scale=0.05) + 0.01
    w[1, :group] = 0.3                            # a constant group
    packed, s, z = formats.quantize_int4(w, group)
    kp = -(-k // group) * group
    assert packed.dtype == torch.uint8 and packed.shape == (n, kp // 2)
    assert s.dtype == z.dtype == torch.float16 and s.shape == z.shape == (n, kp // group)
    back = qm.dequantize_int4(packed, s, z, group, k)
    assert back.shape == (n, k)
    step = s.float().repeat_interleave(group, dim=1)[:, :k]
    # half a step, plus float16 rounding of the stored zero (clamped values at the group edges)
    bound = step / 2 + w.abs().max() * 2 ** -10
    assert (back - w).abs().le(bound).all()
    assert torch.equal(back[1, :group], torch.full((group,), 0.3).half().float())


def test_int4_pack_order_matches_ggml(gen):
    q = torch.randint(0, 16, (3, 64), generator=gen)
    packed = qm.pack_int4(q, 32)
    assert torch.equal(qm.unpack_int4(packed, 32), q.to(torch.uint8))
    # byte j of group g: element gG + j in the low nibble, gG + G/2 + j in the high nibble
    assert int(packed[0, 16 + 5]) == int(q[0, 32 + 5]) | (int(q[0, 32 + 16 + 5]) << 4)


def test_fp8_round_trip(gen):
    w = randn(6, 48, gen=gen)
    q, s = formats.quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (6, 1)
    back = q.float() * s
    # e4m3: 3 mantissa bits, relative error <= 2^-4; tiny values fall into subnormals
    assert (back - w).abs().le(w.abs() * 2 ** -4 + s * 2 ** -9).all()


# ----------------------------------------------------------------------------- GGUF blocks

def _raw(w: torch.Tensor, qtype: str, name: str = "w") -> RawTensor:
    import gguf
    q = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[qtype])
    return RawTensor(name, qtype, tuple(w.shape), np.ascontiguousarray(q.view(np.uint8).reshape(w.shape[0], -1)))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_gguf_int4_blocks_load_bit_exact(qtype, gen):
    pytest.importorskip("gguf")
    a, b = _raw(randn(6, 96, gen=gen), qtype), _raw(randn(3, 96, gen=gen, scale=3.0), qtype)
    packed, s, z = formats.int4_from_gguf([a, b])            # fused rows, like q/k/v -> qkv
    assert packed.shape == (9, 48) and s.shape == z.shape == (9, 3) and s.dtype == torch.float16
    expected = torch.cat([dequantize(r.data, qtype, r.shape) for r in (a, b)])
    assert torch.equal(qm.dequantize_int4(packed, s, z, 32), expected)


def test_gguf_q8_0_loads_bit_exact(gen):
    pytest.importorskip("gguf")
    r = _raw(randn(5, 64, gen=gen), "Q8_0")
    q, s = formats.int8_from_gguf([r])
    assert q.shape == (5, 64) and s.shape == (5, 2)
    assert torch.equal(qm.dequantize_int8(q, s), dequantize(r.data, "Q8_0", r.shape))


# ----------------------------------------------------------------------------- matmuls vs references

def _int8_weights(n, k, group, gen, device="cpu"):
    q, s = formats.quantize_int8(randn(n, k, gen=gen, scale=0.1), group)
    return q.to(device), s.to(device)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("m,n,k,group", [(1, 67, 37, None), (33, 130, 96, 32), (7, 5, 64, 64), (2, 19, 160, None)],
                         ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_int8_triton_matches_ref(device, dtype, m, n, k, group, bias, gen):
    from jobrunner.kernels.matmul.quant_matmul_triton import int8_matmul_triton
    q, s = _int8_weights(n, k, group, gen, device)
    x = randn(m, k, gen=gen).to(device, dtype)
    b = randn(n, gen=gen).to(device, dtype) if bias else None
    y = int8_matmul_triton(x, q, s, b)
    assert y.dtype == dtype and y.shape == (m, n)
    torch.testing.assert_close(y, qm.int8_matmul_ref(x, q, s, b), **TOL[dtype])


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("m,n,k,group", [(1, 67, 40, 32), (33, 130, 128, 64), (5, 9, 256, 128), (17, 3, 100, 32)],
                         ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_int4_triton_matches_ref(device, dtype, m, n, k, group, bias, gen):
    from jobrunner.kernels.matmul.quant_matmul_triton import int4_matmul_triton
    packed, s, z = (t.to(device) for t in formats.quantize_int4(randn(n, k, gen=gen, scale=0.1), group))
    x = randn(m, k, gen=gen).to(device, dtype)
    b = randn(n, gen=gen).to(device, dtype) if bias else None
    y = int4_matmul_triton(x, packed, s, z, group, b)
    assert y.dtype == dtype and y.shape == (m, n)
    torch.testing.assert_close(y, qm.int4_matmul_ref(x, packed, s, z, group, b), **TOL[dtype])


def test_triton_launchers_check_inputs(gen):
    from jobrunner.kernels.matmul.quant_matmul_triton import int4_matmul_triton, int8_matmul_triton
    q, s = _int8_weights(8, 32, None, gen)
    with pytest.raises(ValueError, match="x: expected"):
        int8_matmul_triton(torch.randn(2, 31), q, s)
    with pytest.raises(ValueError, match="int8"):
        int8_matmul_triton(torch.randn(2, 32), q.float(), s)
    packed, s4, z4 = formats.quantize_int4(torch.randn(8, 64), 32)
    with pytest.raises(ValueError, match="bytes a row"):
        int4_matmul_triton(torch.randn(2, 100), packed, s4, z4, 32)


@pytest.mark.parametrize("m,n,k,group", [(1, 67, 37, None), (9, 3000, 576, None), (4, 2100, 512, 32)], ids=str)
def test_int8_cpu_path_matches_ref(m, n, k, group, gen):
    """The CPU fast path (output scaling, or row slices for big layers) against the reference."""
    q, s = _int8_weights(n, k, group, gen)
    x, b = randn(2, m, k, gen=gen), randn(n, gen=gen)
    torch.testing.assert_close(qm.int8_matmul(x, q, s, b), qm.int8_matmul_ref(x, q, s, b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("m,n,k,group", [(1, 67, 40, 32), (9, 2100, 512, 64)], ids=str)
def test_int4_cpu_path_matches_ref(m, n, k, group, gen):
    packed, s, z = formats.quantize_int4(randn(n, k, gen=gen, scale=0.1), group)
    x = randn(m, k, gen=gen)
    torch.testing.assert_close(qm.int4_matmul(x, packed, s, z, group), qm.int4_matmul_ref(x, packed, s, z, group),
                               atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- w8a8

def _w8a8(n, k, gen, backend, qmax=127, bias=True):
    q, s = formats.quantize_int8(randn(n, k, gen=gen, scale=0.05), qmax=qmax)
    return W8A8Linear(q, s, randn(n, gen=gen) if bias else None, backend=backend)


@pytest.mark.parametrize("m,n,k", [(1, 67, 37), (33, 130, 96), (70, 9, 1536)], ids=str)
def test_w8a8_int_mm_is_exact_per_token(m, n, k, gen):
    backend, qmax = w8a8_backend(torch.device("cpu"))
    if backend != "int_mm":
        pytest.skip(f"torch._int_mm is not exact here (backend {backend})")
    lin = _w8a8(n, k, gen, "int_mm", qmax)
    x = randn(m, k, gen=gen) * 3
    x[0, 0] = 40.0                                  # an outlier token: other rows must not notice
    y = lin(x)
    # exact int32 accumulation: equal to the float64 reference up to the float32 epilogue
    torch.testing.assert_close(y, lin.forward_ref(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y[1:], lin(x[1:]), atol=0, rtol=0)   # per token: batch mates don't matter


@pytest.mark.parametrize("reduce_range", [True, False], ids=["7-bit", "8-bit"])
def test_w8a8_fbgemm_matches_per_batch_ref(gen, reduce_range):
    lin = _w8a8(130, 96, gen, "fbgemm")
    if not reduce_range and not qm.fbgemm_full_range():
        pytest.skip("fbgemm's 8-bit activations saturate on this CPU (no VNNI)")
    lin.reduce_range = reduce_range
    x = randn(7, 96, gen=gen)
    x[3] *= 30                                      # one row far larger than the others
    y, ref = lin(x), lin.forward_ref(x)
    assert lin.qweight.shape == (130, 96) and lin.qweight.dtype == torch.int8   # unpacked on demand
    # up to fbgemm's float32 rounding: a value on a rounding tie lands one level over, a step of its row
    row_error = (y - ref).abs().amax(-1) / ref.abs().amax(-1)
    assert float(row_error.max()) < 0.02, row_error
    # its bytes are accounted by a placeholder buffer
    assert lin.packed_nbytes.numel() >= 130 * 96


def test_fbgemm_row_scales_keep_small_rows_precise_beside_a_large_one(gen):
    """One scale for the whole batch costs the small rows their precision next to a large row; each row
    scaled to max |x| = 1 first keeps them within the per-token error."""
    w, x = randn(64, 256, gen=gen, scale=0.05), randn(16, 256, gen=gen)
    x[0] *= 100
    q, s = formats.quantize_int8(w)
    ref = (x @ w.t())[1:]

    def error(row_scaled):
        y = qm.w8a8_per_batch_ref(x, q, s, row_scaled=row_scaled)[1:]
        return float((y - ref).norm() / ref.norm())
    assert error(row_scaled=True) < 0.03 < 0.3 < error(row_scaled=False)


def test_fbgemm_full_range_probe_agrees_with_the_cpu():
    """VNNI CPUs take 8-bit activations exactly; AVX2 ones saturate and must keep reduce_range."""
    from jobrunner.pipeline.precision import VNNI_FLAGS, cpu_flags
    if any(f in cpu_flags() for f in VNNI_FLAGS):
        assert qm.fbgemm_full_range()


def test_w8a8_error_against_float(gen):
    w, x = randn(64, 256, gen=gen, scale=0.05), randn(16, 256, gen=gen)
    q, s = formats.quantize_int8(w)
    ref = x @ w.t()
    y = qm.w8a8_matmul_ref(x, q, s)
    assert (y - ref).norm() / ref.norm() < 0.02      # ~0.7 % from each side


def test_w8a8_backend_probe_on_cpus_without_vnni():
    """oneDNN limited to AVX2 (as on CPUs without VNNI) saturates full-range int8 products: the
    probe must notice and pick 7-bit weights (exact there) or fbgemm."""
    code = ("import torch; from jobrunner.engine.quant import w8a8_backend; from jobrunner.kernels.matmul import quant_matmul as qm;"
            "b, qmax = w8a8_backend(torch.device('cpu')); print(b, qmax, qm.int_mm_exact(127))")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    backend, qmax, exact127 = out.stdout.split()
    if exact127 == "True":
        pytest.skip("this torch build's int8 GEMM does not saturate under AVX2")
    assert (backend, qmax) in (("int_mm", "63"), ("fbgemm", "127"))


# ----------------------------------------------------------------------------- fp8

def test_fp8_refused_off_cuda_before_any_work(tiny_hf_model_dir):
    with pytest.raises(ConfigError, match="fp8 needs a CUDA GPU"):
        check_quantization("fp8", "cpu")
    from jobrunner.engine.core.engine import Engine
    from jobrunner.engine.load.loader import load_model_bundle
    from jobrunner.engine.run.runtime import build_model
    model = build_model(load_model_bundle(str(tiny_hf_model_dir("llama"))), torch.device("cpu"), torch.float32)
    before = model.layers[0].mlp.down_proj
    with pytest.raises(ConfigError, match="fp8"):
        quantize_model(model, "fp8")
    assert model.layers[0].mlp.down_proj is before
    # the engine refuses before loading: a model path that does not exist is never opened
    with pytest.raises(ConfigError, match="fp8"):
        Engine(EngineConfig(model="/nonexistent/model", quantization="fp8", device="cpu"))


def test_fp8_linear_reference(gen):
    w, x = randn(32, 64, gen=gen, scale=0.05), randn(5, 64, gen=gen)
    lin = Fp8Linear(*formats.quantize_fp8(w))
    y = lin(x)                                    # on CPU: the reference
    ref = x @ w.t()
    assert (y - ref).norm() / ref.norm() < 0.06
    torch.testing.assert_close(y, lin.forward_ref(x))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability() < (8, 9), reason="needs CUDA >= 8.9")
def test_fp8_scaled_mm_matches_ref(gen):
    w, x = randn(256, 512, gen=gen, scale=0.05), randn(33, 512, gen=gen)
    lin = Fp8Linear(*formats.quantize_fp8(w), rowwise=torch.cuda.get_device_capability() >= (9, 0)).cuda()
    xc = x.cuda().bfloat16()
    torch.testing.assert_close(lin(xc).float(), lin.forward_ref(xc).float(), atol=5e-2, rtol=2e-2)


# ----------------------------------------------------------------------------- schemes and the model swap

def test_parse_scheme():
    assert parse_scheme("int4") == ("int4", 32) and parse_scheme("int4-g128") == ("int4", 128)
    assert parse_scheme("w8a8") == ("w8a8", None)
    for bad in ("int3", "int4-g48", "int8-g32", "fp4"):
        with pytest.raises(ConfigError):
            parse_scheme(bad)


def _tiny_model(tiny_hf_model_dir, **kw):
    from jobrunner.engine.load.loader import load_model_bundle
    from jobrunner.engine.run.runtime import build_model
    bundle = load_model_bundle(str(tiny_hf_model_dir("llama", **kw)))
    return build_model(bundle, torch.device("cpu"), torch.float32), bundle


def _weight_bytes(model):
    from jobrunner.engine.run.runtime import _unique_tensors
    return sum(t.numel() * t.element_size() for t in _unique_tensors(model))


@pytest.mark.parametrize("scheme,cls", [("int8", Int8Linear), ("int4", Int4Linear), ("int4-g64", Int4Linear),
                                        ("w8a8", W8A8Linear)])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_quantize_model_swaps_modules(tiny_hf_model_dir, scheme, cls, tied):
    model, _ = _tiny_model(tiny_hf_model_dir, tie_word_embeddings=tied)
    float_bytes = _weight_bytes(model)
    ref = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    quantize_model(model, scheme)
    for layer in model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(lin, cls)
    assert isinstance(model.embed_tokens, QuantEmbedding)
    assert isinstance(model.lm_head, W8A8Linear if scheme == "w8a8" else Int8Linear)
    if tied:
        assert model.lm_head.qweight is model.embed_tokens.qweight
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    # every module's fast forward against its reference, and the weights near the float ones
    x = torch.randn(5, model.config.hidden_size)
    lin = model.layers[1].self_attn.qkv_proj
    torch.testing.assert_close(lin(x), lin.forward_ref(x), atol=1e-4, rtol=1e-4)
    w = ref["layers.1.self_attn.qkv_proj"]
    assert (lin.dequantize() - w).abs().max() < w.abs().max() * (0.1 if "int4" in scheme else 0.01)
    assert _weight_bytes(model) < float_bytes * 0.3


def test_quantized_engine_runs_tiny_model(tiny_hf_model_dir):
    from jobrunner.engine.core.engine import Engine
    from jobrunner.engine.api.request import Request, SamplingParams
    path = str(tiny_hf_model_dir("llama"))
    outs = {}
    for scheme in ("none", "int8", "int4", "w8a8"):
        engine = Engine(EngineConfig(model=path, quantization=scheme, kv_cache_memory=1 << 20))
        if scheme != "none":
            assert engine.rt.weight_bytes < outs["none"][1] * 0.3
        out = engine.generate([Request("a", [5, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True))])[0]
        outs[scheme] = (out.token_ids, engine.rt.weight_bytes)
        assert len(out.token_ids) == 6 and out.error is None


@pytest.mark.parametrize("arch", ["llama", "qwen2"])     # grouped-query attention; qwen2 adds a qkv bias
def test_smoothquant_folding_keeps_the_float_function(tiny_hf_model_dir, arch):
    from jobrunner.engine.core.engine import Engine
    from jobrunner.engine.load.loader import load_model_bundle
    from jobrunner.engine.quant import smooth
    from jobrunner.engine.run.runtime import build_runtime
    bundle = load_model_bundle(str(tiny_hf_model_dir(arch)))
    # smoothing runs on F.linear's dense weights, before any packing (engine/run/runtime.py quantizes first)
    cfg = EngineConfig(model="unused", kv_cache_memory=1 << 20, packed_weights=False)
    plain, smoothed = build_runtime(cfg, bundle), build_runtime(cfg, bundle)
    ids = smooth.calibration_ids(bundle.tokenizer)
    before = smooth.input_amax(smoothed.model, ids)
    smooth.smooth_model(smoothed.model, before)
    after = smooth.input_amax(smoothed.model, ids)
    norm = lambda rt: rt.model.layers[0].input_layernorm.weight  # noqa: E731
    assert not torch.equal(norm(plain), norm(smoothed))
    for key in before:      # the activations' channel ranges get flatter
        spread = lambda a: float(a.max() / a.clamp(min=1e-6).median())  # noqa: E731
        assert spread(after[key]) < spread(before[key]), key
    text = list(range(3, 60))
    torch.testing.assert_close(_score(Engine(cfg, runtime=smoothed), text), _score(Engine(cfg, runtime=plain), text),
                               atol=1e-4, rtol=1e-4)


def _score(engine, ids):
    from jobrunner.engine.api.request import Request
    return torch.tensor(engine.generate([Request("s", ids, score_from=1)])[0].prompt_logprobs)


@pytest.mark.parametrize("qtype,scheme", [("Q4_1", "int4"), ("Q4_0", "int4"), ("Q8_0", "int8")])
def test_tiny_gguf_blocks_give_float_logits(tiny_gguf_path, qtype, scheme):
    """GGUF Q4_0/Q4_1 -> int4 and Q8_0 -> int8 straight from the file's bytes: the quantized model
    computes what the float model dequantized from the same file computes."""
    pytest.importorskip("gguf")
    from jobrunner.engine.core.engine import Engine
    from jobrunner.engine.load.loader import load_model_bundle
    from jobrunner.engine.run.runtime import build_runtime
    bundle = load_model_bundle(str(tiny_gguf_path("llama", qtype)))
    cfg = EngineConfig(model="unused", kv_cache_memory=1 << 20)
    float_engine = Engine(cfg, runtime=build_runtime(cfg, bundle))
    rt = build_runtime(cfg, bundle)
    weights = {n: m.weight.detach().clone() for n, m in rt.model.named_modules() if isinstance(m, torch.nn.Linear)}
    # the tiny file stores embedding and lm_head in qtype too: leave them float for Q4_x
    quantize_model(rt.model, scheme, bundle, quantize_lm_head=qtype == "Q8_0")
    for name, w in weights.items():
        module = rt.model.get_submodule(name)
        if name != "lm_head" or qtype == "Q8_0":
            assert torch.equal(module.dequantize(), w), name     # bit-exact: no float round trip
    if qtype == "Q8_0":
        assert isinstance(rt.model.embed_tokens, QuantEmbedding)
    ids = list(range(3, 40))
    torch.testing.assert_close(_score(Engine(cfg, runtime=rt), ids), _score(float_engine, ids),
                               atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- the default model (slow)

# Chat questions, as jobs send them to this instruct model; greedy, stopping at its end-of-turn token.
QUESTIONS = ["What is the capital of France?", "Write a Python function that reverses a string.",
             "Name three primary colors.", "At what temperature does water boil?",
             "Give me a tip for learning a new language.", "Who was the first person on the Moon?",
             "Classify the sentiment of: 'I loved this movie!'", "Translate 'good morning' into Spanish."]


@pytest.fixture(scope="module")
def default_bundle(default_gguf_path):
    pytest.importorskip("gguf")
    from jobrunner.engine.load.loader import load_model_bundle
    return load_model_bundle(str(default_gguf_path))


@pytest.fixture(scope="module")
def default_runs(default_bundle):
    """scheme -> (weight_bytes, greedy token ids per prompt, logprobs of a scored text), one engine at a time."""
    from jobrunner.engine.core.engine import Engine
    from jobrunner.engine.api.request import Request, SamplingParams
    from jobrunner.engine.run.runtime import build_runtime
    tok = default_bundle.tokenizer
    text = tok.encode("Batch inference runs every row of a dataset through the model and writes the results "
                      "back, with token counts and timings, so a nightly job can be checked the next morning.")
    runs = {}
    threads = torch.get_num_threads()   # one thread: on a busy shared 2-core machine, two are several times slower
    for scheme in ("none", "int8", "int4"):
        cfg = EngineConfig(model="unused", quantization=scheme, kv_cache_memory=64 << 20, num_threads=1)
        engine = Engine(cfg, runtime=build_runtime(cfg, default_bundle))
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
                   for q in QUESTIONS]
        reqs = [Request(str(i), tok.encode(p), SamplingParams(max_tokens=16)) for i, p in enumerate(prompts)]
        greedy = [o.token_ids for o in engine.generate(reqs)]
        runs[scheme] = (engine.rt.weight_bytes, greedy, _score(engine, text))
        del engine
    torch.set_num_threads(threads)
    return runs


@pytest.mark.default_model
@pytest.mark.slow
def test_default_model_int4_is_the_gguf_file(default_runs):
    """The default model is Q4_1 (layers) + Q8_0 (tied embedding): int4 loads both as stored, so
    its logits are the float model's (dequantized from the same file) up to float rounding."""
    torch.testing.assert_close(default_runs["int4"][2], default_runs["none"][2], atol=2e-3, rtol=1e-3)
    assert default_runs["int4"][1] == default_runs["none"][1]


@pytest.mark.default_model
@pytest.mark.slow
def test_default_model_int8_keeps_greedy_output(default_runs):
    same = sum(a == b for a, b in zip(default_runs["int8"][1], default_runs["none"][1]))
    assert same >= 6, f"int8 greedy output equals float on only {same}/{len(QUESTIONS)} prompts"


@pytest.mark.default_model
@pytest.mark.slow
def test_default_model_weight_bytes(default_runs):
    float_bytes = default_runs["none"][0]
    assert default_runs["int8"][0] <= 0.3 * float_bytes
    assert default_runs["int4"][0] <= 0.2 * float_bytes


@pytest.mark.parametrize("scheme", ["int4", "int8", "w4a8"])
def test_layers_are_quantized_as_they_load(tiny_hf_model_dir, monkeypatch, scheme):
    """build_model quantizes each decoder layer as soon as its weights are in (issue 62 item 3: the float copies
    never all exist at once, so the peak follows the quantized bytes); the weights are those of quantizing the
    whole float model after loading."""
    from jobrunner.engine.load.loader import load_model_bundle
    from jobrunner.engine.quant import apply
    from jobrunner.engine.run.runtime import build_model

    path = str(tiny_hf_model_dir("llama", num_hidden_layers=3))
    bundle = load_model_bundle(path)
    read, at_quantize = [], []
    weights = bundle.weights
    monkeypatch.setattr(bundle, "weights", lambda: (read.append(n) or (n, t) for n, t in weights()))
    real = apply._quantize_layer
    monkeypatch.setattr(apply, "_quantize_layer", lambda m, i, q: at_quantize.append((i, len(read))) or real(m, i, q))
    streamed = build_model(bundle, torch.device("cpu"), torch.float32, 0, scheme)
    assert streamed.quantized_as_loaded and [i for i, _ in at_quantize] == sorted(i for i, _ in at_quantize)
    assert len(at_quantize) == 3 and all(n < len(read) for _, n in at_quantize[:-1])   # before the rest was read
    quantize_model(streamed, scheme, bundle, layers_done=True)

    whole = build_model(load_model_bundle(path), torch.device("cpu"), torch.float32, 0)
    assert not whole.quantized_as_loaded
    quantize_model(whole, scheme, load_model_bundle(path))
    for (name, a), (_, b) in zip(streamed.named_modules(), whole.named_modules()):
        if hasattr(a, "dequantize"):
            assert type(a) is type(b) and torch.equal(a.dequantize(), b.dequantize()), name
