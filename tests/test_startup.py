"""Start-up: a small GGUF's float conversion is kept on disk and memory-mapped at later starts, and
building an engine imports neither torch._dynamo nor sympy (seconds of every start)."""
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import torch

from jobrunner.engine.load import float_cache
from jobrunner.engine.load.loader import load_model_bundle


def _weights(bundle) -> dict:
    """Copies: a conversion's tensors may map its file, which a test then damages."""
    return {name: w.clone() for name, w in bundle.weights()}


def _count_gguf_parses(monkeypatch) -> list:
    from jobrunner.engine.load import gguf
    parses = []
    original = gguf.GGUFFile.__init__

    def counting(self, *a, **k):
        parses.append(1)
        original(self, *a, **k)
    monkeypatch.setattr(gguf.GGUFFile, "__init__", counting)
    return parses


def test_second_load_comes_from_the_conversion_and_equals_the_gguf(tiny_gguf_path, tmp_path, monkeypatch):
    path = tiny_gguf_path("llama", "Q4_1")
    parses = _count_gguf_parses(monkeypatch)
    first = load_model_bundle(str(path), cache_dir=tmp_path)
    assert len(parses) == 1
    second = load_model_bundle(str(path), cache_dir=tmp_path)
    assert len(parses) == 1                                  # nothing parsed: config, tokenizer, weights cached
    assert second.weight_format == "gguf" and second.hf_config == first.hf_config
    for name, w in _weights(first).items():
        assert torch.equal(_weights(second)[name], w), name
    text = "Hello <|im_start|> wörld  12345"
    assert second.tokenizer.encode(text, add_special_tokens=True) == first.tokenizer.encode(text, True)
    assert second.tokenizer.eos_token_ids == first.tokenizer.eos_token_ids
    assert second.tokenizer.chat_template == first.tokenizer.chat_template
    raw = {r.name: r for r in second.raw_weights()}          # the quantized blocks still come from the file
    assert {r.ggml_type for r in raw.values()} >= {"Q4_1"}
    assert len(parses) == 2


def test_damaged_conversion_is_ignored_and_rewritten(tiny_gguf_path, tmp_path, monkeypatch, caplog):
    path = tiny_gguf_path("llama", "Q8_0")
    expected = _weights(load_model_bundle(str(path), cache_dir=tmp_path))
    weights_file = float_cache.cache_dir(path, tmp_path) / "model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="jobrunner"):
        again = load_model_bundle(str(path), cache_dir=tmp_path)
    assert "damaged model conversion" in caplog.text
    assert all(torch.equal(w, expected[n]) for n, w in _weights(again).items())
    assert float_cache.read(float_cache.cache_dir(path, tmp_path)) is not None   # rewritten whole


def test_a_conversion_another_process_finished_is_kept_not_replaced(tiny_gguf_path, tmp_path):
    """Two workers converting one model at once (Ray workers on one cache): the later writer keeps the copy
    the first one finished, which a reader may be loading; it never removes it (issue 41, item 4)."""
    path = tiny_gguf_path("llama", "Q8_0")
    bundle = load_model_bundle(str(path), cache_dir=tmp_path)
    directory = float_cache.cache_dir(path, tmp_path)
    inode = (directory / "model.safetensors").stat().st_ino
    assert float_cache.write(directory, bundle.hf_config, bundle.tokenizer, bundle.weights())
    assert (directory / "model.safetensors").stat().st_ino == inode
    assert not [p for p in directory.parent.iterdir() if p.name.startswith(".tmp-")]


def test_a_changed_file_is_converted_again_and_replaces_the_old_conversion(tiny_gguf_path, tmp_path):
    path = tmp_path / "model.gguf"
    shutil.copy(tiny_gguf_path("llama", "Q8_0"), path)
    load_model_bundle(str(path), cache_dir=tmp_path)
    old = float_cache.cache_dir(path, tmp_path)
    shutil.copy(tiny_gguf_path("llama", "F32"), path)
    os.utime(path, ns=(old.stat().st_mtime_ns + 10**9,) * 2)
    bundle = load_model_bundle(str(path), cache_dir=tmp_path)
    new = float_cache.cache_dir(path, tmp_path)
    assert new != old and new.exists() and not old.exists()
    assert all(torch.equal(w, e) for (_, w), (_, e) in
               zip(bundle.weights(), load_model_bundle(str(tiny_gguf_path("llama", "F32")), cache_dir=tmp_path)
                   .weights()))


def test_a_model_too_large_to_copy_loads_from_the_file(tiny_gguf_path, tmp_path, monkeypatch):
    monkeypatch.setattr(float_cache, "MAX_FLOAT_BYTES", 1000)
    path = tiny_gguf_path("llama", "Q8_0")
    bundle = load_model_bundle(str(path), cache_dir=tmp_path)
    assert not (tmp_path / "float").exists() or not any((tmp_path / "float").rglob("model.safetensors"))
    direct = _weights(bundle)
    monkeypatch.undo()
    copied = _weights(load_model_bundle(str(path), cache_dir=tmp_path / "copied"))
    assert len(direct) > 0 and direct.keys() == copied.keys()
    assert all(torch.equal(direct[n], copied[n]) for n in direct)      # each pass maps the file anew, pages dropped
    assert [n for n, _ in bundle.weights()] == list(direct)             # and a second pass reads it all again


def test_building_an_engine_imports_neither_dynamo_nor_sympy(tiny_gguf_path, tmp_path):
    code = textwrap.dedent(f"""
        import sys
        from jobrunner.engine.config.engine_config import EngineConfig
        from jobrunner.engine.core.engine import Engine
        from jobrunner.engine.api.request import Request, SamplingParams
        engine = Engine(EngineConfig(model={str(tiny_gguf_path("llama", "Q8_0"))!r}, kv_cache_memory=1 << 20))
        engine.generate([Request("a", [1, 2, 3], SamplingParams(max_tokens=2))])
        print(sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules))
    """)
    env = dict(os.environ, JOBRUNNER_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
