"""GGUF checkpoints: metadata -> HF-style config dict, tensors -> HF names and float32.

The `gguf` package parses the file (memory-mapped); it is imported lazily so the engine
stays importable where it is not installed (the GPU machine). Tensors are dequantized
one at a time, so peak memory is the mapped file plus one float32 tensor.

llama.cpp's converter changes two things we undo here:
  * names: blk.N.attn_q.weight <- model.layers.N.self_attn.q_proj.weight, etc.;
  * for the llama architecture (`permuted_qk` in engine/config/architectures.py), the rows of
    q_proj/k_proj are permuted per head from HF's rotate_half layout
    [x0..x(d/2-1), x(d/2)..x(d-1)] to interleaved pairs [x0, x(d/2), x1, ...];
    `_unpermute_rows` restores HF's order. The permutation moves whole rows, so it can
    also be applied to raw quantized blocks (which run along rows).
"""
from __future__ import annotations

import mmap
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

try:
    from numpy.lib.array_utils import byte_bounds
except ImportError:     # numpy < 2
    byte_bounds = np.byte_bounds

from jobrunner.engine.api.errors import ModelError
from jobrunner.engine.config.architectures import GGUF_ARCHITECTURES

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# llama.cpp stores llama-3 rope frequency factors as a tensor; the engine derives them from the config.
_SKIPPED = {"rope_freqs.weight"}


def hf_tensor_name(name: str) -> str | None:
    """The HF parameter name of a GGUF tensor; None for tensors we skip."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    if name in _SKIPPED:
        return None
    m = _LAYER_RE.fullmatch(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    raise ModelError(f"unsupported GGUF tensor {name!r}")


def _reader_class():
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ModelError("reading GGUF files needs the 'gguf' package (pip install gguf)") from e

    class _Reader(gguf.GGUFReader):
        # np.memmap's __array_finalize__ runs for each of the ~250k slices the reader takes
        # while parsing a vocabulary; a plain ndarray view of the same mapping parses ~3x faster.
        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, value):
            self._data = value.view(np.ndarray)

    return _Reader


@dataclass(frozen=True)
class RawTensor:
    """One tensor as stored: `data` is uint8 [rows, bytes_per_row] ([1, nbytes] for 1-D tensors),
    rows already in HF order. Quantized blocks run along rows, so rows can be moved whole."""
    name: str                  # HF name
    ggml_type: str             # "Q4_1", "Q8_0", "F32", ...
    shape: tuple[int, ...]     # logical shape in torch order, e.g. (out_features, in_features)
    data: np.ndarray

    def drop_pages(self) -> None:
        """Once its blocks have been copied: the file's pages under it leave the resident set (drop_pages)."""
        drop_pages(self.data)


class GGUFFile:
    """A parsed GGUF file: `metadata` (key -> python value), `hf_config()`, tensor iterators."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            # mode "c": a private copy-on-write mapping, so arrays are writable for torch.from_numpy
            # without copying; nothing is ever written back to the file.
            self.reader = _reader_class()(self.path, mode="c")
        except ModelError:
            raise
        except Exception as e:
            raise ModelError(f"{self.path}: not a valid GGUF file ({type(e).__name__}: {e})") from e
        self.metadata: dict[str, Any] = {
            k: f.contents() for k, f in self.reader.fields.items() if not k.startswith("GGUF.")
        }
        self.tensors = {t.name: t for t in self.reader.tensors}
        self._check_complete()
        self.arch: str = self.metadata.get("general.architecture", "")

    def _check_complete(self) -> None:
        size = self.path.stat().st_size
        for t in self.reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size or t.data.nbytes != int(t.n_bytes):
                raise ModelError(f"{self.path}: file is truncated: tensor {t.name!r} needs bytes up to {end}, "
                                 f"the file has {size}")

    def hf_config(self) -> dict:
        """An HF `config.json`-style dict for the model in this file."""
        arch = self.arch
        if arch not in GGUF_ARCHITECTURES:
            raise ModelError(f"{self.path}: unsupported GGUF architecture {arch!r}; "
                             f"supported: {sorted(GGUF_ARCHITECTURES)}")
        def g(key: str, default: Any = None) -> Any:
            return self.metadata.get(f"{arch}.{key}", default)

        required = ["embedding_length", "feed_forward_length", "block_count", "attention.head_count"]
        missing = [f"{arch}.{k}" for k in required if g(k) is None]
        missing += ["tensor token_embd.weight"] if "token_embd.weight" not in self.tensors else []
        if missing:
            raise ModelError(f"{self.path}: GGUF file lacks {', '.join(missing)}")
        hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
        embd = self.tensors["token_embd.weight"]
        cfg: dict[str, Any] = {
            "architectures": [GGUF_ARCHITECTURES[arch].hf],
            "model_type": arch,
            "vocab_size": int(embd.shape[1]),  # GGUF shapes are (ne0, ne1) = (hidden, vocab)
            "hidden_size": hidden,
            "intermediate_size": int(g("feed_forward_length")),
            "num_hidden_layers": int(g("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(g("attention.head_count_kv", heads)),
            "head_dim": int(g("attention.key_length") or g("rope.dimension_count") or hidden // heads),
            "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(g("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(g("context_length", 4096)),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "attention_bias": "blk.0.attn_q.bias" in self.tensors,
        }
        scaling = g("rope.scaling.type")
        if scaling in ("linear", "yarn"):
            cfg["rope_scaling"] = {"rope_type": scaling, "factor": float(g("rope.scaling.factor", 1.0))}
            if scaling == "yarn":
                cfg["rope_scaling"]["original_max_position_embeddings"] = int(
                    g("rope.scaling.original_context_length", cfg["max_position_embeddings"]))
        for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
            if (v := self.metadata.get(f"tokenizer.ggml.{key}")) is not None:
                cfg[key.replace("padding", "pad")] = int(v)
        return cfg

    # -- tensors ----------------------------------------------------------------

    def _unpermute(self, gguf_name: str, rows: torch.Tensor | np.ndarray):
        """Undo llama.cpp's q/k row permutation (where the registry says it made one); rows: [out, ...]."""
        spec = GGUF_ARCHITECTURES.get(self.arch)
        if spec is None or not spec.permuted_qk or not (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            return rows
        heads = int(self.metadata[f"{self.arch}.attention.head_count"])
        if ".attn_k." in gguf_name:
            heads = int(self.metadata.get(f"{self.arch}.attention.head_count_kv", heads))
        return _unpermute_rows(rows, heads)

    def float32_bytes(self) -> int:
        """What iter_tensors' tensors take together, from the shapes alone (nothing dequantized)."""
        return sum(4 * int(t.n_elements) for name, t in self.tensors.items() if hf_tensor_name(name) is not None)

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, float32 tensor) one at a time, dequantized, each a fresh tensor."""
        for name, t in self.tensors.items():
            hf = hf_tensor_name(name)
            if hf is None:
                continue
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            with _one_thread():
                w = self._unpermute(name, dequantize(t.data, t.tensor_type.name, shape, t.tensor_type)).contiguous()
            drop_pages(t.data)      # w is a fresh tensor
            yield hf, w

    def iter_raw_tensors(self) -> Iterator[RawTensor]:
        """The stored bytes of each tensor, unconverted (for quantized weight paths)."""
        for name, t in self.tensors.items():
            hf = hf_tensor_name(name)
            if hf is None:
                continue
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            rows = self._unpermute(name, t.data.view(np.uint8).reshape(shape[0], -1))
            raw = rows.reshape(1, -1) if len(shape) == 1 else rows
            yield RawTensor(hf, t.tensor_type.name, shape, np.ascontiguousarray(raw))


def drop_pages(data: np.ndarray) -> None:
    """Lets the kernel drop the pages of a GGUF mapping that `data`, a view of it, lies on, once what was read
    from them has been copied. A mapping keeps every page read through it resident (RSS) while the file is open,
    so without this a model built from a GGUF would count the file a second time. Nothing writes to these
    mappings, so a page read again faults back in from the file unchanged. A no-op for arrays not on a mapping."""
    root = data
    while isinstance(root, np.ndarray) and not isinstance(root.base, mmap.mmap):
        root = root.base                                # views down to np.memmap's own array over the mapping
    if not isinstance(root, np.memmap):
        return
    origin = byte_bounds(root)[0] - root.offset % mmap.ALLOCATIONGRANULARITY     # the mapping's first byte
    start, end = byte_bounds(data)
    page = mmap.PAGESIZE
    first = -(-(start - origin) // page) * page         # whole pages inside the view only: a neighbour's are kept
    last = (end - origin) // page * page
    if last > first:
        root.base.madvise(mmap.MADV_DONTNEED, first, last - first)


@contextmanager
def _one_thread():
    """Dequantize on one thread: these elementwise ops are memory-bound and ~1M elements each, and
    torch's intra-op pool spins so much on a busy 2-core machine that 2 threads cost 10x the CPU
    time (measured: 4.8 s vs 0.35 s for the default model). Restored before each yield."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _unpermute_rows(w, heads: int):
    # rows grouped per head as [head, pair(d/2), 2] -> [head, 2, d/2]: HF rotate_half order.
    rest = tuple(w.shape[1:])
    w = w.reshape(heads, w.shape[0] // heads // 2, 2, *rest)
    return w.swapaxes(1, 2).reshape(-1, *rest)


# -- dequantization ----------------------------------------------------------------
# Block layouts (ggml-common.h); each block covers 32 consecutive elements of a row:
#   Q8_0: f16 d, int8 q[32]          w = d * q
#   Q4_0: f16 d, u8 qs[16]           w = d * (q - 8)      q[i] = qs[i] & 15, q[i+16] = qs[i] >> 4
#   Q4_1: f16 d, f16 m, u8 qs[16]    w = d * q + m        same nibble order as Q4_0
# Torch does these faster than gguf's numpy code; other types fall back to gguf.quants.
# In-place ops keep it to one float32 allocation per tensor: on these VMs first-touch page
# faults of fresh memory, not arithmetic, dominate a cold load.

def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    # [blocks, 16] uint8 -> [blocks, 32] float32 in element order (low nibbles, then high)
    q = torch.empty(qs.shape[0], 2, 16, dtype=torch.uint8)
    torch.bitwise_and(qs, 15, out=q[:, 0])
    torch.bitwise_right_shift(qs, 4, out=q[:, 1])
    return q.view(-1, 32).float()


def _f16(raw: torch.Tensor) -> torch.Tensor:
    # [blocks, 2k] bytes -> [blocks, k] float32
    return raw.contiguous().view(torch.float16).float()


def dequantize(data: np.ndarray, type_name: str, shape: tuple[int, ...], qtype: Any = None) -> torch.Tensor:
    """Dequantize one tensor's stored data to a fresh float32 tensor of `shape` (torch order)."""
    raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(-1))
    if type_name == "F32":
        return raw.view(torch.float32).clone().reshape(shape)
    if type_name == "F16":
        return raw.view(torch.float16).float().reshape(shape)
    if type_name == "BF16":
        return raw.view(torch.bfloat16).float().reshape(shape)
    if type_name == "Q8_0":
        b = raw.reshape(-1, 34)
        return b[:, 2:].view(torch.int8).float().mul_(_f16(b[:, :2])).reshape(shape)
    if type_name == "Q4_0":
        b = raw.reshape(-1, 18)
        return _nibbles(b[:, 2:]).sub_(8.0).mul_(_f16(b[:, :2])).reshape(shape)
    if type_name == "Q4_1":
        b = raw.reshape(-1, 20)
        dm = _f16(b[:, :4])
        return _nibbles(b[:, 4:]).mul_(dm[:, 0:1]).add_(dm[:, 1:2]).reshape(shape)
    import gguf

    qtype = qtype if qtype is not None else gguf.GGMLQuantizationType[type_name]
    return torch.from_numpy(gguf.quants.dequantize(np.asarray(data), qtype).astype(np.float32)).reshape(shape)
