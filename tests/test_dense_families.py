"""Gemma 2, Gemma 3 (text), Phi-3, OLMo 2 and Granite against HF transformers, from checkpoints
that transformers saves: greedy 32 tokens identical and chosen-token logprobs within 1e-4, with
chunked prefill, preemption and prefix caching on, through the engine and through the CLI.

The tiny configurations make each family's switches bind: sliding windows (8 tokens) shorter than
the prompts, attention and final soft-caps below the scores they cap, Gemma 3's local rope base
beside a linearly scaled global one, Phi-3's LongRoPE with an original context (16) shorter than
every prompt (so HF, too, uses the long factors throughout) and 3/4 partial rotary, Granite's four
multipliers. No EOS id: HF's min_new_tokens would otherwise forbid a token our ignore_eos allows.
"""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from conftest import TINY_VOCAB, save_tiny_tokenizer
from jobrunner.engine.config.engine_config import EngineConfig
from jobrunner.engine.core.engine import Engine
from jobrunner.engine.load.loader import load_model_bundle
from jobrunner.engine.api.request import Request, SamplingParams
from jobrunner.cli.main import main
from tests.tiny import hf_greedy

_COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
               rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False,
               initializer_range=0.1)
_GEMMA = dict(query_pre_attn_scalar=24, sliding_window=8)
FAMILIES = {
    "gemma2": ("Gemma2Config", dict(_GEMMA, attn_logit_softcapping=1.0, final_logit_softcapping=2.0)),
    "gemma3": ("Gemma3TextConfig", dict(
        _GEMMA, layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}})),
    "phi3": ("Phi3Config", dict(original_max_position_embeddings=16, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5], "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]})),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", dict(embedding_multiplier=12.0, attention_multiplier=0.1, residual_multiplier=0.22,
                                      logits_scaling=8.0)),
}
# KV cache of 24 blocks of 4 tokens (K and V x 4 layers x 4 tokens x 2 heads x 16 dims x 4 bytes each): too
# small for the batch at once, so sequences are preempted and recomputed; 7 tokens a step: prefill in chunks.
ENGINE = dict(block_size=4, kv_cache_memory=24 * 4096, max_num_batched_tokens=7)
N = 32


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, the transformers model, the directory it saved itself to with a tiny tokenizer)."""
    import transformers

    name = request.param
    cfg_class, extra = FAMILIES[name]
    cfg = getattr(transformers, cfg_class)(**_COMMON, **extra)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():   # norms and biases start at constants: randomize them so their loading is checked
        for pname, p in hf.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in pname and "gemma" not in name else 0.0))
    path = tmp_path_factory.mktemp(f"tiny-{name}")
    hf.save_pretrained(str(path))
    save_tiny_tokenizer(path)
    return name, hf, path


def _prompts() -> list[list[int]]:
    """Five prompts of 17-40 tokens, four sharing a 20-token prefix (prefix cache hits)."""
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, TINY_VOCAB, (20,), generator=g).tolist()
    tails = [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in (1, 9, 20, 4)]
    return [shared + t for t in tails] + [torch.randint(3, TINY_VOCAB, (17,), generator=g).tolist()]


def test_engine_matches_transformers(family):
    name, hf, path = family
    engine = Engine(EngineConfig(model=str(path), **ENGINE))
    batch = _prompts()
    params = SamplingParams(max_tokens=N, ignore_eos=True, logprobs=0)
    outs = engine.generate([Request(str(i), ids, params) for i, ids in enumerate(batch)])
    assert engine.counters().preemptions > 0 and sum(o.cached_tokens for o in outs) > 0
    for ids, out in zip(batch, outs):
        ref_tokens, ref_lps = hf_greedy(hf, ids, N)
        assert out.token_ids == ref_tokens, name
        ours = [lp.logprob for lp in out.completions[0].logprobs]
        assert max(abs(a - b) for a, b in zip(ours, ref_lps)) < 1e-4, name


def test_cli_matches_transformers(family, tmp_path):
    """`jobrunner submit --no-chat` on text prompts: each row's output is the text of HF's 32 tokens."""
    name, hf, path = family
    tokenizer = load_model_bundle(str(path)).tokenizer
    head = "The quick brown fox jumps over the lazy dog. Hello world! Batch inference over datasets"
    texts = [head + tail for tail in (", row by row.", ": code.", " and numbers 0123456789.")]
    ds = tmp_path / "d.jsonl"
    ds.write_text("".join(json.dumps({"id": str(i), "prompt": t}) + "\n" for i, t in enumerate(texts)))
    out = tmp_path / "out"
    r = CliRunner().invoke(main, [
        "submit", str(ds), "-m", str(path), "--no-chat", "--ignore-eos", "--max-tokens", str(N), "-o", str(out),
        "--block-size", "4", "--kv-cache-memory", str(ENGINE["kv_cache_memory"]), "--max-batched-tokens", "7"])
    assert r.exit_code == 0, r.output
    rows = {row["id"]: row for part in sorted(out.glob("part*.parquet")) for row in pq.read_table(part).to_pylist()}
    assert sorted(rows) == ["0", "1", "2"]
    for i, text in enumerate(texts):
        ids = tokenizer.encode(text, add_special_tokens=True)
        assert len(ids) > 16                                    # past Phi-3's original context: long factors
        ref_tokens, _ = hf_greedy(hf, ids, N)
        row = rows[str(i)]
        assert row["error"] is None and row["completion_tokens"] == N, name
        assert row["output"] == tokenizer.decode(ref_tokens), name


@pytest.mark.parametrize("options", [dict(quantization="w8a8"), dict(kv_cache_dtype="int8")], ids=["w8a8", "kv-int8"])
def test_quantized_paths(family, options):
    """w8a8 (SmoothQuant only where a plain norm feeds qkv and gate_up: not Gemma's or OLMo 2's layers) and
    the int8 KV cache (windows and soft-caps over an int8 cache) run each family; on these tiny models with
    their flat distributions, the first token of at least 4 of 5 prompts is the float engine's."""
    from jobrunner.engine.quant import smooth

    name, _, path = family
    batch = _prompts()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    requests = lambda: [Request(str(i), ids, params) for i, ids in enumerate(batch)]   # noqa: E731
    base = Engine(EngineConfig(model=str(path))).generate(requests())
    engine = Engine(EngineConfig(model=str(path), **options))
    outs = engine.generate(requests())
    assert smooth.applies_to(engine.rt.model) == (name in ("granite", "phi3"))
    assert all(o.completion_tokens == 4 and o.error is None for o in outs)
    assert sum(o.token_ids[0] == b.token_ids[0] for o, b in zip(outs, base)) >= 4, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_triton_and_graphs_match_transformers(family):
    """On a GPU, float32: Triton attention with each family's switches (soft-cap, per-layer window), Triton
    GELU-tanh and partial rotary, and CUDA graphs for the decodes; greedy tokens as HF's on CPU."""
    name, hf, path = family
    engine = Engine(EngineConfig(model=str(path), device="cuda", dtype="float32", **ENGINE))
    batch = _prompts()
    params = SamplingParams(max_tokens=N, ignore_eos=True, logprobs=0)
    outs = engine.generate([Request(str(i), ids, params) for i, ids in enumerate(batch)])
    assert engine.runner.graphs is not None and engine.runner.graphs.replays > 0
    for ids, out in zip(batch, outs):
        ref_tokens, ref_lps = hf_greedy(hf, ids, N)
        assert out.token_ids == ref_tokens, name
        ours = [lp.logprob for lp in out.completions[0].logprobs]
        assert max(abs(a - b) for a, b in zip(ours, ref_lps)) < 1e-3, name


def test_unsupported_family_exits_2_naming_it_and_the_supported_ones(tmp_path):
    """Gemma 3's multimodal checkpoint (Gemma3ForConditionalGeneration) is not a text family of ours."""
    from safetensors.torch import save_file

    path = tmp_path / "m"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**_COMMON, "architectures": ["Gemma3ForConditionalGeneration"],
                                                  "model_type": "gemma3"}))
    save_file({"model.embed_tokens.weight": torch.zeros(TINY_VOCAB, 64)}, str(path / "model.safetensors"))
    save_tiny_tokenizer(path)
    ds = tmp_path / "d.jsonl"
    ds.write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n")
    r = CliRunner().invoke(main, ["submit", str(ds), "-m", str(path), "--no-chat", "-o", str(tmp_path / "out")])
    assert r.exit_code == 2, r.output
    assert "Gemma3ForConditionalGeneration" in r.output and "Traceback" not in r.output
    for supported in ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "GraniteForCausalLM", "LlamaForCausalLM",
                      "Olmo2ForCausalLM", "Phi3ForCausalLM"):
        assert supported in r.output
    assert not any((tmp_path / "out").glob("part*"))


def test_dummy_gemma2_config_has_the_switches():
    """dummy:gemma-2-9b (random weights, for GPU benchmarks of the soft-capped, alternating-window path)."""
    cfg = load_model_bundle("dummy:gemma-2-9b").config
    assert cfg.family == "gemma" and cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.layer_types[:2] == ("sliding_attention", "full_attention") and len(cfg.layer_types) == 42
    assert (cfg.sliding_window, cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (4096, 50.0, 30.0)
    assert cfg.embedding_multiplier == 3584 ** 0.5 and cfg.query_pre_attn_scalar == 256


def test_published_config_formats():
    """config.json as the hub has them, older than transformers 5's rope_parameters: Gemma 3 1B (local rope
    base and sliding_window_pattern) and Phi-3-mini-128k (rope_scaling of "type" longrope, 128k context)."""
    import math

    from jobrunner.engine.config.model_config import ModelConfig
    from jobrunner.engine.models.layers import Rotary

    gemma3 = ModelConfig.from_hf({
        "architectures": ["Gemma3ForCausalLM"], "vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912,
        "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": None, "sliding_window": 512,
        "sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh"})
    assert (gemma3.rope_theta, gemma3.rope_local_theta, gemma3.qk_norm) == (1e6, 1e4, True)
    assert [i for i in range(26) if not gemma3.is_sliding(i)] == [5, 11, 17, 23]
    phi3 = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 32064, "hidden_size": 3072,
            "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 32,
            "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "sliding_window": 262144,
            "rope_theta": 10000.0}
    longrope = ModelConfig.from_hf({**phi3, "rope_scaling": {
        "type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48}})
    assert longrope.sliding_window == 262144 and longrope.is_sliding(0)
    rotary, plain = Rotary(longrope), Rotary(ModelConfig.from_hf({**phi3, "rope_scaling": None}))
    assert rotary.factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096))) and plain.factor == 1.0
    torch.testing.assert_close(rotary.inv_freq, plain.inv_freq / 2)      # the long factors: a 128k context


def test_layer_types_of_another_length_than_the_layers_is_a_model_error():
    """Not an IndexError halfway through the build, nor extra entries silently dropped."""
    from jobrunner.engine.api.errors import ModelError
    from jobrunner.engine.load.loader import _model_config
    gemma2 = {"architectures": ["Gemma2ForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
    with pytest.raises(ModelError, match="layer_types has 2 entries for 3 layers"):
        _model_config(gemma2, "config.json")
