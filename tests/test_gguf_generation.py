"""GGUF checkpoints generate as their HF originals do: greedy tokens identical to transformers'
`generate` and chosen-token logprobs within 1e-4 (float32, F32 GGUF), with chunked prefill, for
Qwen2 and Qwen3 (byte-level BPE vocabularies) and Llama with a SentencePiece vocabulary."""
from __future__ import annotations

import fsspec
import pytest

from benchmarks.gguf_convert import add_hparams, add_tensors
from conftest import read_json
from jobrunner.engine.config.engine_config import EngineConfig
from jobrunner.engine.core.engine import Engine
from jobrunner.engine.api.request import Request, SamplingParams
from jobrunner.engine.load.tokenizer import Tokenizer
from tiny import hf_greedy

PROMPT = "The quick brown fox jumps over the lazy dog. Numbers 0123456789!"


def _engine(path) -> Engine:
    # a step budget shorter than the prompt: its prefill runs in chunks
    return Engine(EngineConfig(model=str(path), kv_cache_memory=4 * 2**20, max_num_batched_tokens=8))


def _assert_greedy_like_transformers(engine: Engine, hf_dir, prompt_ids: list[int], n: int = 24) -> None:
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    want_tokens, want_lps = hf_greedy(hf, prompt_ids, n)
    out = engine.generate([Request("r", prompt_ids, SamplingParams(max_tokens=n, ignore_eos=True, logprobs=0))])[0]
    assert out.token_ids == want_tokens
    got_lps = [lp.logprob for lp in out.completions[0].logprobs]
    assert max(abs(a - b) for a, b in zip(got_lps, want_lps)) < 1e-4


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_byte_level_gguf_generates_like_transformers(tiny_gguf_path, tiny_hf_model_dir, arch):
    engine = _engine(tiny_gguf_path(arch, "F32"))
    prompt_ids = engine.tokenizer.encode(PROMPT)
    assert prompt_ids == Tokenizer.from_hf_dir(fsspec.filesystem("file"), str(tiny_hf_model_dir(arch))).encode(PROMPT)
    _assert_greedy_like_transformers(engine, tiny_hf_model_dir(arch), prompt_ids)


def test_sentencepiece_gguf_generates_like_transformers(tiny_hf_model_dir, tmp_path):
    pytest.importorskip("sentencepiece")
    import gguf
    from sentencepiece_gguf import add_sentencepiece_vocab, train

    sp = train()
    src = tiny_hf_model_dir("llama", vocab_size=sp.get_piece_size())
    cfg = read_json(src / "config.json")
    path = tmp_path / "tiny-llama-sp.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    add_hparams(w, cfg)
    add_sentencepiece_vocab(w, sp)
    add_tensors(w, src, "llama", "F32", cfg)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    engine = _engine(path)
    prompt_ids = engine.tokenizer.encode(PROMPT, add_special_tokens=True)
    assert prompt_ids == [sp.bos_id()] + sp.encode(PROMPT)
    _assert_greedy_like_transformers(engine, src, prompt_ids)
