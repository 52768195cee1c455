"""SentencePiece vocabularies in GGUF files (Llama 2, Mistral: tokenizer.ggml.model "llama"),
checked token for token against transformers' GGUF tokenizer, on a tiny vocabulary trained here
(tests/sentencepiece_gguf.py)."""
from __future__ import annotations

import random

import pytest

from jobrunner.engine.load.tokenizer import Tokenizer

pytest.importorskip("sentencepiece")
from sentencepiece_gguf import train, write_sentencepiece_gguf  # noqa: E402


def _strings(n: int = 300) -> list[str]:
    """Text of every kind a tokenizer gets wrong first: unicode, whitespace runs, digits, characters
    only byte fallback can spell, special tokens inside text."""
    fixed = ["", " ", "  ", "hello", " hello", "  hello  world  ", "\n", "\n\nx", "\t\ttab", "a\u00a0b",
             "The quick brown fox", "12345678901234567890", "3.14159 2,718", "😀 emoji 🚀✨", "日本語テキスト",
             "żółć", "naïve café", "<s>the start</s> end", "x <think>hmm</think> y", "<unk>", "▁literal▁", "ǅ ǈ ﬁ"]
    rng = random.Random(0)
    pool = list("abcdefghijklmnopqrstuvwxyzABCDEF0123456789 .,;:!?'\"()-_\n\t") + ["  ", "   ", "日", "本",
            "é", "ü", "ß", "Ё", "😀", "🚀", "\u200b", "ﬁ", "€", "<s>", "</s>", "<think>", "fox", "the ", " over"]
    return fixed + ["".join(rng.choice(pool) for _ in range(rng.randint(1, 40))) for _ in range(n - len(fixed))]


@pytest.fixture(scope="module")
def sentencepiece_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("sp-gguf") / "tiny-sp.gguf"
    sp = train()
    write_sentencepiece_gguf(path, sp)
    return path, sp


@pytest.mark.parametrize("arch", ["llama", "gemma2", "phi3"])
def test_sentencepiece_gguf_matches_transformers(sentencepiece_gguf, tmp_path, arch):
    """Each family's spacing (engine.sentencepiece_vocab.STYLES), on 300 strings."""
    transformers = pytest.importorskip("transformers")
    path, sp = sentencepiece_gguf
    if arch != "llama":
        path = tmp_path / f"{arch}.gguf"
        write_sentencepiece_gguf(path, train(prefix_space=False) if arch == "gemma2" else sp, arch=arch)
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = Tokenizer.from_gguf(str(path))
    strings = _strings()
    for text in strings:
        want = ref.encode(text, add_special_tokens=False)
        assert ours.encode(text) == want, text
        assert ours.encode(text, add_special_tokens=True) == ref.encode(text), text
        assert ours.decode(want) == ref.decode(want, skip_special_tokens=True), text
        assert ours.decode(want, skip_special_tokens=False) == ref.decode(want), text
    assert ours.encode_batch(strings) == [ref.encode(t, add_special_tokens=False) for t in strings]
    assert ours.bos_token_id == ref.bos_token_id and ours.eos_token_ids == (ref.eos_token_id,)


def test_sentencepiece_gguf_spells_like_sentencepiece(sentencepiece_gguf):
    """SentencePiece itself (what llama.cpp follows) gives the same pieces, except where transformers
    (the reference) differs from it: special tokens, which its encoder does not match whole, and
    text that starts with a space (or "▁"), where it adds a second one."""
    path, sp = sentencepiece_gguf
    ours = Tokenizer.from_gguf(str(path))
    checked = [t for t in _strings() if "<" not in t and not t[:1].isspace() and t[:1] != "▁"]
    assert len(checked) > 100
    for text in checked:
        assert ours.encode(text) == sp.encode(text), text


def test_add_bos_follows_the_file(sentencepiece_gguf, tmp_path):
    path, sp = sentencepiece_gguf
    assert Tokenizer.from_gguf(str(path)).encode("hi", add_special_tokens=True)[0] == sp.bos_id()
    for add_bos, first in ((False, None), (None, sp.bos_id())):     # unsaid: BOS, as llama.cpp adds it
        p = tmp_path / f"bos-{add_bos}.gguf"
        write_sentencepiece_gguf(p, sp, add_bos=add_bos)
        ids = Tokenizer.from_gguf(str(p)).encode("hi", add_special_tokens=True)
        assert (ids[0] == sp.bos_id()) == (first is not None)


def test_token_bytes_of_sentencepiece_pieces(sentencepiece_gguf):
    """What the logprobs column spells: a byte-fallback piece is its byte, "▁" a space (decoding one
    token alone would give U+FFFD and strip the space)."""
    ours = Tokenizer.from_gguf(str(sentencepiece_gguf[0]))
    byte = ours.token_to_id("<0xE2>")
    assert byte is not None and ours.token_bytes(byte) == b"\xe2"
    spaced = next(t for t in (ours.id_to_token(i) for i in range(ours.vocab_size)) if t.startswith("▁") and len(t) > 1)
    assert ours.token_bytes(ours.token_to_id(spaced)) == (" " + spaced[1:]).encode()
