"""Tiny random HF models for engine tests, handed to the engine without files in between."""
from __future__ import annotations

import types

import torch

from jobrunner.engine.config.engine_config import EngineConfig
from jobrunner.engine.core.engine import Engine
from jobrunner.engine.config.model_config import ModelConfig
from jobrunner.engine.run.runtime import build_runtime

ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3", "smollm2")


def hf_model(arch: str, seed: int = 0):
    import transformers as tf
    torch.manual_seed(seed)
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    if arch == "llama":
        cfg = tf.LlamaConfig(**common, tie_word_embeddings=False)
    elif arch == "llama3":
        cfg = tf.LlamaConfig(**common, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    elif arch == "mistral":
        cfg = tf.MistralConfig(**common, sliding_window=None)
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**common, tie_word_embeddings=True)
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=24, tie_word_embeddings=True)
    elif arch == "smollm2":
        cfg = tf.LlamaConfig(**(common | {"num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 96}),
                             rope_theta=100000.0, tie_word_embeddings=True)
    else:
        raise ValueError(arch)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    return model


def bundle_of(hf) -> types.SimpleNamespace:
    d = hf.config.to_dict()
    d["architectures"] = d.get("architectures") or [type(hf).__name__]
    cfg = ModelConfig.from_hf(d)
    state = hf.state_dict()
    return types.SimpleNamespace(config=cfg, hf_config=d, tokenizer=None, weights=lambda: iter(state.items()),
                                 source=f"tiny-{cfg.architecture}", weight_format="safetensors")


def engine_for(hf, **overrides) -> Engine:
    cfg = EngineConfig(**({"model": "tiny", "kv_cache_memory": 4 * 2**20, "max_num_batched_tokens": 256} | overrides))
    return Engine(cfg, build_runtime(cfg, bundle_of(hf)))


def hf_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                      output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    lps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, tokens)]
    return tokens, lps


def prompts(seed: int, lengths=(5, 17, 33, 2, 48, 16)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 320, (n,), generator=g).tolist() for n in lengths]


def forbid_launch_syncs(engine: Engine) -> None:
    """From now on a host sync inside the engine's launch raises (CUDA sync-debug mode, launch only):
    what async scheduling promises."""
    launch = engine.runner.launch

    def strict_launch(sched):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(sched)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    engine.runner.launch = strict_launch


def step_tiny_llama(plan: list[list[tuple[int, int]]], cpu_decode=None) -> list[list[int]]:
    """A tiny random Llama (GQA 2, seed 0) run by hand over a paged cache of 16 blocks of 4 slots: two
    prompts, stepped as `plan` says ((sequence, query tokens) per step; one-token entries are decodes,
    put first), each sequence taking its greedy token once its prompt and outputs are computed.
    -> each sequence's tokens. cpu_decode: the steps' in-place decode kernel (None: the gather path)."""
    from jobrunner.engine.models.llama import LlamaForCausalLM
    from jobrunner.kernels.ops import AttentionMetadata
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=96, hidden_size=64, intermediate_size=96,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                      rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=True,
                      attention_bias=False, qk_norm=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    bs, nb = 4, 16
    toks = [[5, 17, 3, 88, 41, 9, 60], [7, 7, 2, 30, 11]]
    tables = [[3, 9, 1, 12], [0, 5, 14, 6]]
    caches = [(torch.zeros(nb, bs, 2, 16), torch.zeros(nb, bs, 2, 16)) for _ in range(cfg.num_layers)]
    done = [0, 0]                                   # computed tokens per sequence
    for step in plan:
        step = sorted(step, key=lambda x: x[1] != 1)                 # decodes first
        ids, pos, slots, qlens, slens, tabs = [], [], [], [], [], []
        for s, n in step:
            lo = done[s]
            ids += toks[s][lo:lo + n]
            pos += list(range(lo, lo + n))
            slots += [tables[s][p // bs] * bs + p % bs for p in range(lo, lo + n)]
            qlens.append(n)
            slens.append(lo + n)
            tabs.append(tables[s])
        meta = AttentionMetadata.build(bs, sum(1 for n in qlens if n == 1), qlens, slens, slots, tabs, "cpu",
                                       cpu_decode=cpu_decode)
        with torch.inference_mode():
            logits = model.compute_logits(model(torch.tensor(ids), torch.tensor(pos), caches, meta))
        row = -1
        for s, n in step:
            row += n
            done[s] += n
            if done[s] == len(toks[s]):
                toks[s].append(int(logits[row].argmax()))
    return toks
