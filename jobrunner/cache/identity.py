"""The identity of a checkpoint: what its files contain, read cheaply.

Every file of the checkpoint (a directory's files, or one .gguf) gives its name and size. A file
up to FULL_HASH_BYTES is hashed whole (configs, tokenizers, small models). A larger one gives the
hash of its header (safetensors: the 8-byte length and the JSON header; GGUF: the first
GGUF_HEADER_BYTES, which hold its metadata and tensor table) and of SAMPLES blocks spread evenly
over it, so an edited weight of a large file is caught in most cases while a 100 GB checkpoint
costs a few reads. A Hugging Face cache snapshot (.../snapshots/<commit>/) adds the hub commit.
"""
from __future__ import annotations

import hashlib
import posixpath
import re

from jobrunner import engine      # engine.DUMMY_CONFIGS, read only for a dummy: model, loads the engine's loader (torch)
from jobrunner.common.storage import url_fs

FULL_HASH_BYTES = 64 * 2**20
GGUF_HEADER_BYTES = 8 * 2**20
SAMPLES, SAMPLE_BYTES = 32, 64 * 2**10
_SNAPSHOT = re.compile(r"/snapshots/([0-9a-f]{40})(/|$)")


def checkpoint_identity(model: str) -> dict:
    """{"files": {name: {size, hash}}, "commit"?} for a local path or fsspec URL of a model directory
    or a .gguf file; {"dummy": ...} for dummy:<name or config> (random weights from the config)."""
    if model.startswith("dummy:"):
        return {"dummy": _dummy_identity(model[len("dummy:"):])}
    fs, path = url_fs(model)
    if fs.isdir(path):
        names = sorted(p for p in fs.find(path) if not posixpath.basename(p).startswith("."))
        files = {posixpath.relpath(p, path): _file_identity(fs, p) for p in names}
    else:
        files = {posixpath.basename(path): _file_identity(fs, path)}
    out = {"files": files}
    m = _SNAPSHOT.search(path)
    if m:
        out["commit"] = m.group(1)
    return out


def _dummy_identity(spec: str) -> dict:
    if spec in engine.DUMMY_CONFIGS:
        return {"builtin": spec, "config": engine.DUMMY_CONFIGS[spec]}
    fs, path = url_fs(spec)
    folder = path if fs.isdir(path) else posixpath.dirname(path)
    config = posixpath.join(path, "config.json") if fs.isdir(path) else path
    out = {"config": _file_identity(fs, config)}
    tokenizer = posixpath.join(folder, "tokenizer.json")
    if fs.exists(tokenizer):
        out["tokenizer"] = _file_identity(fs, tokenizer)
    return out


def _file_identity(fs, path: str) -> dict:
    size = fs.size(path)
    h = hashlib.blake2b(digest_size=16)
    with fs.open(path, "rb") as f:
        if size <= FULL_HASH_BYTES:
            h.update(f.read())
        else:
            h.update(_header(f, path, size))
            for i in range(SAMPLES):
                f.seek((size - SAMPLE_BYTES) * i // (SAMPLES - 1))
                h.update(f.read(SAMPLE_BYTES))
    return {"size": size, "hash": h.hexdigest()}


def _header(f, path: str, size: int) -> bytes:
    """A safetensors file's length-prefixed JSON header; a GGUF file's leading bytes."""
    first = f.read(8)
    if path.endswith(".safetensors") and len(first) == 8:
        n = int.from_bytes(first, "little")
        if n <= min(size - 8, 256 * 2**20):
            return first + f.read(n)
    return first + f.read(GGUF_HEADER_BYTES - 8)
