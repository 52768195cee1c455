"""The pieces of a shipped checkpoint's forward against compressed-tensors' own code (the library
llmcompressor writes and vLLM reads): its int32 packing, its activation quantization, and each
module we build against the float weight it stands for; the schemes we refuse, refused by name."""
from __future__ import annotations

import pytest
import torch

from jobrunner.engine.config.engine_config import ConfigError
from jobrunner.engine.shipped.build import fused_module
from jobrunner.engine.shipped.scheme import ActArgs, ModuleScheme, WeightArgs, read_quantization
from jobrunner.engine.shipped.unpack import IntLevels, unpack_int32
from jobrunner.kernels.ops import fake_quantize_fp8, quantize_act_int8, w8a8_shipped_matmul, w8a8_shipped_matmul_ref

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import fake_quantize  # noqa: E402
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp  # noqa: E402


@pytest.mark.parametrize("bits", [4, 8])
def test_unpack_int32_inverts_compressed_tensors_packing(bits):
    g = torch.Generator().manual_seed(bits)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1))
    levels = torch.randint(lo, hi, (24, 72), generator=g, dtype=torch.int8)
    packed = pack_to_int32(levels, bits)
    assert torch.equal(unpack_int32(packed, bits, 72), levels)


def _ct_dynamic(x, **args):
    a = QuantizationArgs(**args)
    scale, zp = compute_dynamic_scales_and_zp(x, a, module=None)
    return fake_quantize(x, scale, zp, a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_activations_as_compressed_tensors(dtype):
    x = (torch.randn(3, 9, 64, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    x[0, 0] = 0.0                                       # a zero token: its scale is eps, its levels 0
    ref = _ct_dynamic(x, num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    xq, xs = quantize_act_int8(x.reshape(-1, 64))
    assert torch.equal((xq.to(dtype) * xs).view_as(x), ref)


@pytest.mark.parametrize("group", [None, 32])
def test_fp8_activations_as_compressed_tensors(group):
    x = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(1)) * 5
    args = dict(num_bits=8, type="float", symmetric=True, dynamic=True,
                **({"strategy": "group", "group_size": group} if group else {"strategy": "token"}))
    ref = _ct_dynamic(x, **args)
    assert torch.equal(fake_quantize_fp8(x.reshape(-1, 64), group=group).view_as(x), ref)


def test_static_fp8_activations_as_compressed_tensors():
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    s = torch.tensor([0.013])
    a = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False)
    assert torch.equal(fake_quantize_fp8(x, s), fake_quantize(x, s, torch.zeros(1), a))


def test_w8a8_integer_product_matches_the_fake_quantized_reference():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(17, 96, generator=g)
    q = torch.randint(-128, 128, (40, 96), generator=g, dtype=torch.int8)
    s = torch.rand(40, 1, generator=g) / 100
    bias = torch.randn(40, generator=g)
    torch.testing.assert_close(w8a8_shipped_matmul(x, q, s, bias), w8a8_shipped_matmul_ref(x, q, s, bias),
                               rtol=1e-5, atol=1e-5)


def _int_levels(n, k, bits, group, asym, g_idx=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1))
    groups = k // group
    q = torch.randint(lo, hi, (n, k), generator=g, dtype=torch.int8)
    zero = torch.randint(lo, hi, (n, groups), generator=g, dtype=torch.int8) if asym else None
    return IntLevels(q, torch.rand(n, groups, generator=g) / 50 + 1e-3, zero, bits, group, g_idx)


def _float_weight(lv: IntLevels) -> torch.Tensor:
    """W = (q - zero[g(k)]) * scale[g(k)], straight from the definition."""
    k = lv.q.shape[1]
    gk = lv.g_idx if lv.g_idx is not None else torch.arange(k) // lv.group
    zero = 0 if lv.zero is None else lv.zero.float()[:, gk]
    return (lv.q.float() - zero) * lv.scale[:, gk]


@pytest.mark.parametrize("bits,group,asym,act_order", [(4, 32, False, False), (4, 64, True, False),
                                                       (4, 32, True, True), (8, 32, False, False),
                                                       (8, 64, True, True), (4, 96, False, False)])
def test_weight_only_modules_compute_the_declared_weight(bits, group, asym, act_order):
    k = 192
    g_idx = torch.randperm(k, generator=torch.Generator().manual_seed(5)) // group if act_order else None
    parts = [_int_levels(n, k, bits, group, asym, g_idx, seed=n) for n in (48, 16, 16)]     # q, k, v
    scheme = ModuleScheme("pack-quantized", WeightArgs("int", bits, "group", group, symmetric=not asym))
    bias = torch.randn(80)
    module = fused_module(scheme, parts, bias, torch.device("cpu"))
    x = torch.randn(5, k)
    ref = x @ torch.cat([_float_weight(p) for p in parts]).t() + bias
    torch.testing.assert_close(module(x), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config,named", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "GPTQ 3-bit"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "marlin"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "gemv"),
    ({"quant_method": "compressed-tensors", "format": "marlin-24", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}},
     "marlin-24"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "sparsity_config": {"format": "sparse-24-bitmask"}, "config_groups": {}}, "sparse-24-bitmask"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                           "group_size": 16}}}}, "nvfp4-pack-quantized"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}},
     "int8 input activations"),
])
def test_unsupported_schemes_are_refused_by_name(config, named):
    with pytest.raises(ConfigError, match=named):
        read_quantization({"quantization_config": config})


def test_scheme_names_what_it_runs():
    q = read_quantization({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"],
                                      "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
                                      "input_activations": {"num_bits": 8, "type": "int", "strategy": "token",
                                                            "dynamic": True}}}}})
    assert q.name == "compressed-tensors: int8 per-channel, int8 activations dynamic per token"
    assert q.scheme_for("lm_head") is None
    assert q.scheme_for("model.layers.0.self_attn.q_proj").acts == ActArgs("int", "token", True)
