"""Float32 and bfloat16 linears over weights packed for oneDNN (kernels/matmul/cpu_linear.py,
engine/run/packed_weights.py): float32 within its tolerance of F.linear at every row count, bfloat16 equal, in place of exactly the float32 nn.Linear modules,
a tied lm_head copied, greedy tokens as transformers', and the off switch giving F.linear's bits."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from jobrunner.engine.api.request import Request, SamplingParams
from jobrunner.kernels.ops import PackedLinear, pack_linear, packed_error, packing_available
from tests.tiny import engine_for, hf_greedy, hf_model, prompts

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN")


@pytest.mark.parametrize("rows", [1, 3, 16, 64, 200, 1000])
@pytest.mark.parametrize("shape,bias", [((576, 960), False), ((1536, 576), True), ((64, 320), False)])
def test_packed_within_the_float32_bound_of_the_exact_product(shape, bias, rows):
    g = torch.Generator().manual_seed(rows)
    lin = nn.Linear(*shape, bias=bias)
    x = torch.randn(rows, shape[0], generator=g)
    packed = pack_linear(lin, batch_hint=64)
    with torch.inference_mode():
        out = packed(x)
        assert out.shape == (rows, shape[1]) and out.dtype == torch.float32
        assert packed_error(out, x, lin.weight, lin.bias) <= 1
        assert packed_error(F.linear(x, lin.weight, lin.bias), x, lin.weight, lin.bias) <= 1     # MKL's order too


def test_the_packing_check_takes_a_sound_weight_and_refuses_a_wrong_product():
    """A 2048 x 16384 weight of int8 steps that the old, typical-error tolerance refused (its check came out at
    1.25x that tolerance; 0.006 of this bound) is packed; a wrong layout's product (columns read 16 apart) is not."""
    from jobrunner.engine.quant.formats import quantize_int8
    from jobrunner.kernels.ops import dequantize_int8
    q, s = quantize_int8(torch.randn(16384, 2048, generator=torch.Generator().manual_seed(0)) * 0.05, None)
    lin = nn.Linear(2048, 16384, bias=False)
    lin.weight.data = dequantize_int8(q, s)
    packed = pack_linear(lin)
    x = torch.randn(3, 2048)
    with torch.inference_mode():
        out = packed(x)
        assert packed_error(out, x, lin.weight, None) <= 1
        assert packed_error(F.linear(x, lin.weight.roll(16, dims=1)), x, lin.weight, None) > 100


@pytest.mark.parametrize("rows", [1, 16, 64, 300])
def test_bfloat16_packed_gives_f_linear_bits(rows):
    lin = nn.Linear(576, 1536, bias=False).to(torch.bfloat16)
    x = torch.randn(rows, 576).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(pack_linear(lin)(x), F.linear(x, lin.weight))


def test_bfloat16_engine_packs_and_matches_its_unpacked_run():
    hf = hf_model("llama")
    packed, plain = engine_for(hf, dtype="bfloat16"), engine_for(hf, dtype="bfloat16", packed_weights=False)
    assert packed.info.packed_weights and isinstance(packed.rt.model.lm_head, PackedLinear)
    p = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0)
    batch = [Request(str(i), ids, p) for i, ids in enumerate(prompts(5))]
    assert [o.token_ids for o in packed.generate(batch)] == [o.token_ids for o in plain.generate(batch)]


def test_packed_takes_any_leading_shape_and_strides():
    lin = nn.Linear(48, 40)
    packed = pack_linear(lin)
    x = torch.randn(3, 9, 48)[:, 2:7]                       # 3-D and not contiguous
    torch.testing.assert_close(packed(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def test_engine_packs_float32_linears_and_copies_a_tied_head():
    hf = hf_model("qwen2")                                   # tied embeddings
    eng = engine_for(hf)
    model = eng.rt.model
    assert eng.info.packed_weights
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    assert linears == [] and isinstance(model.lm_head, PackedLinear)
    assert model.embed_tokens.weight.layout == torch.strided          # lookups keep the dense rows
    plain = engine_for(hf, packed_weights=False)
    assert eng.info.weight_bytes - plain.info.weight_bytes == 320 * 64 * 4    # the head's copy, no more


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_tokens_equal_transformers_when_packed(arch):
    hf = hf_model(arch)
    eng = engine_for(hf)
    assert eng.info.packed_weights
    batch = prompts(3)
    p = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0)
    outs = eng.generate([Request(str(i), ids, p) for i, ids in enumerate(batch)])
    for ids, out in zip(batch, outs):
        tokens, lps = hf_greedy(hf, ids, 12)
        assert out.token_ids == tokens
        ours = [lp.logprob for lp in out.completions[0].logprobs]
        assert max(abs(a - b) for a, b in zip(ours, lps)) < 1e-4


def test_off_switch_keeps_every_nn_linear():
    hf = hf_model("qwen2")
    eng = engine_for(hf, packed_weights=False)
    assert not eng.info.packed_weights
    assert not any(isinstance(m, PackedLinear) for m in eng.rt.model.modules())
    assert eng.rt.model.lm_head.weight is eng.rt.model.embed_tokens.weight      # still tied: no copy


def test_quantized_linears_are_left_to_their_kernels():
    eng = engine_for(hf_model("llama"), quantization="int8")
    kinds = {type(m).__name__ for m in eng.rt.model.modules()}
    assert "Int8Linear" in kinds and "Linear" not in kinds


def test_a_packing_that_fails_its_check_leaves_f_linear(monkeypatch, caplog):
    import jobrunner.engine.run.packed_weights as pw

    def broken(linear, **options):
        raise ValueError("packed linear disagrees with F.linear")
    monkeypatch.setattr(pw, "pack_linear", broken)
    eng = engine_for(hf_model("qwen2"))
    assert not eng.info.packed_weights and "packing" in caplog.text
    assert eng.rt.model.lm_head.weight is eng.rt.model.embed_tokens.weight
