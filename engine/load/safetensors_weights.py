"""Weights from safetensors files: which files a checkpoint's folder holds, and each tensor read whole or,
for a tensor-parallel rank, only the row or column ranges it keeps (never pickle)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import torch

from jobrunner.engine.api.errors import ModelError

WeightIterator = Iterator[tuple[str, torch.Tensor]]
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def safetensors_weights(files: list[Path]) -> Callable[..., WeightIterator]:
    """weights(select=None): every tensor whole, or as select(name, shape) slices it (ModelBundle.shard_weights)."""
    def weights(select=None) -> WeightIterator:
        for file in files:
            yield from _file_weights(file, select)
    return weights


# A file's mapping keeps every page read through it resident (RSS) until it closes: read whole through one
# mapping, a checkpoint would count a second time beside the weights built from it (a quantized model's peak
# would follow the file, not its own bytes). So the file is reopened after this many bytes.
MAPPED_BYTES = 256 << 20


def _file_weights(file: Path, select) -> WeightIterator:
    from safetensors import safe_open
    names, done = None, 0
    while names is None or done < len(names):
        with safe_open(file, framework="pt") as st:
            if names is None:
                names = [n for n in st.keys() if not n.endswith("rotary_emb.inv_freq")]  # a buffer in old checkpoints
            read = 0
            while done < len(names) and read < MAPPED_BYTES:
                name = names[done]
                done += 1
                tensor = _read(st, name, select)
                if tensor is not None:
                    read += tensor.nbytes
                    yield name, tensor


def _read(st, name: str, select) -> torch.Tensor | None:
    """The tensor whole, or the ranges select picks of it; None where select picks none (another rank's)."""
    if select is None:
        return st.get_tensor(name)
    part = st.get_slice(name)
    picked = select(name, tuple(part.get_shape()))
    if picked is None:
        return st.get_tensor(name)
    return read_ranges(part, picked) if picked[1] else None


def read_ranges(part, picked) -> torch.Tensor:
    """The rows (dim 0) or columns (dim 1) ranges of a safetensors slice, joined."""
    dim, ranges = picked
    pieces = [part[s:s + n] if dim == 0 else part[:, s:s + n] for s, n in ranges]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def narrow(tensor: torch.Tensor, picked) -> torch.Tensor:
    if picked is None:
        return tensor
    dim, ranges = picked
    return torch.cat([tensor.narrow(dim, s, n) for s, n in ranges], dim)


def safetensors_files(root: Path, index: dict) -> list[Path]:
    """The checkpoint's weight files: those its index (model.safetensors.index.json, read) names, else every
    *.safetensors; a folder of pickled weights only is refused, naming them."""
    if index:
        files = [root / f for f in sorted(set(index.get("weight_map", {}).values()))]
        for f in files:
            if not f.is_file():
                raise ModelError(f"{f}: listed in model.safetensors.index.json but missing")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        pickled = [p.name for p in root.iterdir() if p.suffix in _PICKLE_SUFFIXES]
        why = f" (found {', '.join(pickled)}: pickled weights are never loaded)" if pickled else ""
        raise ModelError(f"{root}: no *.safetensors weights{why}")
    return files
