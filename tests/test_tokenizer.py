"""Tokenizer parity with transformers (default GGUF model, tiny HF and GGUF tokenizers), chat
templates, and the byte-level fallback."""
from __future__ import annotations

import json

import jinja2
import pytest

from conftest import TINY_CHAT_TEMPLATE, make_tiny_tokenizer
from jobrunner.engine.api.errors import ModelError
from jobrunner.engine.load.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "  two leading spaces, trailing   ",
    "héllo wörld ñ ç — «quotes» 日本語のテキスト 中文 한국어 Ελληνικά русский",
    "emoji 🙂👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "tabs\tand\nnewlines\n\n\r\n and runs of spaces          end",
    "1234567890 3.14159 -42 1e-5 2024-06-01 $1,000.00",
    "def f(x):\n    return x**2  # code\n\nclass A:\n\tpass\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "a<|endoftext|>b <|im_end|>c",
    "<repo_name>x<file_sep>",
    "     ",
    "",
    "don't you'll I'M we've they're",
    "\u00a0nbsp\u200bzero-width\ufeffbom",
    "<|im_start partial <| im_end|>",
]

CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c 🙂"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "  spaced\n\nlines  "}],
]


# -- the default model (GGUF) against transformers --------------------------------

@pytest.fixture(scope="module")
def default_tokenizer(default_gguf_path) -> Tokenizer:
    return Tokenizer.from_gguf(str(default_gguf_path))


@pytest.mark.default_model
def test_default_encode_equals_transformers(default_tokenizer, hf_default_tokenizer):
    for text in TEXTS:
        ref = hf_default_tokenizer.encode(text, add_special_tokens=False)
        assert default_tokenizer.encode(text) == ref, text
        assert default_tokenizer.encode(text, add_special_tokens=True) == hf_default_tokenizer(text)["input_ids"]
    assert default_tokenizer.encode_batch(TEXTS) == [hf_default_tokenizer.encode(t, add_special_tokens=False)
                                                     for t in TEXTS]
    assert default_tokenizer.encode("<|im_start|>") == [1]  # special tokens in text stay whole


@pytest.mark.default_model
def test_default_decode(default_tokenizer, hf_default_tokenizer):
    for text in TEXTS:
        ids = default_tokenizer.encode(text)
        assert default_tokenizer.decode(ids, skip_special_tokens=False) == text
        for skip in (True, False):
            assert default_tokenizer.decode(ids, skip_special_tokens=skip) == hf_default_tokenizer.decode(
                ids, skip_special_tokens=skip)
    assert default_tokenizer.decode(default_tokenizer.encode("<|im_start|>user\nhi<|im_end|>")) == "user\nhi"


@pytest.mark.default_model
def test_default_chat_template_equals_transformers(default_tokenizer, hf_default_tokenizer):
    for chat in CHATS:
        for gen in (True, False):
            ref = hf_default_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert default_tokenizer.apply_chat_template(chat, add_generation_prompt=gen) == ref
    # the template adds a default system prompt when none is given
    assert "You are a helpful AI assistant named SmolLM" in default_tokenizer.apply_chat_template(CHATS[0])


@pytest.mark.default_model
def test_default_special_ids(default_tokenizer):
    t = default_tokenizer
    assert t.bos_token_id == 1 and t.eos_token_ids == (2,) and t.vocab_size == 49152 and t.has_chat_template
    assert t.token_to_id("<|im_end|>") == 2 and t.id_to_token(0) == "<|endoftext|>"


# -- tiny tokenizers (no default model needed) ------------------------------------

def test_tiny_hf_dir_tokenizer_equals_transformers(tiny_hf_model_dir):
    import fsspec
    from transformers import AutoTokenizer

    path = tiny_hf_model_dir("llama")
    ours = Tokenizer.from_hf_dir(fsspec.filesystem("file"), str(path))
    ref = AutoTokenizer.from_pretrained(str(path))
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False), text
        assert ours.encode(text, add_special_tokens=True) == ref(text)["input_ids"], text
        assert ours.decode(ours.encode(text)) == ref.decode(ref.encode(text, add_special_tokens=False),
                                                            skip_special_tokens=True)
    for chat in CHATS:
        assert ours.apply_chat_template(chat) == ref.apply_chat_template(chat, tokenize=False,
                                                                         add_generation_prompt=True)
    assert ours.bos_token_id == 1 and ours.eos_token_ids == (2,) and ours.vocab_size == 320


def test_tiny_gguf_tokenizer_equals_hf_dir(tiny_gguf_path, tiny_hf_model_dir):
    import fsspec

    hf = Tokenizer.from_hf_dir(fsspec.filesystem("file"), str(tiny_hf_model_dir("llama")))
    ours = Tokenizer.from_gguf(str(tiny_gguf_path("llama", "Q8_0")))
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    assert ours.encode_batch(TEXTS) == hf.encode_batch(TEXTS)
    for chat in CHATS:
        assert ours.apply_chat_template(chat) == hf.apply_chat_template(chat)
    assert ours.eos_token_ids == hf.eos_token_ids == (2,)


def _write_dir(path, tokenizer_config: dict, generation_config: dict | None = None):
    make_tiny_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


def test_hf_dir_template_list_and_eos_sources(tmp_path):
    cfg = {"eos_token": {"content": "<|endoftext|>"}, "bos_token": "<|im_start|>",
           "chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ 'x' }}"}]}
    t = Tokenizer.from_hf_dir(None, str(_write_dir(tmp_path, cfg, {"eos_token_id": [2, 0]})))
    assert t.apply_chat_template([]) == "x"
    assert t.eos_token_ids == (2, 0) and t.bos_token_id == 1  # generation_config first, then the tokenizer's


def test_hf_dir_without_template(tmp_path):
    t = Tokenizer.from_hf_dir(None, str(_write_dir(tmp_path, {"eos_token": "<|endoftext|>"})))
    assert not t.has_chat_template and t.eos_token_ids == (0,)
    with pytest.raises(ValueError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "hi"}])


def test_hf_dir_without_tokenizer_json(tmp_path):
    with pytest.raises(ModelError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(None, str(tmp_path))


# -- chat template rendering features ---------------------------------------------

def _with_template(template: str) -> Tokenizer:
    t = Tokenizer.bytes_fallback(300)
    t.chat_template = template
    return t


def test_template_helpers_match_transformers(tiny_hf_model_dir):
    from transformers import AutoTokenizer

    path = tiny_hf_model_dir("llama")
    msgs = [{"role": "user", "content": "<b>&'\"é</b>"}, {"role": "assistant", "content": "ok", "extra": None}]
    template = (
        "{% for m in messages %}{{ m | tojson }}{{ m | tojson(indent=2) }}{% if loop.index == 1 %}{% continue %}"
        "{% endif %}{{ m.extra is defined }}{% endfor %}\n  {% if true %}\n    lstrip{% endif %}\n"
        "{% generation %}gen{% endgeneration %}{{ bos_token }}{{ eos_token }}{{ custom }}"
    )
    ours = Tokenizer.from_hf_dir(None, str(path))
    ours.chat_template = template
    ref = AutoTokenizer.from_pretrained(str(path))
    for gen in (True, False):
        assert ours.apply_chat_template(msgs, add_generation_prompt=gen, custom="C") == ref.apply_chat_template(
            msgs, chat_template=template, tokenize=False, add_generation_prompt=gen, custom="C")


def test_template_raise_exception_and_strftime():
    with pytest.raises(jinja2.TemplateError, match="no system"):
        _with_template("{{ raise_exception('no system') }}").apply_chat_template([])
    year = _with_template("{{ strftime_now('%Y') }}").apply_chat_template([])
    assert year.isdigit() and len(year) == 4


def test_template_is_sandboxed():
    with pytest.raises(jinja2.exceptions.SecurityError):
        _with_template("{% set _ = messages.append(1) %}").apply_chat_template([])


def test_template_syntax_error_is_a_model_error():
    with pytest.raises(ModelError, match="chat template"):
        _with_template("{% for %}").apply_chat_template([])


# -- byte-level fallback ----------------------------------------------------------

def test_bytes_fallback():
    t = Tokenizer.bytes_fallback(1000)
    text = "héllo 🙂\n\tend"
    ids = t.encode(text)
    assert ids == list(text.encode("utf-8")) and t.decode(ids) == text
    assert t.encode_batch([text, "ab"]) == [ids, [97, 98]]
    assert t.encode("<|im_start|>x<|im_end|>") == [257, 120, 258]
    assert t.decode([104, 105, 258, 999]) == "hi"  # special skipped, ids past the tokenizer's vocab dropped
    assert t.vocab_size == 259 and t.bos_token_id == 256 and t.eos_token_ids == (256, 258)
    assert t.apply_chat_template([{"role": "user", "content": "q"}]) == (
        "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError):
        Tokenizer.bytes_fallback(100)


def test_tiny_template_is_chatml():
    t = _with_template(TINY_CHAT_TEMPLATE)
    out = t.apply_chat_template([{"role": "user", "content": "hi"}])
    assert out.startswith("<|im_start|>system\n") and out.endswith("<|im_start|>assistant\n")
