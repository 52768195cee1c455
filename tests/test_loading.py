"""Model loading: HF safetensors directories, GGUF files, dummy configs, remote URLs. (Known model names
and their cache: tests/test_models.py.)"""
from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import DEFAULT_MODEL, TINY_MODEL_VOCAB, read_json
from jobrunner.engine.api.errors import ModelError
from jobrunner.engine.load.gguf import GGUFFile, dequantize
from jobrunner.engine.load.loader import DUMMY_CONFIGS, load_model_bundle

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


def _safetensors_dict(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _assert_same_weights(got: dict, ref: dict, atol: float = 0.0) -> None:
    assert set(got) == set(ref), set(got) ^ set(ref)
    for name, t in ref.items():
        assert got[name].shape == t.shape, name
        torch.testing.assert_close(got[name].float(), t.float(), atol=atol, rtol=0, msg=name)


# -- HF safetensors directories ---------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_hf_dir_loads(tiny_hf_model_dir, arch):
    import transformers

    path = tiny_hf_model_dir(arch)
    bundle = load_model_bundle(str(path))
    assert bundle.weight_format == "safetensors" and bundle.source == str(path)
    c, hf = bundle.config, read_json(path / "config.json")
    assert c.architecture == hf["architectures"][0]
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (TINY_MODEL_VOCAB, 64, 128, 2)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (4, 2, 16)
    assert c.attention_bias == (arch == "qwen2") and c.qk_norm == (arch == "qwen3")
    assert not c.tie_word_embeddings
    # every parameter of the HF model, with its shape and values
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    got = dict(bundle.weights())
    _assert_same_weights(got, model.state_dict())
    assert dict(bundle.weights()).keys() == got.keys()  # each call is a fresh pass
    assert bundle.tokenizer.has_chat_template and 2 in bundle.tokenizer.eos_token_ids


def test_tied_embeddings_have_no_lm_head(tiny_hf_model_dir):
    bundle = load_model_bundle(str(tiny_hf_model_dir("llama", tie_word_embeddings=True)))
    names = [n for n, _ in bundle.weights()]
    assert bundle.config.tie_word_embeddings and "lm_head.weight" not in names
    assert "model.embed_tokens.weight" in names


def test_sharded_safetensors_with_index(tiny_hf_model_dir):
    path = tiny_hf_model_dir("qwen2", max_shard_size="60KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1
    bundle = load_model_bundle(str(path))
    _assert_same_weights(dict(bundle.weights()), _safetensors_dict(path))


def test_weights_are_yielded_one_at_a_time(tiny_hf_model_dir):
    it = load_model_bundle(str(tiny_hf_model_dir("llama"))).weights()
    name, tensor = next(it)  # a generator: nothing beyond the current tensor is materialized
    assert isinstance(name, str) and tensor.is_floating_point()


def _to_memory_fs(path: Path) -> str:
    import fsspec

    fs, root = fsspec.filesystem("memory"), f"/tiny-{uuid.uuid4().hex[:8]}"
    for f in path.iterdir():
        fs.pipe(f"{root}/{f.name}", f.read_bytes())
    return f"memory://{root}"


def test_memory_url_dir_is_copied_then_loaded(tiny_hf_model_dir, tmp_path):
    path = tiny_hf_model_dir("qwen2", max_shard_size="60KB")
    url = _to_memory_fs(path)
    bundle = load_model_bundle(url, cache_dir=tmp_path)
    assert bundle.source == url and bundle.weight_format == "safetensors"
    _assert_same_weights(dict(bundle.weights()), _safetensors_dict(path))
    assert bundle.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("assistant\n")
    copied = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "remote").rglob("*") if p.is_file()}
    assert "config.json" in copied and "model.safetensors.index.json" in copied
    load_model_bundle(url, cache_dir=tmp_path)  # a second load reuses the copies
    assert copied == {p.name: p.stat().st_mtime_ns for p in (tmp_path / "remote").rglob("*") if p.is_file()}


def test_memory_url_gguf(tiny_gguf_path, tiny_hf_model_dir, tmp_path):
    import fsspec

    url = f"memory://g-{uuid.uuid4().hex[:8]}/tiny.gguf"
    fsspec.filesystem("memory").pipe(url.removeprefix("memory:/"), tiny_gguf_path("llama", "F32").read_bytes())
    bundle = load_model_bundle(url, cache_dir=tmp_path)
    assert bundle.weight_format == "gguf"
    _assert_same_weights(dict(bundle.weights()), _safetensors_dict(tiny_hf_model_dir("llama")))


def test_dir_with_one_gguf_and_gguf_without_suffix(tiny_gguf_path, tmp_path):
    shutil.copy(tiny_gguf_path("llama", "Q8_0"), tmp_path)
    assert load_model_bundle(str(tmp_path)).weight_format == "gguf"
    shutil.copy(tiny_gguf_path("llama", "Q8_0"), tmp_path / "model.bin")
    assert load_model_bundle(str(tmp_path / "model.bin")).weight_format == "gguf"  # told by its magic


def test_remote_errors_become_model_errors(monkeypatch):
    from fsspec.implementations.memory import MemoryFileSystem

    def unreachable(self, path, **kwargs):
        raise ConnectionError("Name or service not known")
    monkeypatch.setattr(MemoryFileSystem, "exists", unreachable)
    with pytest.raises(ModelError, match="cannot read model 'memory://x'.*Name or service"):
        load_model_bundle("memory://x")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_truncated_safetensors_names_the_file(tiny_hf_model_dir, tmp_path):
    path = _copy(tiny_hf_model_dir("llama"), tmp_path / "m")
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ModelError, match=r"model\.safetensors.*(truncated|corrupt)"):
        load_model_bundle(str(path))


def test_corrupt_shard_names_the_file(tiny_hf_model_dir, tmp_path):
    path = _copy(tiny_hf_model_dir("qwen2", max_shard_size="60KB"), tmp_path / "m")
    shard = sorted(path.glob("*.safetensors"))[1]
    shard.write_bytes(b"\xff" * 64)
    with pytest.raises(ModelError, match=shard.name):
        load_model_bundle(str(path))


def test_missing_shard_is_reported(tiny_hf_model_dir, tmp_path):
    path = _copy(tiny_hf_model_dir("qwen2", max_shard_size="60KB"), tmp_path / "m")
    shard = sorted(path.glob("*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(ModelError, match=shard.name):
        load_model_bundle(str(path))


def test_pickled_weights_are_refused(tiny_hf_model_dir, tmp_path):
    path = tmp_path / "m"
    path.mkdir()
    shutil.copy(tiny_hf_model_dir("llama") / "config.json", path)
    (path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelError, match="pickled"):
        load_model_bundle(str(path))


def test_a_name_is_not_a_checkpoint():
    """The engine loads paths and URLs; known names are the CLI's (jobrunner.models)."""
    with pytest.raises(ModelError, match="'no-such-model' is not an existing path"):
        load_model_bundle("no-such-model")
    with pytest.raises(ModelError, match="not an existing path"):
        load_model_bundle(DEFAULT_MODEL)


def test_unsupported_architecture(tiny_hf_model_dir, tmp_path):
    import json

    path = _copy(tiny_hf_model_dir("llama"), tmp_path / "m")
    cfg = read_json(path / "config.json")
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelError, match="GPT2LMHeadModel"):
        load_model_bundle(str(path))


def test_registry_names_every_family_and_lists_supported_architectures():
    from jobrunner.engine.config.model_config import ModelConfig
    from jobrunner.engine.models import ARCHITECTURES, GGUF_ARCHITECTURES, model_class
    from jobrunner.engine.models.base import CausalLM

    assert all(issubclass(model_class(name), CausalLM) for name in ARCHITECTURES)
    assert all(g.hf in ARCHITECTURES for g in GGUF_ARCHITECTURES.values())
    with pytest.raises(ValueError, match=r"'GPT2LMHeadModel'; supported: .*LlamaForCausalLM.*Qwen3ForCausalLM"):
        ModelConfig.from_hf({"architectures": ["GPT2LMHeadModel"]})


# -- dummy ------------------------------------------------------------------------

def test_dummy_builtin_configs():
    b = load_model_bundle("dummy:llama-3.1-8b")
    assert b.weight_format == "dummy" and list(b.weights()) == []
    c = b.config
    assert (c.num_layers, c.hidden_size, c.num_kv_heads, c.vocab_size) == (32, 4096, 8, 128256)
    assert c.rope_scaling_dict["rope_type"] == "llama3"
    assert b.tokenizer.decode(b.tokenizer.encode("héllo")) == "héllo"
    s = load_model_bundle("dummy:smollm2-135m").config
    assert (s.num_layers, s.hidden_size, s.num_heads, s.num_kv_heads, s.vocab_size) == (30, 576, 9, 3, 49152)
    assert s.tie_word_embeddings and s.rope_theta == 100000.0
    assert set(DUMMY_CONFIGS) >= {"llama-3.1-8b", "smollm2-135m"}


def test_dummy_from_config_path_uses_its_tokenizer(tiny_hf_model_dir):
    path = tiny_hf_model_dir("qwen3")
    b = load_model_bundle(f"dummy:{path / 'config.json'}")
    assert b.weight_format == "dummy" and b.config.qk_norm and list(b.weights()) == []
    assert b.tokenizer.has_chat_template and b.tokenizer.vocab_size == 320


def test_dummy_unknown():
    with pytest.raises(ModelError, match="llama-3.1-8b"):
        load_model_bundle("dummy:no-such-config")


# -- GGUF -------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_f32_equals_hf_weights(tiny_gguf_path, tiny_hf_model_dir, arch):
    """Exact values: names mapped and llama's q/k permutation undone."""
    bundle = load_model_bundle(str(tiny_gguf_path(arch, "F32")))
    assert bundle.weight_format == "gguf"
    hf = read_json(tiny_hf_model_dir(arch) / "config.json")
    c = bundle.config
    assert c.architecture == hf["architectures"][0]
    assert (c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        hf["vocab_size"], 64, 2, 4, 2, 16)
    assert c.attention_bias == (arch == "qwen2") and c.qk_norm == (arch == "qwen3")
    _assert_same_weights(dict(bundle.weights()), _safetensors_dict(tiny_hf_model_dir(arch)))


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_tiny_gguf_dequantization(tiny_gguf_path, tiny_hf_model_dir, qtype):
    import gguf

    f = GGUFFile(tiny_gguf_path("llama", qtype))
    for t in f.reader.tensors:  # our torch dequantization == gguf's numpy reference, bit for bit
        shape = tuple(reversed(t.shape.tolist()))
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        torch.testing.assert_close(dequantize(t.data, t.tensor_type.name, shape), torch.from_numpy(ref),
                                   atol=0, rtol=0)
    ref = _safetensors_dict(tiny_hf_model_dir("llama"))
    _assert_same_weights(dict(f.iter_tensors()), ref, atol=0.02)  # quantization error only


def test_raw_tensors_are_in_hf_row_order(tiny_gguf_path, tiny_hf_model_dir):
    f = GGUFFile(tiny_gguf_path("llama", "F32"))
    ref = _safetensors_dict(tiny_hf_model_dir("llama"))
    for raw in f.iter_raw_tensors():
        assert raw.ggml_type == "F32" and raw.data.dtype == np.uint8
        torch.testing.assert_close(torch.from_numpy(raw.data.view(np.float32).reshape(raw.shape)), ref[raw.name])
    q = GGUFFile(tiny_gguf_path("llama", "Q4_1"))
    deq = dict(q.iter_tensors())
    for raw in q.iter_raw_tensors():
        torch.testing.assert_close(dequantize(raw.data, raw.ggml_type, raw.shape), deq[raw.name], atol=0, rtol=0)


def test_tiny_gguf_tokenizer_metadata(tiny_gguf_path):
    b = load_model_bundle(str(tiny_gguf_path("llama", "Q8_0")))
    assert b.tokenizer.bos_token_id == 1 and b.tokenizer.eos_token_ids == (2,)
    assert b.tokenizer.has_chat_template and b.hf_config["eos_token_id"] == 2


def test_truncated_gguf_names_the_file(tiny_gguf_path, tmp_path):
    src = tiny_gguf_path("llama", "Q8_0")
    data = src.read_bytes()
    for name, cut in [("tail.gguf", len(data) - 100), ("head.gguf", 200)]:
        bad = tmp_path / name
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelError, match=name):
            load_model_bundle(str(bad))
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 60)
    with pytest.raises(ModelError, match="garbage.gguf"):
        load_model_bundle(str(bad))


# -- the default model ------------------------------------------------------------

@pytest.mark.default_model
def test_default_model_bundle(default_gguf_path):
    from jobrunner.models.known import resolve_model
    b = load_model_bundle(resolve_model(DEFAULT_MODEL))
    c = b.config
    assert b.weight_format == "gguf" and str(default_gguf_path) in b.source
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (
        "LlamaForCausalLM", 30, 576, 9, 3)
    assert (c.vocab_size, c.intermediate_size, c.head_dim, c.rope_theta) == (49152, 1536, 64, 100000.0)
    assert c.tie_word_embeddings and c.bos_token_id == 1 and c.eos_token_ids == (2,)
    assert b.tokenizer.eos_token_ids == (2,)


@pytest.mark.default_model
@pytest.mark.slow
def test_default_weights_equal_transformers(default_gguf_path, hf_default_model):
    ref = hf_default_model.state_dict()
    names = set()
    for name, w in GGUFFile(default_gguf_path).iter_tensors():
        names.add(name)
        assert w.dtype == torch.float32 and torch.equal(w, ref[name]), name  # q/k permutation included
    assert names == set(ref) - {"lm_head.weight"}  # tied
