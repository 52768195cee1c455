"""Tokenizer and chat template: a `tokenizers.Tokenizer` plus the bits transformers adds.

Sources: an HF directory (tokenizer.json + tokenizer_config.json + generation_config.json),
a GGUF file's metadata (byte-level BPE rebuilt from tokens and merges, or a SentencePiece
vocabulary from pieces and scores (engine/load/sentencepiece_vocab.py), the way transformers' GGUF
tokenizer converter does), or a byte-level fallback for dummy models.
Chat templates render like transformers' `apply_chat_template(..., tokenize=False)`:
same jinja sandbox, options and helpers, same special-token variables (engine/load/chat_template.py, which
bounds a render's time and size).
"""
from __future__ import annotations

import json
import posixpath
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Sequence

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from jobrunner.engine.api.errors import ModelError
from jobrunner.engine.load.sentencepiece_vocab import SPACE as _SP_SPACE
from jobrunner.engine.load.sentencepiece_vocab import STYLES as SENTENCEPIECE_STYLES, sentencepiece_bpe

if TYPE_CHECKING:
    from jobrunner.engine.load.gguf import GGUFFile

# Tokens that end an assistant turn in common templates; when one appears in the chat
# template, generation must stop on it even if the config names another eos token.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>")

# Pre-tokenizer regexes for GGUF `tokenizer.ggml.pre` values (as transformers maps them);
# any other value uses GPT-2's ByteLevel regex, which is what llama.cpp's "smollm" and
# "gpt2" mean for vocabularies without digit merges.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GGUF_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values

_BYTES_FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


class Tokenizer:
    """Text <-> token ids, chat template rendering and the special ids generation needs."""

    def __init__(self, tok: tokenizers.Tokenizer, *, chat_template: str | None = None,
                 special_tokens: dict[str, str | None] | None = None,
                 bos_token_id: int | None = None, eos_token_ids: Sequence[int] = ()):
        self.inner = tok
        self.chat_template = chat_template
        # bos_token, eos_token, unk_token, pad_token: strings the template sees, like transformers'
        # special_tokens_map.
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.bos_token_id = bos_token_id
        eos = list(eos_token_ids)
        for t in _END_OF_TURN:
            if chat_template and t in chat_template and (i := tok.token_to_id(t)) is not None:
                eos.append(i)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))

    # -- ids <-> text ---------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (may be less than the model's vocab)."""
        return self.inner.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.inner.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        """Encode many texts in parallel (tokenizers' Rust thread pool); no offsets are computed."""
        batch = getattr(self.inner, "encode_batch_fast", self.inner.encode_batch)  # _fast: tokenizers >= 0.20
        return [e.ids for e in batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids outside the vocabulary (a model vocab larger than the tokenizer's) are dropped."""
        return self.inner.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.inner.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.inner.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: a byte-level BPE token or a SentencePiece byte-fallback
        token (<0xE2>) may hold part of a UTF-8 character, which its decoded text would turn into
        U+FFFD; a SentencePiece "▁" is a space that decoding one token alone strips. Else the token's
        decoded text's UTF-8."""
        spelling = self.inner.id_to_token(token_id)
        if spelling is None:
            return b""
        if type(self.inner.decoder).__name__ == "ByteLevel" and set(spelling) <= _byte_decoder().keys():
            return bytes(_byte_decoder()[c] for c in spelling)
        if len(spelling) == 6 and spelling.startswith("<0x") and spelling.endswith(">"):
            return bytes([int(spelling[3:5], 16)])
        if _SP_SPACE in spelling:
            return spelling.replace(_SP_SPACE, " ").encode("utf-8")
        return self.inner.decode([token_id], skip_special_tokens=False).encode("utf-8")

    # -- chat template --------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        return self._template_source

    @chat_template.setter
    def chat_template(self, source: str | None) -> None:
        self._template_source, self._template = source, None  # compiled lazily, on first use

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render messages as transformers' apply_chat_template(..., tokenize=False) does."""
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template; send plain prompts instead")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        # transformers drops None-valued keys (e.g. OpenAI's content=None) before rendering
        msgs = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {**self.special_tokens, **kwargs}
        from jobrunner.engine.load.chat_template import render      # bounded: TemplateBoundError past MAX_SECONDS or MAX_CHARS
        return render(self._template, messages=msgs, tools=variables.pop("tools", None),
                      documents=variables.pop("documents", None),
                      add_generation_prompt=add_generation_prompt, **variables)

    # -- constructors ---------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, fs: Any, path: str) -> "Tokenizer":
        """From an HF model directory on an fsspec filesystem (fs=None: local)."""
        if fs is None:
            import fsspec
            fs = fsspec.filesystem("file")

        def read_json(name: str) -> dict:
            p = posixpath.join(path, name)
            if not fs.exists(p):
                return {}
            try:
                return json.loads(fs.cat_file(p))
            except ValueError as e:
                raise ModelError(f"{p}: invalid JSON ({e})") from e

        tok_path = posixpath.join(path, "tokenizer.json")
        if not fs.exists(tok_path):
            raise ModelError(f"{path}: no tokenizer.json (only fast tokenizers are supported)")
        try:
            tok = tokenizers.Tokenizer.from_str(fs.cat_file(tok_path).decode("utf-8"))
        except Exception as e:
            raise ModelError(f"{tok_path}: cannot read tokenizer ({e})") from e
        tcfg, gen, cfg = read_json("tokenizer_config.json"), read_json("generation_config.json"), read_json("config.json")

        template = tcfg.get("chat_template")
        jinja = posixpath.join(path, "chat_template.jinja")  # newer transformers save it separately
        if fs.exists(jinja):
            template = fs.cat_file(jinja).decode("utf-8")
        elif isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)

        special = {k: _token_content(tcfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        eos: list[int] = []
        for v in (gen.get("eos_token_id"), cfg.get("eos_token_id")):
            eos += v if isinstance(v, list) else ([v] if v is not None else [])
        if special["eos_token"] and (i := tok.token_to_id(special["eos_token"])) is not None:
            eos.append(i)
        bos = tok.token_to_id(special["bos_token"]) if special["bos_token"] else None
        if bos is None:
            bos = gen.get("bos_token_id", cfg.get("bos_token_id"))
        return cls(tok, chat_template=template, special_tokens=special, bos_token_id=bos, eos_token_ids=eos)

    @classmethod
    def from_gguf(cls, gguf_file: "GGUFFile | str") -> "Tokenizer":
        """Rebuild the tokenizer described by a GGUF file's `tokenizer.*` metadata."""
        if not hasattr(gguf_file, "metadata"):
            from jobrunner.engine.load.gguf import GGUFFile
            gguf_file = GGUFFile(gguf_file)
        meta = gguf_file.metadata
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        keys = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
        ids = {k: meta.get(f"tokenizer.ggml.{v}_token_id") for k, v in keys.items()}
        ids = {k: i if i is not None and 0 <= i < len(tokens) else None for k, i in ids.items()}
        special = {k: tokens[i] if i is not None else None for k, i in ids.items()}
        tok, spelled = _gguf_vocabulary(gguf_file, special["unk_token"])
        # Control tokens (and the named special ones) match whole in text and are skipped on decode.
        control = [t for t, ty in zip(tokens, types) if ty == _GGUF_CONTROL and spelled(t)]
        control += [t for t in special.values() if t is not None and t not in control]
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
        user = [t for t, ty in zip(tokens, types) if ty == _GGUF_USER_DEFINED and spelled(t)]
        if user:
            tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

        # BOS/EOS added around a plain encode(add_special_tokens=True), as the file asks; a SentencePiece
        # file that does not say gets BOS, as llama.cpp and transformers give it.
        single, used = ["$A:0"], []
        add_bos = meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama")
        if add_bos and ids["bos_token"] is not None:
            single.insert(0, f"{special['bos_token']}:0")
            used.append((special["bos_token"], ids["bos_token"]))
        if meta.get("tokenizer.ggml.add_eos_token") and ids["eos_token"] is not None:
            single.append(f"{special['eos_token']}:0")
            used.append((special["eos_token"], ids["eos_token"]))
        tok.post_processor = processors.TemplateProcessing(single=" ".join(single),
                                                           special_tokens=list(dict.fromkeys(used)))

        eos = [ids["eos_token"]] if ids["eos_token"] is not None else []
        eos += [i for k in ("eot", "eom") if (i := meta.get(f"tokenizer.ggml.{k}_token_id")) is not None]
        return cls(tok, chat_template=meta.get("tokenizer.chat_template"), special_tokens=special,
                   bos_token_id=ids["bos_token"], eos_token_ids=eos)

    @classmethod
    def bytes_fallback(cls, vocab_size: int) -> "Tokenizer":
        """A byte-level tokenizer for dummy models: id b is byte b; 256 <|endoftext|>, 257 <|im_start|>,
        258 <|im_end|>; a ChatML template. Ids >= 259 decode to nothing."""
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        if vocab_size < 256 + len(specials):
            raise ValueError(f"bytes_fallback needs a vocab of at least {256 + len(specials)}, got {vocab_size}")
        spelling = bytes_to_unicode()
        tok = tokenizers.Tokenizer(models.BPE(vocab={spelling[b]: b for b in range(256)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        return cls(tok, chat_template=_BYTES_FALLBACK_TEMPLATE,
                   special_tokens={"bos_token": specials[0], "eos_token": specials[0]},
                   bos_token_id=256, eos_token_ids=(256, 258))


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json spells a special token as "<s>" or {"content": "<s>", ...}
    return value.get("content") if isinstance(value, dict) else value


def _gguf_vocabulary(gguf_file: "GGUFFile", unk_token: str | None):
    """The GGUF vocabulary's tokenizer without its special tokens, and which tokens may be added
    whole (a byte-level control token outside the byte alphabet is a llama.cpp mislabel, left as
    is, as transformers does)."""
    meta = gguf_file.metadata
    kind, tokens = meta.get("tokenizer.ggml.model"), meta["tokenizer.ggml.tokens"]
    if kind == "gpt2":
        alphabet = set(bytes_to_unicode().values())
        tok = _byte_level_bpe(tokens, meta.get("tokenizer.ggml.merges") or [], meta.get("tokenizer.ggml.pre"))
        return tok, lambda t: set(t) <= alphabet
    if kind == "llama":     # SentencePiece: Llama 2, Mistral, Gemma, Phi-3
        if gguf_file.arch not in SENTENCEPIECE_STYLES:
            raise ModelError(f"{gguf_file.path}: a SentencePiece vocabulary for GGUF architecture "
                             f"{gguf_file.arch!r} is not supported (only {', '.join(SENTENCEPIECE_STYLES)})")
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        return sentencepiece_bpe(tokens, scores, unk_token, SENTENCEPIECE_STYLES[gguf_file.arch]), lambda t: True
    raise ModelError(f"{gguf_file.path}: GGUF tokenizer model {kind!r} is not supported (byte-level BPE "
                     "'gpt2' and SentencePiece 'llama' are); load the model from an HF directory instead")


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str | None) -> tokenizers.Tokenizer:
    """GPT-2 style byte-level BPE from a GGUF vocabulary (as transformers' GGUF converter builds it)."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # A token written with characters outside the byte alphabet is respelled from its UTF-8 bytes.
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")), i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                                          end_of_word_suffix="", fuse_unk=False))
    split = _GGUF_SPLITS.get(pre or "")
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    return tok


# -- jinja --------------------------------------------------------------------------

def _compile_template(source: str):
    """Compile a chat template in the same sandbox, with the same options, as transformers (engine.load.chat_template:
    within bounds of time and size)."""
    import jinja2

    from jobrunner.engine.load.chat_template import compile_template
    try:
        return compile_template(source)
    except jinja2.TemplateSyntaxError as e:
        raise ModelError(f"chat template does not compile: {e}") from e
