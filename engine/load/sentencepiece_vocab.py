"""SentencePiece vocabularies stored in GGUF files (`tokenizer.ggml.model == "llama"`: Llama 2,
Mistral, Gemma, Phi-3 and other SentencePiece-BPE models), rebuilt as a `tokenizers` BPE the way
transformers' GGUF converter builds them (its LlamaTokenizer over merges recovered from scores,
with each family's spacing: STYLES):

  * the file has pieces and scores, no merges: a merge (l, r) exists for every piece l + r whose
    halves are pieces too, ranked by the merged piece's score (higher merges first);
  * "▁" (U+2581) stands for a space: Metaspace turns spaces into it and prepends one to the
    start of the text (prepend_scheme "first": not after a special token); decoding turns it back
    and strips the one prepended;
  * byte fallback: a character with no piece becomes its UTF-8 bytes' pieces <0x00>..<0xFF>.

Where transformers and SentencePiece itself (which llama.cpp follows) differ, we follow
transformers, the reference our parity tests hold us to: text that starts with a space gets no
second prefix space, and special tokens written in text match whole.
"""
from __future__ import annotations

from typing import Sequence

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers

SPACE = "\u2581"


def sentencepiece_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies (transformers' generate_merges with scores)."""
    index = {t: i for i, t in enumerate(tokens)}         # a repeated piece: its last id, as transformers
    score = dict(zip(tokens, scores))
    merges = []
    for piece, s in score.items():
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in index and piece[k:] in index]
        splits.sort(key=lambda lr: (index[lr[0]], index[lr[1]]))
        merges += [(left, right, s) for left, right in splits]
    # Best score first; ties: longer left, then longer right, first. sorted(reverse=True) is stable,
    # so equal keys keep the order above.
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


# How a family spaces its text (transformers picks these by GGUF architecture, as we do):
#   llama: Metaspace, a "▁" prepended to the text, stripped again on decode (Llama 2, Mistral);
#   gemma: spaces become "▁" and nothing is prepended; the file spells whitespace-only pieces with
#          real spaces, and its scores do not follow its merge order (its piece order does);
#   phi3:  a normalizer prepends "▁" to every text, even one that starts with a space.
STYLES = {"llama": "llama", "gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "phi3": "phi3"}


def sentencepiece_bpe(tokens: Sequence[str], scores: Sequence[float], unk_token: str | None,
                      style: str = "llama") -> tokenizers.Tokenizer:
    """A byte-fallback BPE tokenizer over the vocabulary (special tokens are the caller's to add);
    style: one of STYLES' values."""
    if style == "gemma":
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores = [-i for i in range(len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=sentencepiece_merges(tokens, scores), unk_token=unk_token,
                     fuse_unk=True, byte_fallback=True, dropout=None)
    tok = tokenizers.Tokenizer(bpe)
    decode = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if style == "gemma":
        tok.normalizer = normalizers.Replace(" ", SPACE)
        tok.decoder = decoders.Sequence(decode)
        return tok
    if style == "phi3":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(decode + [decoders.Strip(content=" ", left=1)])
    return tok
