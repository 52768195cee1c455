"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) against HF transformers, float32 on CPU.

Tiny random checkpoints written by transformers' save_pretrained (per-expert tensors, as published):
8 experts, top 2, weights large enough (std 0.1) that the router's choices and the experts'
outputs move the logits. Qwen2-MoE has its shared expert; Qwen3-MoE has four layers, of which
mlp_only_layers and decoder_sparse_step leave two dense.
"""
from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
import torch
from click.testing import CliRunner

from conftest import TINY_VOCAB, save_tiny_tokenizer
from jobrunner.engine.config.engine_config import EngineConfig
from jobrunner.engine.core.engine import Engine
from jobrunner.engine.load.loader import load_model_bundle
from jobrunner.engine.run.model_runner import ModelRunner
from jobrunner.engine.models import model_class
from jobrunner.engine.api.request import Request, SamplingParams
from jobrunner.engine.run.runtime import build_model, build_runtime
from tests.tiny import hf_greedy, prompts

_SIZES = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1,
              eos_token_id=2, pad_token_id=0, initializer_range=0.1, tie_word_embeddings=False)
MOE_CONFIGS = {
    "mixtral": dict(num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2, intermediate_size=48),
    "qwen2_moe": dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40,
                      shared_expert_intermediate_size=56, norm_topk_prob=False),
    # layers 0..3: 0 dense (mlp_only_layers), 1 and 3 sparse (decoder_sparse_step 2: (i + 1) % 2 == 0), 2 dense
    "qwen3_moe": dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40,
                      norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[0]),
}


@pytest.fixture(scope="module", params=sorted(MOE_CONFIGS))
def moe_model(request, tmp_path_factory):
    """(HF model, checkpoint directory) for one family."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(request.param, **{**_SIZES, **MOE_CONFIGS[request.param]})
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():   # norms around 1, not exactly 1, so a misplaced norm weight shows
        for name, p in hf.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    hf.save_pretrained(str(path))
    save_tiny_tokenizer(path)
    hf.generation_config.eos_token_id = None    # the reference's greedy tokens may include end-of-sequence
    return hf, path


def _engine(path, **overrides) -> Engine:
    cfg = EngineConfig(**({"model": str(path), "kv_cache_memory": 4 * 2**20, "max_num_batched_tokens": 256}
                          | overrides))
    return Engine(cfg, build_runtime(cfg, load_model_bundle(str(path))))


def _shared_prefix_prompts() -> list[list[int]]:
    base = prompts(7, lengths=(24,))[0]
    return [base + tail for tail in prompts(8, lengths=(9, 3, 17))] + prompts(9, lengths=(30,))


def test_layers_follow_the_config(moe_model):
    hf, path = moe_model
    model = build_model(load_model_bundle(str(path)), torch.device("cpu"), torch.float32)
    sparse = [type(layer.mlp).__name__ == "SparseMoE" for layer in model.layers]
    hf_sparse = [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
    assert sparse == hf_sparse and any(sparse)
    if hf.config.model_type == "qwen3_moe":
        assert sparse == [False, True, False, True]


def test_greedy_and_logprobs_match_transformers(moe_model):
    """32 greedy tokens and their logprobs, with chunked prefill (6-token steps), preemption (a KV
    cache of 9 blocks of 16 tokens for 4 sequences of up to 73 tokens at once) and prefix caching
    (three prompts share 24 tokens)."""
    hf, path = moe_model
    batch = _shared_prefix_prompts()
    per_block = ModelRunner.kv_bytes_per_block(load_model_bundle(str(path)).config, 16, torch.float32)
    engine = _engine(path, max_num_batched_tokens=6, kv_cache_memory=per_block * 9, max_num_seqs=4)
    outs = engine.generate([Request(str(i), ids, SamplingParams(max_tokens=32, ignore_eos=True, logprobs=0))
                            for i, ids in enumerate(batch)])
    assert engine.counters().preemptions > 0
    assert sum(o.cached_tokens for o in outs) > 0
    for ids, out in zip(batch, outs):
        ref_tokens, ref_lps = hf_greedy(hf, ids, 32)
        assert out.token_ids == ref_tokens
        ours = [lp.logprob for lp in out.completions[0].logprobs]
        assert max(abs(a - b) for a, b in zip(ours, ref_lps)) < 1e-4


def test_cli_greedy_matches_transformers(moe_model, tmp_path):
    """Through `jobrunner submit --no-chat`: each row's 32 greedy tokens, as text, are transformers'."""
    from jobrunner.cli.main import main
    from transformers import AutoTokenizer

    hf, path = moe_model
    tok = AutoTokenizer.from_pretrained(str(path))
    texts = ["The quick brown fox jumps over", "def f(x):\n    return"]
    ds = tmp_path / "rows.jsonl"
    ds.write_text("\n".join(json.dumps({"id": str(i), "prompt": t}) for i, t in enumerate(texts)))
    r = CliRunner().invoke(main, ["submit", str(ds), "-m", str(path), "--no-chat", "--max-tokens", "32",
                                  "--ignore-eos", "--max-batched-tokens", "5", "-o", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    df = pl.read_parquet(str(tmp_path / "out" / "part*.parquet"))
    got = dict(zip(df["id"].to_list(), df["output"].to_list()))
    for i, text in enumerate(texts):
        ids = tok(text)["input_ids"]
        ref_tokens, _ = hf_greedy(hf, ids, 32)
        assert got[str(i)] == tok.decode(ref_tokens, skip_special_tokens=True), text


def test_int8_experts_keep_the_output_close(moe_model):
    """--quantization int8: the stacked experts become int8 with per-channel scales, the router stays
    float; the chosen tokens' logprobs stay close to the float model's."""
    _, path = moe_model
    batch = prompts(3, lengths=(12, 20))
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=0)
    ref = _engine(path).generate([Request(str(i), ids, params) for i, ids in enumerate(batch)])
    engine = _engine(path, quantization="int8")
    moe = next(layer.mlp for layer in engine.rt.model.layers if hasattr(layer.mlp, "experts"))
    assert moe.experts.w13.dtype == torch.int8 and moe.experts.w2_scale.dtype == torch.float32
    assert moe.gate.weight.dtype == torch.float32
    outs = engine.generate([Request(str(i), ids, params) for i, ids in enumerate(batch)])
    first = [(o.completions[0].logprobs[0].logprob, r.completions[0].logprobs[0].logprob) for o, r in zip(outs, ref)]
    assert all(abs(a - b) < 0.05 for a, b in first), first


def test_fp8_experts_and_unsupported_schemes(moe_model):
    """fp8 experts (a CUDA scheme for the whole model; the experts' transform and the torch path run
    here) stay within fp8's precision of the float block; int4 and w8a8 refuse MoE models."""
    from jobrunner.engine.config.engine_config import ConfigError
    from jobrunner.engine.quant import quantize_model
    from jobrunner.engine.quant.experts import quantize_experts

    _, path = moe_model
    model = build_model(load_model_bundle(str(path)), torch.device("cpu"), torch.float32)
    moe = next(layer.mlp for layer in model.layers if hasattr(layer.mlp, "experts"))
    x = torch.randn(9, moe.gate.in_features, generator=torch.Generator().manual_seed(0))
    ref = moe(x)
    quantize_experts(moe.experts, "fp8")
    assert moe.experts.w13.dtype == torch.float8_e4m3fn
    assert (moe(x) - ref).norm() / ref.norm() < 0.05
    for scheme in ("int4", "w8a8"):
        with pytest.raises(ConfigError, match="mixture-of-experts models support int8 and fp8 only"):
            quantize_model(model, scheme)


def test_dummy_qwen3_30b_a3b_counts_3b_active_of_30b():
    """The benchmark model: Qwen3-30B-A3B's published sizes, 30.5B parameters of which a token uses 3.3B."""
    from benchmarks.throughput import model_arith

    cfg = load_model_bundle("dummy:qwen3-30b-a3b").config
    assert cfg.moe.num_experts == 128 and cfg.moe.top_k == 8 and cfg.moe.renormalize
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg)
    stored = sum(p.numel() for p in model.parameters())
    a = model_arith(cfg, 1, 1)
    assert stored == a["stored_layer_params"] + a["head_params"] + a["embedding_params"] + sum(
        p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert round(stored / 1e9, 1) == 30.5
    assert 3.3e9 < a["layer_params"] + a["head_params"] + a["embedding_params"] < 3.4e9


def test_cli_refuses_int4_for_moe_with_exit_2(tmp_path):
    from jobrunner.cli.main import main

    ds = tmp_path / "rows.jsonl"
    ds.write_text(json.dumps({"id": "a", "prompt": "hi"}))
    tiny = Path(__file__).parent.parent / "benchmarks" / "configs" / "tiny-qwen3-moe.json"
    r = CliRunner().invoke(main, ["submit", str(ds), "-m", f"dummy:{tiny}", "--quantization", "int4",
                                  "--max-tokens", "2", "-o", str(tmp_path / "out")])
    assert r.exit_code == 2
    assert "mixture-of-experts models support int8 and fp8 only" in r.output
