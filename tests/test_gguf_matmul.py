"""kernels/matmul/gguf_matmul.py: GGUF blocks (Q4_0, Q4_1, Q8_0 as shipped) times int8 activations."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from jobrunner.engine.load.gguf import RawTensor, dequantize
from jobrunner.engine.quant import formats
from jobrunner.kernels.matmul import gguf_matmul as gm

# float32 output of a float32 sum over blocks; bfloat16 rounds the output once (8 bits of mantissa)
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1e-2)}


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def _raw(w: torch.Tensor, qtype: str) -> RawTensor:
    import gguf
    q = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[qtype])
    return RawTensor("w", qtype, tuple(w.shape), np.ascontiguousarray(q.view(np.uint8).reshape(w.shape[0], -1)))


def _blocks(n: int, k: int, qtype: str, gen):
    """(q, d, m) of a random [n, k] weight quantized to qtype, and the raw tensor it came from."""
    raw = _raw(torch.randn(n, k, generator=gen) * 0.05, qtype)
    if qtype == "Q8_0":
        return gm.gguf_weight_from_int8(*formats.int8_from_gguf([raw])), raw
    return gm.gguf_weight_from_int4(*formats.int4_from_gguf([raw]), k), raw


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocks_dequantize_as_gguf_does(qtype, gen):
    pytest.importorskip("gguf")
    (q, d, m), raw = _blocks(7, 96, qtype, gen)
    assert q.dtype == torch.int8 and d.shape == m.shape == (7, 3)
    assert torch.equal(gm.gguf_dequantize(q, d, m), dequantize(raw.data, qtype, raw.shape))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("m_tokens,n,k", [(1, 1, 32), (3, 5, 96), (17, 33, 160), (2, 48, 64)])
def test_block_path_matches_ref(m_tokens, n, k, qtype, dtype, gen):
    pytest.importorskip("gguf")
    (q, d, m), _ = _blocks(n, k, qtype, gen)
    x = torch.randn(m_tokens, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen)
    y = gm.gguf_int8_matmul(x, q, d, m, bias)
    assert y.dtype == dtype and y.shape == (m_tokens, n)
    torch.testing.assert_close(y, gm.gguf_int8_matmul_ref(x, q, d, m, bias), **TOL[dtype])


def test_leading_dims_and_token_independence(gen):
    pytest.importorskip("gguf")
    (q, d, m), _ = _blocks(24, 128, "Q4_1", gen)
    x = torch.randn(2, 5, 128, generator=gen)
    y = gm.gguf_int8_matmul(x, q, d, m)
    assert y.shape == (2, 5, 24)
    # per-token (and per-block) activation scales: a row's result does not depend on its batch mates
    torch.testing.assert_close(y[1, 3], gm.gguf_int8_matmul(x[1, 3:4], q, d, m)[0], atol=0, rtol=0)


def test_int8_activations_stay_close_to_float(gen):
    """Q8_1-style activations (8 bits per block of 32) cost well under a percent against float x
    on the same (dequantized) weight."""
    pytest.importorskip("gguf")
    (q, d, m), _ = _blocks(64, 576, "Q4_1", gen)
    x = torch.randn(16, 576, generator=gen)
    ref = gm.gguf_float_matmul_ref(x, q, d, m)
    y = gm.gguf_int8_matmul_ref(x, q, d, m)
    assert (y - ref).norm() / ref.norm() < 0.01


def test_block_quantization_round_trip(gen):
    x = torch.randn(3, 64, generator=gen)
    x[1, :32] = 0.0                                    # an all-zero block keeps a finite scale
    qx, dx = gm.quantize_blocks_ref(x)
    assert qx.dtype == torch.int8 and dx.shape == (3, 2) and qx.abs().max() <= 127
    back = qx.float().view(3, 2, 32) * dx[..., None]
    assert ((back.view(3, 64) - x).abs() <= dx.repeat_interleave(32, 1) / 2 + 1e-7).all()
    assert torch.equal(qx[1, :32], torch.zeros(32, dtype=torch.int8))


def test_inputs_are_checked(gen):
    q = torch.zeros(4, 64, dtype=torch.int8)
    d = m = torch.ones(4, 2)
    with pytest.raises(ValueError, match="multiple of 32"):
        gm.gguf_int8_matmul(torch.zeros(1, 48), q[:, :48], d, m)
    with pytest.raises(ValueError, match="d and m"):
        gm.gguf_int8_matmul(torch.zeros(1, 64), q, d[:, :1], m)
    with pytest.raises(ValueError, match="x must be float"):
        gm.gguf_int8_matmul(torch.zeros(1, 64, dtype=torch.int8), q, d, m)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_0", "Q8_0"])
def test_tiny_gguf_model_runs_on_its_blocks_times_int8_activations(tiny_gguf_path, qtype):
    """End to end: a tiny GGUF model whose linears (and, for Q8_0, the lm_head) run as their blocks as
    stored times int8 activations (benchmarks.gguf_matmul_bench.Q4xQ8Linear, the quant report's
    "q4xq8") scores a text within 0.02 nats a token of the float model dequantized from the same file
    (mean 0.005), and its greedy tokens match float's on at least 4 of 6 prompts' first 4 tokens."""
    pytest.importorskip("gguf")
    from benchmarks.gguf_matmul_bench import Q4xQ8Linear, swap_to_q4xq8
    from jobrunner.engine.config.engine_config import EngineConfig
    from jobrunner.engine.core.engine import Engine
    from jobrunner.engine.load.loader import load_model_bundle
    from jobrunner.engine.quant import quantize_model
    from jobrunner.engine.api.request import Request, SamplingParams
    from jobrunner.engine.run.runtime import build_runtime
    bundle = load_model_bundle(str(tiny_gguf_path("llama", qtype)))
    cfg = EngineConfig(model="unused", kv_cache_memory=1 << 20)
    float_engine = Engine(cfg, runtime=build_runtime(cfg, bundle))
    rt = build_runtime(cfg, bundle)
    quantize_model(rt.model, "int4" if qtype.startswith("Q4") else "int8", bundle,
                   quantize_lm_head=qtype == "Q8_0")      # the tiny Q4_x file stores its embedding in Q4_x too
    layers = 4 * len(rt.model.layers)
    assert swap_to_q4xq8(rt.model) == layers + (qtype == "Q8_0")
    assert isinstance(rt.model.layers[0].mlp.down_proj, Q4xQ8Linear)
    engine = Engine(cfg, runtime=rt)

    def score(e, ids):
        return torch.tensor(e.generate([Request("s", ids, score_from=1)])[0].prompt_logprobs)

    ids = list(range(3, 40))
    diff = (score(engine, ids) - score(float_engine, ids)).abs()
    assert diff.max() < 0.02 and diff.mean() < 0.005, (diff.max(), diff.mean())   # measured: 0.0044, 0.0009
    prompts = [[5 + i, 17 + 3 * i, 9, 30 - i] for i in range(6)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    got = engine.generate([Request(str(i), p, params) for i, p in enumerate(prompts)])
    want = float_engine.generate([Request(str(i), p, params) for i, p in enumerate(prompts)])
    assert sum(a.token_ids == b.token_ids for a, b in zip(got, want)) >= 4


def test_benchmark_runs_every_candidate_against_float(tmp_path):
    """benchmarks/gguf_matmul_bench.py on one small layer: the candidates run and land near float32
    (int8 activations: within 3%; exact-weight paths: float rounding)."""
    from benchmarks import gguf_matmul_bench as bench
    out = tmp_path / "bench.md"
    bench.main(["--shapes", "o", "--m", "3", "--budget", "0.001", "--out", str(out),
                "--only", "w8a8-fbgemm,int4,int4pack,q4xq8-int_mm,q4xq8-fbgemm"])
    text = out.read_text()
    for label in ("f32", "w8a8-fbgemm", "int4", "int4pack", "q4xq8-int_mm", "q4xq8-fbgemm"):
        assert f" {label} " in text.splitlines()[2]
    errors = dict(item.strip().rsplit(" ", 1) for item in text.rsplit("f32:", 1)[1].replace(
        "Largest relative error against", "").split(","))
    assert all(float(e) < 0.03 for e in errors.values()), errors
