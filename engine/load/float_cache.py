"""A small GGUF checkpoint's float32 conversion, kept on disk so that later starts memory-map it.

Parsing a GGUF's metadata (its vocabulary is tens of thousands of strings, read one by one by
the gguf package) and dequantizing its weights cost seconds at every start of a job. The first
load of a GGUF of at most MAX_FLOAT_BYTES (float32) writes what it produced:

    <cache>/float/<path key>/<version key>/config.json          the HF-style config the GGUF implies
                                          /tokenizer.json       the tokenizer rebuilt from its metadata
                                          /tokenizer_extra.json chat template, special tokens, BOS, EOS ids
                                          /model.safetensors    every weight, dequantized, in HF names

Invariants: the path key is the file's absolute path, the version key its size and modification
time and FORMAT (the version of this conversion and of the dequantizers), so a changed file is
never served and each path keeps one conversion (writing one removes the path's older ones); a
version directory exists only complete (written under a temporary name, then renamed); anything
unreadable there is ignored (and rewritten).
The GGUF itself stays the source of the quantized blocks (`raw_weights`), opened only when used.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import tokenizers

from jobrunner.engine.load.tokenizer import Tokenizer

log = logging.getLogger("jobrunner")

FORMAT = 1                              # bump when the conversion (dequantizers, names, tokenizer) changes
MAX_FLOAT_BYTES = 2 << 30               # larger models are not copied: 4 bytes a weight is too much disk
_WEIGHTS, _CONFIG, _TOKENIZER, _EXTRA = "model.safetensors", "config.json", "tokenizer.json", "tokenizer_extra.json"


def _key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def cache_dir(gguf_path: Path, root: Path) -> Path:
    st = gguf_path.stat()
    return root / "float" / _key(str(gguf_path.resolve())) / _key(f"{st.st_size}|{st.st_mtime_ns}|{FORMAT}")


def read(directory: Path) -> tuple[dict, Tokenizer, Path] | None:
    """(hf_config, tokenizer, weights file) of a complete conversion, else None."""
    try:
        from safetensors import safe_open
        hf_config = json.loads((directory / _CONFIG).read_text())
        extra = json.loads((directory / _EXTRA).read_text())
        inner = tokenizers.Tokenizer.from_file(str(directory / _TOKENIZER))
        with safe_open(directory / _WEIGHTS, framework="pt") as st:   # validates the header
            st.keys()
    except FileNotFoundError:
        return None
    except Exception as e:  # a damaged copy: the GGUF is still there
        log.warning("ignoring damaged model conversion %s (%s: %s)", directory, type(e).__name__, e)
        return None
    tokenizer = Tokenizer(inner, chat_template=extra["chat_template"], special_tokens=extra["special_tokens"],
                          bos_token_id=extra["bos_token_id"], eos_token_ids=extra["eos_token_ids"])
    return hf_config, tokenizer, weights_file(directory)


def weights_file(directory: Path) -> Path:
    return directory / _WEIGHTS


def write(directory: Path, hf_config: dict, tokenizer: Tokenizer, weights) -> bool:
    """Writes the conversion, replacing a damaged one (weights: the GGUF's (name, float32 tensor)
    iterator; the caller keeps to MAX_FLOAT_BYTES); False when the cache cannot be written (the job
    then goes on from the GGUF)."""
    from safetensors.torch import save_file
    tensors = dict(weights)
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=".tmp-"))
        try:
            save_file(tensors, str(tmp / _WEIGHTS))
            tokenizer.inner.save(str(tmp / _TOKENIZER))
            (tmp / _EXTRA).write_text(json.dumps({
                "chat_template": tokenizer.chat_template, "special_tokens": tokenizer.special_tokens,
                "bos_token_id": tokenizer.bos_token_id, "eos_token_ids": list(tokenizer.eos_token_ids)}))
            (tmp / _CONFIG).write_text(json.dumps(hf_config))
            if read(directory) is not None:     # a concurrent writer just finished it: kept (a reader may
                return True                     # be loading it), never removed under that reader
            shutil.rmtree(directory, ignore_errors=True)     # a damaged copy (read() found none usable)
            os.replace(tmp, directory)      # fails only when a concurrent writer just won: fine
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        for old in directory.parent.iterdir():        # the same path's conversions of older files
            if old != directory and not old.name.startswith(".tmp-"):
                shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        log.debug("not caching the float conversion in %s: %s", directory, e)
        return False
    return True
