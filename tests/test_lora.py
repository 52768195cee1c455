"""LoRA adapters per row (engine/lora): greedy tokens and logprobs equal transformers + peft with the
row's adapter active, on three families (the MoE one with adapters on attention only); rows of
several adapters and the base model in one batch equal each run alone; KV is never shared across
adapters; configurations we can't run are refused before any work."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import save_tiny_tokenizer
from jobrunner.engine.config.engine_config import ConfigError, EngineConfig
from jobrunner.engine.core.engine import Engine
from jobrunner.engine.api.request import Request, SamplingParams
from tests.lora_helpers import ATTENTION, make_adapter
from tests.test_moe import _SIZES, MOE_CONFIGS
from tests.tiny import hf_greedy, hf_model, prompts

pytest.importorskip("peft")
N = 24


def _moe():
    import transformers
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model("qwen2_moe", **{**_SIZES, **MOE_CONFIGS["qwen2_moe"]})
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


# family -> (the HF model, the adapters' targets (the MoE's routed experts take none; its shared expert is a
# dense MLP, adapter c's gate_proj and down_proj), the adapters' gain: the MoE's
# weights are 5x larger (initializer_range 0.1), so is its float32 noise; peft's own scale keeps it below 1e-4)
FAMILIES = {"llama": (lambda: hf_model("llama"), None, 3.0), "qwen2": (lambda: hf_model("qwen2"), None, 3.0),
            "qwen2_moe": (_moe, ATTENTION, 1.0)}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(HF model, its checkpoint directory, {adapter name: (directory, transformers + peft model)})."""
    build, targets, gain = FAMILIES[request.param]
    hf = build()
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    hf.save_pretrained(str(root / "base"))
    save_tiny_tokenizer(root / "base")
    hf.generation_config.eos_token_id = None
    adapters = {}
    for i, (name, extra) in enumerate({"a": dict(r=4), "b": dict(r=8, rslora=True, alpha=4),
                                       "c": dict(r=2, targets=["q_proj", "v_proj", "down_proj"] if targets is None
                                                 else ["k_proj", "o_proj", "gate_proj", "down_proj"])}.items()):
        extra.setdefault("targets", targets)
        adapters[name] = (root / name, make_adapter(hf, root / name, seed=10 + i, gain=gain, **extra))
    return hf, root / "base", adapters


def _engine(path, adapters: dict, **overrides) -> Engine:
    cfg = EngineConfig(**({"model": str(path), "kv_cache_memory": 4 * 2**20, "max_num_batched_tokens": 256,
                           "loras": tuple((n, str(p)) for n, (p, _) in adapters.items())} | overrides))
    return Engine(cfg)


def _run(engine, rows, n=N):
    """rows: (prompt, adapter name or None) -> outputs in order."""
    p = SamplingParams(max_tokens=n, ignore_eos=True, logprobs=0)
    return engine.generate([Request(str(i), ids, p, adapter=a) for i, (ids, a) in enumerate(rows)])


def _logprobs(out):
    return [lp.logprob for lp in out.completions[0].logprobs]


def test_greedy_and_logprobs_equal_transformers_with_peft(family):
    hf, path, adapters = family
    batch = prompts(1, lengths=(5, 17, 33))
    rows = [(ids, name) for name in [*adapters, None] for ids in batch]
    outs = _run(_engine(path, adapters), rows)
    for (ids, name), out in zip(rows, outs):
        ref = hf if name is None else adapters[name][1]
        tokens, lps = hf_greedy(ref, ids, N)
        assert out.token_ids == tokens, name
        assert max(abs(a - b) for a, b in zip(_logprobs(out), lps)) < 1e-4, name
    base_tokens = [o.token_ids for o in outs[-len(batch):]]
    assert all([o.token_ids for o in outs[i * 3:i * 3 + 3]] != base_tokens for i in range(3))   # adapters matter


def test_a_mixed_batch_equals_each_adapter_run_alone(family):
    _, path, adapters = family
    batch = prompts(2, lengths=(9, 30, 3, 21, 14, 40, 7, 25))
    names = ["a", None, "b", "c", "a", "c", None, "b"]
    rows = list(zip(batch, names))
    mixed = _run(_engine(path, adapters, max_num_batched_tokens=37), rows)   # chunked prefill beside decodes
    for name in set(names):
        alone_rows = [r for r in rows if r[1] == name]
        alone = _run(_engine(path, {name: adapters[name]} if name else {}), alone_rows)
        got = [o for o, r in zip(mixed, rows) if r[1] == name]
        assert [o.token_ids for o in got] == [o.token_ids for o in alone], name
        for g, a in zip(got, alone):
            assert max(abs(x - y) for x, y in zip(_logprobs(g), _logprobs(a))) < 1e-4


def test_a_shared_prefix_is_computed_once_per_adapter(family):
    _, path, adapters = family
    shared = prompts(4, lengths=(40,))[0]
    tails = [[5, 6, 7], [9], [11, 12]]
    rows = [(shared + t, name) for name in ("a", "b", None) for t in tails[:2]]
    engine = _engine(path, adapters)
    outs = _run(engine, rows, 8)
    # admitted together: each adapter's first row computes the two full blocks, its second reuses them
    assert [o.cached_tokens for o in outs] == [0, 32] * 3
    assert engine.counters().prompt_tokens_cached == 3 * 32
    for name in ("a", "b", None):
        alone = _run(_engine(path, adapters, enable_prefix_caching=False), [r for r in rows if r[1] == name], 8)
        assert [o.token_ids for o, r in zip(outs, rows) if r[1] == name] == [o.token_ids for o in alone]


def test_fewer_device_slots_than_adapters(family):
    """max_loras 1: rows of one adapter run at a time, the others wait; the same tokens."""
    _, path, adapters = family
    rows = list(zip(prompts(3, lengths=(6, 11, 8, 13)), ["a", "b", "c", "a"]))
    ref = _run(_engine(path, adapters), rows, 8)
    engine = _engine(path, adapters, max_loras=1)
    assert engine.rt.loras.num_slots == 1
    assert [o.token_ids for o in _run(engine, rows, 8)] == [o.token_ids for o in ref]


def test_an_unknown_adapter_is_an_error_row(family):
    _, path, adapters = family
    ok, bad = _run(_engine(path, adapters), [([5, 6, 7], "a"), ([5, 6, 7], "nope")], 4)
    assert ok.error is None and "unknown LoRA adapter 'nope'" in bad.error


@pytest.mark.parametrize("field,value", [("use_dora", True), ("bias", "all"), ("modules_to_save", ["lm_head"]),
                                         ("fan_in_fan_out", True), ("target_modules", ["embed_tokens"]),
                                         ("peft_type", "IA3"), ("rank_pattern", {"q_proj": 2})])
def test_unsupported_configs_are_refused_naming_the_field(family, tmp_path, field, value):
    _, path, adapters = family
    src = adapters["a"][0]
    (tmp_path / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    cfg = json.loads((src / "adapter_config.json").read_text()) | {field: value}
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=field):
        _engine(path, {"x": (tmp_path, None)})


def test_a_target_the_model_lacks_is_refused(family, tmp_path):
    """A routed expert's gate_proj (Mixtral's older layout names them so): no dense projection to add to."""
    from safetensors.torch import load_file, save_file
    _, path, adapters = family
    src = adapters["a"][0]
    tensors = {k.replace("self_attn.q_proj", "mlp.experts.0.gate_proj"): v
               for k, v in load_file(str(src / "adapter_model.safetensors")).items()}
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    with pytest.raises(ConfigError, match="experts.0.gate_proj has no counterpart"):
        _engine(path, {"x": (tmp_path, None)})


def test_two_tensor_parallel_ranks_equal_one(family):
    """Each rank holds its slices of the adapters (A by the input side of o_proj and down_proj, B by the
    output side of the others); a mixed batch gives one process's tokens."""
    _, path, adapters = family
    rows = list(zip(prompts(5, lengths=(7, 19, 12, 30)), ["a", "b", None, "c"]))
    one = _run(_engine(path, adapters, num_threads=1), rows, 12)
    engine = _engine(path, adapters, tensor_parallel=2, num_threads=1)
    try:
        two = _run(engine, rows, 12)
        assert engine.rt.tp.size == 2
        qkv = engine.rt.model.layers[0].self_attn.qkv_proj
        assert qkv.b[0].shape[1] == qkv.slices[0] == engine.rt.model_config.num_heads // 2 * 16
    finally:
        engine.close()
    assert [o.token_ids for o in two] == [o.token_ids for o in one]


def test_fused_targets_of_phi3(tmp_path):
    """Phi-3 names its fused projections qkv_proj and gate_up_proj: one A for all slices, B split by rows."""
    import transformers

    from tests.test_dense_families import _COMMON
    torch.manual_seed(0)        # a plain rope (the dense families' longrope switches factors past 16 positions)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.Phi3Config(**_COMMON),
                                                       dtype=torch.float32).eval()
    hf.save_pretrained(str(tmp_path / "base"))
    save_tiny_tokenizer(tmp_path / "base")
    hf.generation_config.eos_token_id = None
    ref = make_adapter(hf, tmp_path / "a", seed=4, targets=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
                       gain=1.0)
    ids = prompts(6, lengths=(13,))[0]
    out = _run(_engine(tmp_path / "base", {"a": (tmp_path / "a", ref)}), [(ids, "a")])[0]
    tokens, lps = hf_greedy(ref, ids, N)
    assert out.token_ids == tokens and tokens != hf_greedy(hf, ids, N)[0]
    assert max(abs(a - b) for a, b in zip(_logprobs(out), lps)) < 1e-4


def test_speculative_rows_are_verified_under_their_adapters(family):
    """Drafts from a row's own loops, verified in one chunk under the row's adapter: the tokens and logprobs
    of the plain engine, in a batch of several adapters and the base model."""
    _, path, adapters = family
    batch = [p * 3 for p in prompts(3, lengths=(9, 4, 13, 6))]
    rows = list(zip(batch, ["a", None, "b", "c"]))
    plain = _run(_engine(path, adapters), rows)
    engine = _engine(path, adapters, speculative="ngram")
    spec = _run(engine, rows)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    for s, p in zip(spec, plain):
        assert max(abs(x - y) for x, y in zip(_logprobs(s), _logprobs(p))) < 1e-4
    assert engine.counters().accepted_tokens > 0
