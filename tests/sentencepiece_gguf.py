"""A tiny SentencePiece vocabulary in a GGUF file, made offline: a SentencePiece BPE model with byte
fallback trained in a second on a small text, its pieces, scores and piece types written by gguf's
GGUFWriter the way llama.cpp's converter writes them (tokenizer.ggml.model "llama")."""
from __future__ import annotations

import io

import sentencepiece as spm

_TEXT = [
    "The quick brown fox jumps over the lazy dog.", "Batch inference over datasets, row by row, night after night.",
    "Numbers 0123456789, 3.14159 and 2,718,281 are digits.", "def f(x):\n    return x * 2  # a comment",
    "Classification: positive, negative, neutral.", "Il était une fois une petite fille très curieuse.",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein.", "日本語の文章も少しだけ含めます。", "Ёлка и зелёный чай.",
]
# SentencePiece piece types -> GGUF tokenizer.ggml.token_type (llama.cpp: NORMAL 1, UNKNOWN 2,
# CONTROL 3, USER_DEFINED 4, UNUSED 5, BYTE 6)
_UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE, _NORMAL = 2, 3, 4, 5, 6, 1


def train(vocab_size: int = 420, prefix_space: bool = True):
    """prefix_space False: as Gemma's model is trained (no dummy prefix, whitespace-only pieces)."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_TEXT * 20), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, user_defined_symbols=["<think>"],
        split_digits=True, minloglevel=2, num_threads=1, add_dummy_prefix=prefix_space,
        allow_whitespace_only_pieces=not prefix_space,
        normalization_rule_name="identity", remove_extra_whitespaces=False)    # as Llama 2's model is trained
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def _piece_type(sp, i: int) -> int:
    for test, kind in ((sp.is_unknown, _UNKNOWN), (sp.is_control, _CONTROL), (sp.is_byte, _BYTE),
                       (sp.is_unused, _UNUSED)):
        if test(i):
            return kind
    return _USER_DEFINED if sp.id_to_piece(i) == "<think>" else _NORMAL


def write_sentencepiece_gguf(path, sp, add_bos: bool | None = True, arch: str = "llama") -> None:
    """A GGUF with only metadata: the hyperparameters transformers needs to pick a tokenizer class,
    and the SentencePiece vocabulary (Gemma's whitespace-only pieces spelled with spaces, as its
    files have them)."""
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    for add, value in ((w.add_block_count, 1), (w.add_context_length, 256), (w.add_embedding_length, 64),
                       (w.add_feed_forward_length, 128), (w.add_head_count, 4), (w.add_head_count_kv, 2)):
        add(value)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(16)
    w.add_value_length(16)
    add_sentencepiece_vocab(w, sp, add_bos, spaces=arch.startswith("gemma"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()


def add_sentencepiece_vocab(w, sp, add_bos: bool | None = True, spaces: bool = False) -> None:
    """The SentencePiece vocabulary as llama.cpp's converter writes it; add_bos None: unsaid;
    spaces: whitespace-only pieces spelled with spaces."""
    w.add_tokenizer_model("llama")
    n = sp.get_piece_size()
    pieces = [sp.id_to_piece(i) for i in range(n)]
    w.add_token_list([" " * len(p) if spaces and not p.strip("\u2581") else p for p in pieces])
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_token_types([_piece_type(sp, i) for i in range(n)])
    w.add_unk_token_id(sp.unk_id())
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
