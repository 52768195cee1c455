"""`jobrunner models export NAME DIR` (engine/load/hf_export.py): the directory transformers loads gives our
greedy tokens (float32, CPU) and our chat template, on the default model and on tiny GGUFs; its config is
the one transformers' own GGUF reader makes; bfloat16, shards, and the command's exit codes."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from jobrunner.cli.main import main
from jobrunner.engine import Engine, EngineConfig, Request, SamplingParams, export_hf_dir, load_model_bundle
from tests.tiny import hf_greedy

transformers = pytest.importorskip("transformers")

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colors."}],
]
TEXT = "Hello world! Batch inference over datasets, row by row: 3.14159."
HF_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def _export(model, directory, *args) -> str:
    result = CliRunner().invoke(main, ["models", "export", str(model), str(directory), *args])
    assert result.exit_code == 0, result.output
    return result.stdout.strip()


def _greedy(engine: Engine, prompts: list[list[int]], n: int, ignore_eos: bool = False) -> list[list[int]]:
    p = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=ignore_eos)
    return [o.token_ids for o in engine.generate([Request(str(i), ids, p) for i, ids in enumerate(prompts)])]


def _chat_ids(hf_tok, messages) -> list[int]:
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)


@pytest.mark.default_model
def test_default_model_exports_to_a_directory_transformers_generates_our_tokens_from(default_gguf_path, tmp_path,
                                                                                      hf_default_model):
    out = tmp_path / "smollm2-hf"
    assert _export("smollm2-135m-instruct", out) == str(out)
    assert sorted(p.name for p in out.iterdir()) == HF_FILES
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert type(hf).__name__ == "LlamaForCausalLM" and next(hf.parameters()).dtype == torch.float32

    # the hyperparameters are the ones transformers' own GGUF reader finds (rms_norm_eps as the decimal 1e-05)
    cfg, ref = hf.config, hf_default_model.config
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
            "eos_token_id", "pad_token_id", "hidden_act")
    assert {k: getattr(cfg, k) for k in keys} == {k: getattr(ref, k) for k in keys}
    saved = json.loads((out / "config.json").read_text())
    assert (saved["rope_theta"], saved["rms_norm_eps"], saved["tie_word_embeddings"]) == (100000.0, 1e-05, True)
    assert cfg.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    ours_state, ref_state = hf.state_dict(), hf_default_model.state_dict()
    assert all(torch.equal(ours_state[k], ref_state[k]) for k in ref_state), "weights differ from transformers' GGUF"

    engine = Engine(EngineConfig(model=str(default_gguf_path)))
    try:
        tok = engine.tokenizer
        for messages in CHATS:
            assert hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
                tok.apply_chat_template(messages, add_generation_prompt=True)
        prompts = [_chat_ids(hf_tok, m) for m in CHATS]
        assert prompts == [tok.encode(tok.apply_chat_template(m, add_generation_prompt=True)) for m in CHATS]
        assert hf_tok(TEXT)["input_ids"] == tok.encode(TEXT, add_special_tokens=True)
        ours = _greedy(engine, prompts, 24)
    finally:
        engine.close()
    with torch.no_grad():       # generation_config.json's eos stops transformers where the job stops
        theirs = [hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
                  for ids in prompts]
    assert ours == theirs
    assert any(t[-1] == 2 for t in ours)      # at least one reply ended on <|im_end|>, not on max_tokens


@pytest.mark.parametrize("arch,qtype", [("llama", "Q8_0"), ("llama", "Q4_1"), ("qwen2", "F16"), ("qwen3", "Q8_0")])
def test_tiny_gguf_round_trips(tiny_gguf_path, tmp_path, arch, qtype):
    path = tiny_gguf_path(arch, qtype)
    out = tmp_path / "hf"
    _export(path, out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    engine = Engine(EngineConfig(model=str(path), kv_cache_memory=4 * 2**20))
    try:
        tok = engine.tokenizer
        assert hf_tok.apply_chat_template(CHATS[1], add_generation_prompt=True, tokenize=False) == \
            tok.apply_chat_template(CHATS[1], add_generation_prompt=True)
        # transformers 5 tokenizes model_type qwen2 with its own Qwen2Tokenizer (one digit a token) whatever
        # tokenizer.json says: a real Qwen2 GGUF's pre-tokenizer is that one, the tiny fixture's is GPT-2's
        text = TEXT if arch != "qwen2" else TEXT.split(":")[0]
        prompts = [_chat_ids(hf_tok, CHATS[1]), hf_tok(text)["input_ids"]]
        assert prompts[1] == tok.encode(text, add_special_tokens=True)
        ours = _greedy(engine, prompts, 12, ignore_eos=True)
    finally:
        engine.close()
    with torch.no_grad():
        assert ours == [hf_greedy(hf, ids, 12)[0] for ids in prompts]
    # the weights are the loader's, the q/k permutation of llama undone: the engine's own tensors
    loaded = dict(load_model_bundle(str(path)).weights())
    assert set(hf.state_dict()) - {"lm_head.weight"} <= set(loaded)
    assert all(torch.equal(hf.state_dict()[k], w) for k, w in loaded.items())


def test_a_peft_adapter_trained_on_the_export_runs_in_our_engine(tiny_gguf_path, tmp_path):
    """The docs' PEFT route: an adapter made over the exported directory, served by a job on that directory,
    gives PEFT's greedy tokens."""
    pytest.importorskip("peft")
    from tests.lora_helpers import make_adapter
    out = tmp_path / "hf"
    export_hf_dir(str(tiny_gguf_path("llama", "Q8_0")), out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    peft_model = make_adapter(hf, tmp_path / "support", seed=3)
    engine = Engine(EngineConfig(model=str(out), kv_cache_memory=4 * 2**20, loras=(("support", str(tmp_path / "support")),)))
    try:
        ids = engine.tokenizer.encode(TEXT)
        p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        ours = engine.generate([Request("r", ids, p, adapter="support")])[0].token_ids
    finally:
        engine.close()
    with torch.no_grad():
        assert ours == hf_greedy(peft_model, ids, 12)[0] != hf_greedy(hf, ids, 12)[0]


def test_bfloat16_and_sharded_exports_load(tiny_gguf_path, tmp_path):
    from safetensors import safe_open
    path = str(tiny_gguf_path("llama", "Q8_0"))
    loaded = dict(load_model_bundle(path).weights())

    written = export_hf_dir(path, tmp_path / "bf16", dtype="bfloat16")
    assert written["dtype"] == "bfloat16" and written["tensors"] == len(loaded)
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), framework="pt") as st:
        assert all(torch.equal(st.get_tensor(k), w.to(torch.bfloat16)) for k, w in loaded.items())
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"), dtype="auto")
    assert next(hf.parameters()).dtype == torch.bfloat16

    written = export_hf_dir(path, tmp_path / "shards", max_shard_bytes=64 * 1024)
    index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards == [f for f in written["files"] if f.startswith("model-")]
    assert set(index["weight_map"]) == set(loaded) and index["metadata"]["total_size"] == written["bytes"]
    whole = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"), dtype=torch.float32)
    sharded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "shards"))
    assert all(torch.equal(sharded.state_dict()[k], w) for k, w in loaded.items())
    assert set(sharded.state_dict()) == set(whole.state_dict())


def test_exit_codes(tiny_gguf_path, tiny_hf_model_dir, tmp_path, monkeypatch):
    runner = CliRunner()

    def run(*args):
        return runner.invoke(main, ["models", "export", *map(str, args)])

    assert "Exit codes: 0 written" in run("--help").output
    gguf = tiny_gguf_path("llama", "Q8_0")
    r = run("no-such-model", tmp_path / "a")
    assert r.exit_code == 2 and "not a known model name" in r.stderr and not (tmp_path / "a").exists()
    r = run(tiny_hf_model_dir("llama"), tmp_path / "b")
    assert r.exit_code == 2 and "only GGUF checkpoints are exported" in r.stderr
    r = run("dummy:smollm2-135m", tmp_path / "b")
    assert r.exit_code == 2 and "only GGUF checkpoints" in r.stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    r = run(gguf, tmp_path / "full")
    assert r.exit_code == 2 and "not an empty directory" in r.stderr
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    (tmp_path / "file").write_text("x")
    r = run(gguf, tmp_path / "file" / "sub")
    assert r.exit_code == 2 and "is not a directory" in r.stderr
    (tmp_path / "empty").mkdir()
    assert run(gguf, tmp_path / "empty").exit_code == 0 and (tmp_path / "empty" / "model.safetensors").is_file()

    import jobrunner.engine.load.hf_export as hf_export

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(hf_export, "_write_tokenizer", disk_full)
    r = run(gguf, tmp_path / "c")
    assert r.exit_code == 4 and "No space left on device" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "file", "full"]    # no partial DIR, no temp left
