"""Quantized checkpoints as users ship them, loaded with -m and run against transformers.

Checkpoints: tests/quantized_checkpoints.py makes tiny random llama, qwen2 and qwen3_moe models in
each of llmcompressor's preset schemes with compressed-tensors itself, and GPTQ / AWQ ones in their
published layouts. References:
  * weight-only schemes: transformers on the checkpoint as compressed-tensors decompresses it (what
    transformers itself does on load; for GPTQ/AWQ the float weights of the levels packed): greedy
    tokens identical, chosen-token logprobs within 1e-3;
  * activation-quantized schemes: transformers loading the compressed directory itself, which
    fake-quantizes every linear's input (compressed-tensors' forward): each of our linears equals
    its module to float rounding on the same input, and greedy tokens are identical. Logprobs are
    held to 0.1 there: a sum that rounds differently in its last bit can move one activation across
    a quantization step, and the step moves a logit by that much.
  * qwen3_moe's experts: transformers fuses them into bfloat16 tensors without their activation
    quantization, so the MoE family is compared with the decompressed float reference for weight-only
    schemes and, for activation-quantized ones, expert by expert against compressed-tensors' math.
"""
from __future__ import annotations

import json

import pytest
import torch

from jobrunner.engine.config.engine_config import ConfigError, EngineConfig
from jobrunner.engine.core.engine import Engine
from jobrunner.engine.load.loader import load_model_bundle
from jobrunner.engine.api.request import Request, SamplingParams
from jobrunner.engine.run.runtime import build_model

ct = pytest.importorskip("compressed_tensors")
from quantized_checkpoints import (SCHEMES, dequantized_state_dict, make_awq, make_compressed,  # noqa: E402
                                   make_gptq, save_reference)

WEIGHT_ONLY = ("W4A16", "W4A16_ASYM", "W8A16")
PROMPTS = ([5, 17, 33, 80, 120, 7, 9, 44], [11, 200, 3, 3, 64, 90, 17, 250, 31, 8, 140, 12, 77])
N = 10


def _ours(path, **engine):
    cfg = EngineConfig(model=str(path), dtype="float32", kv_cache_memory=4 * 2**20, max_num_batched_tokens=256,
                       **engine)
    eng = Engine(cfg)
    reqs = [Request(str(i), p, SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, logprobs=0))
            for i, p in enumerate(PROMPTS)]
    outs = {o.id: o.completions[0] for o in eng.generate(reqs)}
    return [(outs[str(i)].token_ids, [t.logprob for t in outs[str(i)].logprobs]) for i in range(len(PROMPTS))]


def _hf(path):
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    for p in PROMPTS:
        g = hf.generate(torch.tensor([p]), max_new_tokens=N, min_new_tokens=N, do_sample=False, output_logits=True,
                        return_dict_in_generate=True, pad_token_id=0)
        tokens = g.sequences[0, len(p):].tolist()
        out.append((tokens, [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(g.logits, tokens)]))
    return hf, out


def _assert_same(ours, ref, atol):
    for (tokens, lps), (ref_tokens, ref_lps) in zip(ours, ref):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < atol


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3_moe"])
@pytest.mark.parametrize("scheme", WEIGHT_ONLY)
def test_weight_only_compressed_tensors_match_transformers(family, scheme, tmp_path):
    path = make_compressed(tmp_path / "ckpt", family, scheme)
    _, ref = _hf(save_reference(path))
    _assert_same(_ours(path), ref, atol=1e-3)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("scheme", [s for s in SCHEMES if s not in WEIGHT_ONLY])
def test_activation_quantized_compressed_tensors_match_transformers(family, scheme, tmp_path, monkeypatch):
    # fp8 weights on the old path (F.linear over the dequantized weight: transformers' sums bit for bit); the
    # CPU fp8 kernel sums in another order, which can tip a near-tie: tests/test_cpu_fp8.py holds it to that
    monkeypatch.setenv("JOBRUNNER_CPU_FP8", "off")
    path = make_compressed(tmp_path / "ckpt", family, scheme)
    hf, ref = _hf(path)                         # its first forward decompressed the weights in place
    _assert_same(_ours(path), ref, atol=0.1)
    ours = build_model(load_model_bundle(str(path)), torch.device("cpu"), torch.float32)
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(0)) * 2
    for i in range(2):
        hl, ol = hf.model.layers[i], ours.layers[i]
        with torch.no_grad():
            qkv = torch.cat([getattr(hl.self_attn, p)(x[None])[0] for p in ("q_proj", "k_proj", "v_proj")], -1)
            torch.testing.assert_close(ol.self_attn.qkv_proj(x), qkv, rtol=1e-5, atol=1e-5)
            gate_up = torch.cat([hl.mlp.gate_proj(x[None])[0], hl.mlp.up_proj(x[None])[0]], -1)
            torch.testing.assert_close(ol.mlp.gate_up_proj(x), gate_up, rtol=1e-5, atol=1e-5)
            h = torch.randn(6, 256, generator=torch.Generator().manual_seed(1))
            torch.testing.assert_close(ol.mlp.down_proj(h), hl.mlp.down_proj(h[None])[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", [s for s in SCHEMES if s not in WEIGHT_ONLY])
def test_activation_quantized_experts_follow_the_scheme(scheme, tmp_path):
    """Each expert's projections: the checkpoint's float weight (compressed-tensors' decompression)
    times the input quantized as its scheme says (kernels' quantizers, bit-exact to compressed-tensors':
    tests/test_shipped_kernels.py); and the whole model runs."""
    from jobrunner.kernels.ops import fake_quantize_fp8, quantize_act_int8
    path = make_compressed(tmp_path / "ckpt", "qwen3_moe", scheme)
    dense = dequantized_state_dict(path)
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    acts = qc["config_groups"]["group_0"]["input_activations"]
    tensors = {}
    from safetensors.torch import load_file
    tensors.update(load_file(str(path / "model.safetensors")))
    ours = build_model(load_model_bundle(str(path)), torch.device("cpu"), torch.float32)
    experts = ours.layers[0].mlp.experts
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2))
    for e in (0, 3):
        name = f"model.layers.0.mlp.experts.{e}"
        w = torch.cat([dense[f"{name}.gate_proj.weight"], dense[f"{name}.up_proj.weight"]])
        if acts["type"] == "int":
            xq, xs = quantize_act_int8(x)
            fx = xq.float() * xs
        else:
            static = tensors.get(f"{name}.gate_proj.input_scale")
            fx = fake_quantize_fp8(x, None if acts["dynamic"] else static.float(), acts.get("group_size"))
        with torch.no_grad():
            torch.testing.assert_close(experts.gate_up[e](x), fx @ w.t(), rtol=1e-5, atol=1e-5)
    (tokens, _), _ = _ours(path)
    assert len(tokens) == N


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3_moe"])
@pytest.mark.parametrize("make,kwargs", [
    (make_gptq, dict(bits=4, group_size=128)),
    (make_gptq, dict(bits=4, group_size=32, desc_act=True, sym=False)),
    (make_gptq, dict(bits=8, group_size=-1)),
    (make_awq, dict(group_size=64)),
], ids=["gptq4-g128", "gptq4-g32-act-order-asym", "gptq8-channel", "awq-g64"])
def test_gptq_and_awq_match_their_float_weights(family, make, kwargs, tmp_path):
    path = make(tmp_path / "ckpt", family, **kwargs)
    _, ref = _hf(path / "reference")
    _assert_same(_ours(path), ref, atol=1e-3)


def test_int4_stays_int4_in_memory(tmp_path):
    """W4A16: the weights the engine holds within 1.3x of the checkpoint's safetensors bytes."""
    path = make_compressed(tmp_path / "ckpt", "llama", "W4A16", hidden_size=256, intermediate_size=512)
    eng = Engine(EngineConfig(model=str(path), dtype="float32", kv_cache_memory=2**20))
    on_disk = (path / "model.safetensors").stat().st_size
    # the float parts (embeddings, lm_head, norms) are bfloat16 on disk and float32 here: count them twice
    floats = sum(t.numel() * 2 for k, t in load_file_lazy(path).items() if t.dtype == torch.bfloat16)
    assert eng.info.weight_bytes <= 1.3 * (on_disk + floats)
    assert eng.info.quantization.startswith("compressed-tensors: int4 g128")


def load_file_lazy(path):
    from safetensors.torch import load_file
    return load_file(str(path / "model.safetensors"))


def test_quantization_flag_on_a_quantized_checkpoint_is_refused(tmp_path):
    path = make_compressed(tmp_path / "ckpt", "llama", "W4A16")
    with pytest.raises(ConfigError, match="quantized already"):
        Engine(EngineConfig(model=str(path), quantization="int8"))
