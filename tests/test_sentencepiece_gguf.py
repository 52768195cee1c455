"""SentencePiece vocabularies in GGUF files (Llama 2, Mistral: tokenizer.ggml.model "llama"),
checked token for token against transformers' GGUF tokenizer. The GGUF is made here, offline:
a SentencePiece BPE model with byte fallback trained in a second on a small text, its pieces,
scores and piece types written by gguf's GGUFWriter the way llama.cpp's converter writes them."""
from __future__ import annotations

import io
import random

import pytest

from engine.tokenizer import Tokenizer

spm = pytest.importorskip("sentencepiece")

_TEXT = [
    "The quick brown fox jumps over the lazy dog.", "Batch inference over datasets, row by row, night after night.",
    "Numbers 0123456789, 3.14159 and 2,718,281 are digits.", "def f(x):\n    return x * 2  # a comment",
    "Classification: positive, negative, neutral.", "Il était une fois une petite fille très curieuse.",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein.", "日本語の文章も少しだけ含めます。", "Ёлка и зелёный чай.",
]
# SentencePiece piece types -> GGUF tokenizer.ggml.token_type (llama.cpp: NORMAL 1, UNKNOWN 2,
# CONTROL 3, USER_DEFINED 4, UNUSED 5, BYTE 6)
_UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE, _NORMAL = 2, 3, 4, 5, 6, 1


def _train(vocab_size: int = 420):
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_TEXT * 20), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, user_defined_symbols=["<think>"],
        split_digits=True, minloglevel=2, num_threads=1,
        normalization_rule_name="identity", remove_extra_whitespaces=False)    # as Llama 2's model is trained
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def _piece_type(sp, i: int) -> int:
    for test, kind in ((sp.is_unknown, _UNKNOWN), (sp.is_control, _CONTROL), (sp.is_byte, _BYTE),
                       (sp.is_unused, _UNUSED)):
        if test(i):
            return kind
    return _USER_DEFINED if sp.id_to_piece(i) == "<think>" else _NORMAL


def write_sentencepiece_gguf(path, sp, add_bos: bool | None = True) -> None:
    """A llama-architecture GGUF with only metadata: the hyperparameters transformers needs to pick
    a tokenizer class, and the SentencePiece vocabulary as llama.cpp's converter writes it."""
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, 1), (w.add_context_length, 256), (w.add_embedding_length, 64),
                       (w.add_feed_forward_length, 128), (w.add_head_count, 4), (w.add_head_count_kv, 2)):
        add(value)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("llama")
    n = sp.get_piece_size()
    w.add_token_list([sp.id_to_piece(i) for i in range(n)])
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_token_types([_piece_type(sp, i) for i in range(n)])
    w.add_unk_token_id(sp.unk_id())
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()


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
    sp = _train()
    write_sentencepiece_gguf(path, sp)
    return path, sp


def test_sentencepiece_gguf_matches_transformers(sentencepiece_gguf):
    transformers = pytest.importorskip("transformers")
    path, _ = sentencepiece_gguf
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
