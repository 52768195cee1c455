"""A GGUF checkpoint written as a Hugging Face model directory: what transformers, PEFT, llmcompressor
and lm-eval's `hf` backend load (`jobrunner models export`, jobrunner/cli/export.py).

    DIR/config.json              the HF config the GGUF implies (GGUFFile.hf_config), with dtype and hidden_act
       /model.safetensors        every weight as the engine loads it: dequantized, llama.cpp's q/k row
                                 permutation undone (engine/load/gguf.py), cast to the dtype asked; past
                                 max_shard_bytes, model-0000i-of-0000n.safetensors and model.safetensors.index.json
       /tokenizer.json           the tokenizer rebuilt from the GGUF's vocabulary (engine/load/tokenizer.py)
       /tokenizer_config.json    the special tokens and the chat template
       /generation_config.json   bos, pad, and every eos id that ends our generation (end-of-turn tokens included)

The weights, tokenizer and template are the loader's (load_model_bundle), the ones a job's engine runs, so
transformers' float32 greedy tokens on the directory are ours (tests/test_models_export.py).
Invariant: DIR appears only complete (written in a temporary sibling, then renamed); a tied model's
lm_head is not written (transformers ties it to the embeddings, as config.json says).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from jobrunner.engine.api.errors import ModelError
from jobrunner.engine.load.loader import load_model_bundle
from jobrunner.engine.load.tokenizer import Tokenizer

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_SHARD_BYTES = 5 << 30       # transformers' long-standing default shard size (5 GB)
_HIDDEN_ACT = "silu"            # every family GGUF_ARCHITECTURES names (llama, qwen2, qwen3) gates with SiLU
_FLOAT32_KEYS = ("rms_norm_eps", "rope_theta")  # GGUF stores them as float32: written as the decimal they came from


def export_hf_dir(model: str, directory: str | os.PathLike, dtype: str = "float32",
                  max_shard_bytes: int = MAX_SHARD_BYTES, cache_dir: str | os.PathLike | None = None) -> dict:
    """Write the GGUF checkpoint `model` (a local path or fsspec URL, as the loader takes it) as an HF
    directory at `directory`, which must be absent or an empty directory. Returns what was written:
    dir, architecture, dtype, tensors, bytes, files. ModelError for a model that is not a GGUF
    checkpoint, an unknown dtype or an occupied directory; OSError when the directory cannot be written."""
    if dtype not in EXPORT_DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}; one of {', '.join(EXPORT_DTYPES)}")
    out = Path(directory)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ModelError(f"{out} exists and is not an empty directory: give a new or empty one")
    if not (parent := next(p for p in out.absolute().parents if p.exists())).is_dir():
        raise ModelError(f"{out}: {parent} is not a directory")
    bundle = load_model_bundle(model, cache_dir)
    if bundle.weight_format != "gguf":
        raise ModelError(f"{model}: only GGUF checkpoints are exported (this is a {bundle.weight_format} model; "
                         "an HF directory already is one, and dummy: models have no weights)")
    config = export_config(bundle.hf_config, dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        _, tensors, size = _write_weights(tmp, bundle.weights(), EXPORT_DTYPES[dtype], max_shard_bytes)
        _write_tokenizer(tmp, bundle.tokenizer, config)
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", generation_config(config, bundle.tokenizer))
        os.chmod(tmp, 0o755)        # mkdtemp makes it 0700
        if out.exists():
            out.rmdir()             # empty (checked above)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"dir": str(out), "architecture": config["architectures"][0], "dtype": dtype, "tensors": tensors,
            "bytes": size, "files": sorted(p.name for p in out.iterdir())}


def export_config(hf_config: dict, dtype: str) -> dict:
    """config.json: the GGUF's HF-style config, its float32 hyperparameters as the decimals they were
    written from (9.999999747e-06 -> 1e-05), the activation and the weights' dtype."""
    config = dict(hf_config)
    for key in _FLOAT32_KEYS:
        if key in config:
            config[key] = float(str(np.float32(config[key])))    # the shortest decimal of the float32
    config.setdefault("hidden_act", _HIDDEN_ACT)
    config["torch_dtype"] = dtype       # transformers 4 reads torch_dtype, 5 reads it as dtype's old name
    return config


def generation_config(config: dict, tokenizer: Tokenizer) -> dict:
    """generation_config.json: the ids generation needs; eos as every id our engine stops on, so that
    transformers' generate() stops where a job does (a chat template's end-of-turn token included)."""
    eos = list(tokenizer.eos_token_ids) or ([config["eos_token_id"]] if "eos_token_id" in config else [])
    gen = {"bos_token_id": tokenizer.bos_token_id if tokenizer.bos_token_id is not None else config.get("bos_token_id"),
           "eos_token_id": eos[0] if len(eos) == 1 else eos,
           "pad_token_id": config.get("pad_token_id")}
    return {k: v for k, v in gen.items() if v is not None and v != []}


def _write_tokenizer(directory: Path, tokenizer: Tokenizer, config: dict) -> None:
    """tokenizer.json as the loader built it; tokenizer_config.json with the special tokens and the
    chat template (a fast tokenizer: transformers needs no other file)."""
    tokenizer.inner.save(str(directory / "tokenizer.json"))
    tcfg: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                  "model_max_length": int(config.get("max_position_embeddings", 4096))}
    tcfg.update({k: tokenizer.special_tokens[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                 if k in tokenizer.special_tokens})
    if tokenizer.chat_template:
        tcfg["chat_template"] = tokenizer.chat_template
    _write_json(directory / "tokenizer_config.json", tcfg)


def _write_weights(directory: Path, weights, dtype: torch.dtype, max_shard_bytes: int) -> tuple[list[str], int, int]:
    """The weights in safetensors files of at most max_shard_bytes each (a bigger tensor alone in one):
    one model.safetensors, or shards and their index. Holds one shard in memory at a time.
    Returns (file names, number of tensors, bytes of tensor data)."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    written: list[Path] = []
    weight_map: dict[str, int] = {}
    size = shard_size = 0

    def flush() -> None:
        written.append(directory / f".shard-{len(written)}")
        save_file(shards[-1], str(written[-1]), metadata={"format": "pt"})
        shards[-1] = {}

    for name, tensor in weights:
        t = tensor.to(dtype).contiguous()      # [out, in] for a linear's weight, as HF stores it
        if shards[-1] and shard_size + t.nbytes > max_shard_bytes:
            flush()
            shard_size = 0
        shards[-1][name], weight_map[name] = t, len(written)
        shard_size += t.nbytes
        size += t.nbytes
    flush()
    n = len(written)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for path, name in zip(written, names):
        os.chmod(path, 0o644)       # safetensors writes 0600
        os.replace(path, directory / name)
    if n > 1:
        _write_json(directory / "model.safetensors.index.json",
                    {"metadata": {"total_size": size}, "weight_map": {k: names[i] for k, i in weight_map.items()}})
    return names, len(weight_map), size


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
