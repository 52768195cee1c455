"""Tensor parallelism on CPU (gloo): an engine over 2 and 4 processes gives one process's greedy tokens,
for every family's tiny checkpoint, with chunked prefill, preemption and prefix caching; each rank
reads and holds only its shard.

Each process runs one thread: more, on a 2-core machine, oversubscribes the cores.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import save_tiny_tokenizer
from jobrunner.engine.config.engine_config import ConfigError, EngineConfig
from jobrunner.engine.core.engine import Engine
from jobrunner.engine.load.loader import load_model_bundle
from jobrunner.engine.config.model_config import ModelConfig
from jobrunner.engine.run.model_runner import ModelRunner
from jobrunner.engine.parallel.group import TensorParallel
from jobrunner.engine.parallel.shards import ShardPlan, check_split
from jobrunner.engine.api.request import Request, SamplingParams
from tests.test_dense_families import _COMMON, FAMILIES
from tests.test_moe import _SIZES, MOE_CONFIGS
from tests.tiny import prompts

# 24 blocks of 4 tokens in each rank's cache: sequences are preempted; 7 tokens a step: prefill in chunks
ENGINE = dict(block_size=4, max_num_batched_tokens=7, num_threads=1)
BLOCKS = 24
N = 24
ALL = sorted(FAMILIES) + sorted(MOE_CONFIGS) + ["llama", "mistral", "qwen2", "qwen3"]
FOUR_RANKS = ("llama", "olmo2", "phi3", "qwen2_moe")     # KV heads replicated (2 < 4), all-head norms, fused tensors, shared expert


def _checkpoint(name: str, path) -> None:
    import transformers

    if name in FAMILIES:
        cfg_class, extra = FAMILIES[name]
        cfg = getattr(transformers, cfg_class)(**_COMMON, **extra)
    elif name in MOE_CONFIGS:
        cfg = transformers.AutoConfig.for_model(name, **{**_SIZES, **MOE_CONFIGS[name]})
    else:
        extra = {"attention_bias": True} if name == "qwen2" else {}
        cfg = transformers.AutoConfig.for_model(name, **{**_COMMON, **extra})
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():       # norms and biases randomized: a rank loading the wrong slice shows
        for pname, p in hf.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in pname and "gemma" not in name else 0.0))
    hf.save_pretrained(str(path))
    save_tiny_tokenizer(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(name: str):
        if name not in made:
            made[name] = tmp_path_factory.mktemp(f"tp-{name}")
            _checkpoint(name, made[name])
        return made[name]
    return get


def _prompts() -> list[list[int]]:
    """Four prompts sharing a 20-token prefix (prefix cache hits) and one apart."""
    shared = prompts(7, lengths=(20,))[0]
    return [shared + tail for tail in prompts(8, lengths=(1, 9, 20))] + prompts(9, lengths=(17,))


def _greedy(path, size: int, **options) -> tuple[list[list[int]], Engine]:
    """Each rank's cache holds BLOCKS blocks, as one rank's does: the same schedule, preemptions and all."""
    per_block = ModelRunner.kv_bytes_per_block(load_model_bundle(str(path)).config, ENGINE["block_size"],
                                               torch.float32, size)
    engine = Engine(EngineConfig(model=str(path), tensor_parallel=size, **ENGINE, kv_cache_memory=BLOCKS * per_block,
                                 **options))
    try:
        params = SamplingParams(max_tokens=N, ignore_eos=True)
        outs = engine.generate([Request(str(i), ids, params) for i, ids in enumerate(_prompts())])
    finally:
        engine.close()
    return [o.token_ids for o in outs], engine


@pytest.mark.parametrize("name", ALL)
def test_two_ranks_give_one_rank_s_tokens(checkpoints, name):
    path = checkpoints(name)
    one, _ = _greedy(path, 1)
    two, engine = _greedy(path, 2)
    assert engine.counters().preemptions > 0 and engine.counters().prompt_tokens_cached > 0
    assert engine.rt.tp.size == 2 and all(p.returncode == 0 for p in engine.rt.followers.procs.values())
    assert two == one, name


@pytest.mark.parametrize("name", sorted(MOE_CONFIGS))
def test_experts_split_by_columns_give_one_rank_s_tokens(checkpoints, name):
    """The tiny experts are narrow, so auto (the test above) holds experts whole on each rank; here
    every rank holds every expert's half."""
    path = checkpoints(name)
    one, _ = _greedy(path, 1)
    two, engine = _greedy(path, 2, moe_split="columns")
    sparse = [layer.mlp for layer in engine.rt.model.layers if hasattr(layer.mlp, "experts")]
    assert all(m.experts.w13.shape[0] == 8 and not m.foreign for m in sparse)
    assert two == one, name


def test_auto_holds_narrow_experts_whole(checkpoints):
    two, engine = _greedy(checkpoints("mixtral"), 2)
    assert all(layer.mlp.foreign and layer.mlp.experts.w13.shape[0] == 4 for layer in engine.rt.model.layers)


@pytest.mark.parametrize("name", FOUR_RANKS)
def test_four_ranks_give_one_rank_s_tokens(checkpoints, name):
    path = checkpoints(name)
    one, _ = _greedy(path, 1)
    four, engine = _greedy(path, 4)
    assert engine.counters().preemptions > 0
    assert four == one, name


def test_a_rank_reads_only_its_slices(checkpoints):
    """From safetensors, slice by slice: rank 1 of 2 gets its rows of q and of each KV head, its
    columns of o_proj, its half of the vocabulary."""
    path = checkpoints("llama")
    bundle = load_model_bundle(str(path))
    full = dict(bundle.weights())
    plan = ShardPlan(bundle.config, TensorParallel(rank=1, size=2))
    got = dict(bundle.shard_weights(plan.select))
    q, k, o = (f"model.layers.0.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "o_proj"))
    assert torch.equal(got[q], full[q][32:64]) and torch.equal(got[k], full[k][16:32])
    assert torch.equal(got[o], full[o][:, 32:64])
    vocab = bundle.config.vocab_size
    assert torch.equal(got["model.embed_tokens.weight"], full["model.embed_tokens.weight"][-(-vocab // 2):])
    assert torch.equal(got["model.norm.weight"], full["model.norm.weight"])


def test_fewer_kv_heads_than_ranks_are_replicated():
    cfg = ModelConfig.from_hf({**_COMMON, "architectures": ["LlamaForCausalLM"], "num_key_value_heads": 2})
    plans = [ShardPlan(cfg, TensorParallel(rank=r, size=4)) for r in range(4)]
    assert [(p.heads, p.kv_heads, p.first_kv_head) for p in plans] == [(1, 1, 0), (1, 1, 0), (1, 1, 1), (1, 1, 1)]


def test_a_split_that_does_not_divide_is_refused_before_any_rank_starts():
    cfg = ModelConfig.from_hf({**_COMMON, "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ConfigError, match="4 attention heads.*split evenly over 3"):
        check_split(cfg, 3)


def _peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def test_each_rank_holds_only_its_shard(tmp_path):
    """A dummy model of ~200 MB in bfloat16: each of two ranks allocates about half (weights and peak memory)."""
    config = {**_COMMON, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
              "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 6, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = f"dummy:{tmp_path / 'config.json'}"
    small = dict(dtype="bfloat16", num_threads=1, kv_cache_memory=2**20)
    whole = Engine(EngineConfig(model=model, **small)).rt.weight_bytes
    engine = Engine(EngineConfig(model=model, tensor_parallel=2, **small))
    try:
        (follower,) = engine.rt.followers.procs.values()
        shard = engine.rt.weight_bytes
        peak = _peak_rss_mb(follower.pid)
    finally:
        engine.close()
    replicated = 2 * config["hidden_size"] * (2 * config["num_hidden_layers"] + 1) + 4 * 32   # norms, rotary
    assert shard == (whole - replicated) // 2 + replicated
    one = _one_process_peak_mb(model, small)
    print(f"peak RSS: one process {one:.0f} MB, rank 1 of 2 {peak:.0f} MB; whole model {whole / 2**20:.0f} MB")
    assert peak < one - 0.35 * whole / 2**20        # half the weights less (0.5), with room for noise


def _one_process_peak_mb(model: str, options: dict) -> float:
    """The peak RSS of a fresh process that builds the whole model, as a follower process builds its half."""
    import subprocess
    import sys
    code = ("import sys; from jobrunner.engine.config.engine_config import EngineConfig; from jobrunner.engine.core.engine import Engine; "
            f"Engine(EngineConfig(model={model!r}, **{options!r})); "
            "print(next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')) / 1024)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    return float(out.stdout.split()[-1])


def test_a_lost_rank_ends_the_engine_with_engine_failure(checkpoints):
    """Rank 1 killed mid-run: the next step raises EngineFailure naming it, and the other ranks are ended."""
    import signal

    from jobrunner.engine.api.errors import EngineFailure

    engine = Engine(EngineConfig(model=str(checkpoints("llama")), tensor_parallel=2, num_threads=1))
    for i, ids in enumerate(_prompts()):
        engine.add_request(Request(str(i), ids, SamplingParams(max_tokens=200, ignore_eos=True)))
    (follower,) = engine.rt.followers.procs.values()
    with pytest.raises(EngineFailure, match=f"rank 1 \\(process {follower.pid}\\) exited with code -9"):
        for step in range(1000):
            engine.step()
            if step == 3:
                os.kill(follower.pid, signal.SIGKILL)
    assert follower.poll() == -signal.SIGKILL


def test_a_shard_that_cannot_be_built_stops_every_rank(checkpoints, tmp_path, monkeypatch):
    """A checkpoint without one tensor: ConfigError naming it, and no rank left running."""
    import shutil

    from safetensors.torch import load_file, save_file

    import jobrunner.engine.parallel.launch as launch

    src = checkpoints("llama")
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    weights = load_file(str(src / "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    started, real = [], launch.Followers.__init__
    monkeypatch.setattr(launch.Followers, "__init__", lambda self, *a: (real(self, *a), started.append(self))[0])
    with pytest.raises(ConfigError, match="down_proj"):
        Engine(EngineConfig(model=str(tmp_path), tensor_parallel=2, num_threads=1))
    (followers,) = started
    assert all(p.poll() is not None for p in followers.procs.values())
