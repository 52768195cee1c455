"""benchmarks/billion.py's model files: the random checkpoint with the default model's tokenizer, and its GGUF F16
written as llama.cpp's converter writes it, hold the same model (a small shape here; the benchmark's is 1B)."""
from __future__ import annotations

import pytest

from benchmarks import billion

SMALL = {**billion.SHAPE, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16}


@pytest.mark.default_model
def test_the_checkpoint_and_its_gguf_generate_the_same_tokens(default_gguf_path, tmp_path):
    pytest.importorskip("gguf")
    from jobrunner.engine.api.request import Request, SamplingParams
    from jobrunner.engine.config.engine_config import EngineConfig
    from jobrunner.engine.core.engine import Engine

    ckpt = billion.make_model(tmp_path / "model", layers=2, shape=SMALL)
    files = billion.make_ggufs(ckpt, python=None)            # no llama.cpp here: F16 only
    assert set(files) == {"F16"} and (ckpt / "done").is_file()
    tokens = []
    for model in (ckpt, files["F16"]):
        engine = Engine(EngineConfig(model=str(model), dtype="float32", kv_cache_memory=8 << 20))
        assert engine.tokenizer.vocab_size == 49152              # the default model's tokenizer
        out = engine.generate([Request("r", engine.tokenizer.encode("Write a story about"),
                                       SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))])
        tokens.append(out[0].token_ids)
        engine.close()
    assert tokens[0] == tokens[1] and len(tokens[0]) == 8


def test_the_table_and_targets_read_the_runs():
    runs = {"free-generation": {
        "float32": {"wall_s": 30.0, "output_tokens_per_s": 34.0, "peak_rss_mb": 6400.0},
        "int4": {"wall_s": 36.0, "output_tokens_per_s": 29.0, "peak_rss_mb": 3000.0},
        "transformers": {"wall_s": 60.0, "output_tokens_per_s": 16.0, "peak_rss_mb": 6600.0},
        "llama.cpp-Q4_0": {"skipped": "no Q4_0 file (needs --llamacpp-python)"}}}
    table = billion.table(runs)
    assert "| free-generation | int4 | 36.0 | 29.0 | 3000 | 1.20x |" in table
    assert "| free-generation | llama.cpp-Q4_0 | no Q4_0 file (needs --llamacpp-python) | | | |" in table
    lines = billion.target_lines(runs)
    assert "free-generation: float32 / transformers = 0.50x (target <= 0.6x: met)" in lines
    assert "free-generation: int4 peak memory / float32's = 0.47x (target <= 0.5x)" in lines
    assert not any("llama.cpp" in line for line in lines)        # a skipped peer gives no ratio
