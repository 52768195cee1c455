"""Find a model and open it: config, tokenizer, and a lazy iterator over its weights.

`model` is a checkpoint, never a name (jobrunner.models turns known names into files):
  * a local directory or fsspec URL of an HF model directory (config.json, *.safetensors,
    tokenizer.json, ...); remote files are copied to <cache>/remote/ first, then mmapped;
  * a local path or fsspec URL of a single .gguf file (or of a directory holding one .gguf
    and no config.json);
  * "dummy:<name or config.json path/URL>": a config alone, no weights.

A vision-language directory (config.json with vision_config) also gives the bundle its image processor
(preprocessor_config.json: engine.vision.processor) and, where no chat_template.jinja is, the chat template
of chat_template.json (a processor's, as older checkpoints ship it).

Invariants: only safetensors and GGUF are ever read (never pickles, never checkpoint code);
every file is validated when the bundle is built, so a truncated or corrupt file fails
here with a ModelError naming it, not halfway through loading; `weights()` yields one
tensor at a time, so a checkpoint is never held twice in memory.
"""
from __future__ import annotations

import hashlib
import json
import os
import posixpath
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from jobrunner.engine.config.engine_config import cache_root
from jobrunner.engine.config.embedding import CheckpointPooling, read_checkpoint_pooling
from jobrunner.engine.api.errors import ModelError
from jobrunner.engine.config.generation import GenerationDefaults
from jobrunner.engine.config.model_config import ModelConfig
from jobrunner.engine.shipped import ShippedQuant, read_quantization
from jobrunner.engine.load.dummy_configs import DUMMY_CONFIGS
from jobrunner.engine.load.safetensors_weights import WeightIterator, narrow, safetensors_files, safetensors_weights
from jobrunner.engine.load.tokenizer import Tokenizer

__all__ = ["ModelBundle", "ModelError", "load_model_bundle", "DUMMY_CONFIGS"]


# HF directory files we read; weights are the *.safetensors the index (or the listing) names.
_HF_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
             "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "model.safetensors.index.json",
             "modules.json")


@dataclass
class ModelBundle:
    config: ModelConfig
    hf_config: dict
    tokenizer: Tokenizer          # tokenizer.eos_token_ids is the full stop set (config + template)
    # HF parameter names -> floating tensors, one at a time, in the checkpoint's float dtype
    # (float32 for GGUF, usually bfloat16 for safetensors); the caller casts. Each call
    # starts a fresh pass. For weight_format == "dummy" it yields nothing: the engine
    # initializes random weights itself.
    weights: Callable[[], WeightIterator]
    source: str                   # what was loaded, for logs
    weight_format: str            # safetensors | gguf | dummy
    # GGUF only: the stored (quantized) tensors, rows in HF order (engine.gguf.RawTensor).
    raw_weights: Callable[[], Iterator] | None = None
    # a local HF directory's sentence-transformers pooling (engine.embedding_config), or None
    pooling: CheckpointPooling | None = None
    # generation_config.json's sampling defaults (HF directories; none for GGUF)
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    # safetensors-backed bundles: weights(select) reading only the slices select(name, shape) picks
    sliced_weights: Callable[[Callable], WeightIterator] | None = None
    # a quantized checkpoint's scheme (config.json's quantization_config: engine/quant/shipped), or None
    quantization: ShippedQuant | None = None
    # a vision-language checkpoint's (engine.vision.processor.ImageProcessor, from preprocessor_config.json), or None
    image_processor: object | None = None

    def shard_weights(self, select) -> WeightIterator:
        """The weights, each narrowed to what select(name, shape) picks: None for all of it, else
        (dim, [(start, length), ...]) joined along dim, skipped with no ranges (engine/parallel/shards.py). Safetensors files
        are read slice by slice, so a rank never holds a whole tensor it keeps a part of."""
        if self.sliced_weights is not None:
            yield from self.sliced_weights(select)
            return
        for name, tensor in self.weights():
            picked = select(name, tuple(tensor.shape))
            if picked is None or picked[1]:
                yield name, narrow(tensor, picked)


def checkpoint_quantization(model: str) -> str | None:
    """The scheme of a quantized HF checkpoint directory (config.json's quantization_config, as
    ModelBundle.quantization names it), None for a float one, a GGUF file or dummy:; ConfigError for a
    scheme the engine does not run. Reads config.json only."""
    quant = _shipped_quant(model)
    return None if quant is None else quant.name


def _shipped_quant(model: str):
    """config.json's quantization_config read (ShippedQuant), None where it has none or there is no config."""
    if model.startswith("dummy:"):
        return None
    fs, path = _url_to_fs(model)
    config = posixpath.join(path, "config.json")
    try:
        if not (fs.isdir(path) and fs.exists(config)):
            return None
        hf_config = json.loads(fs.cat_file(config))
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read {config}: {e}") from e
    return read_quantization(hf_config)


def ships_int4(model: str) -> bool:
    """Whether `model`'s linears are shipped 4-bit, so int4 and w4a8 compute on them as shipped (the checkpoint's
    own numbers): a local GGUF file whose 2-D weights are mostly Q4_0/Q4_1 (engine/quant/apply.py; its header
    read), or a checkpoint quantized int4 weight-only (W4A16, GPTQ, AWQ: `--quantization w4a8` runs its linears
    with int8 activations; its config.json read)."""
    if not (model.endswith(".gguf") and os.path.isfile(model)):
        quant = _shipped_quant(model)
        return quant is not None and quant.int4_weight_only
    from jobrunner.engine.load.gguf import GGUFFile      # numpy and the gguf reader: only for a .gguf file
    matrices = [t.tensor_type.name for t in GGUFFile(model).reader.tensors if len(t.shape) == 2]
    return sum(name in ("Q4_0", "Q4_1") for name in matrices) * 2 > len(matrices)


def load_model_bundle(model: str, cache_dir: str | os.PathLike | None = None) -> ModelBundle:
    """Open `model` (see the module docstring); raises ModelError with a clear message."""
    if model.startswith("dummy:"):
        return _load_dummy(model[len("dummy:"):])
    fs, path = _url_to_fs(model)
    try:
        return _load_path(fs, path, model, cache_dir)
    except ModelError:
        raise
    except Exception as e:  # network and filesystem errors of remote fsspec backends
        raise ModelError(f"cannot read model {model!r}: {type(e).__name__}: {e}") from e


def _load_path(fs, path: str, model: str, cache_dir) -> ModelBundle:
    if not fs.exists(path):
        raise ModelError(
            f"model {model!r} is not an existing path or a reachable URL: give an HF model directory, a .gguf "
            f"file or an fsspec URL of one, or dummy:<name> for random weights "
            f"({', '.join(sorted(DUMMY_CONFIGS))}, or a config.json path)")
    local = _is_local(fs)
    if fs.isdir(path) and not fs.exists(posixpath.join(path, "config.json")):
        ggufs = [p for p in fs.ls(path, detail=False) if p.endswith(".gguf")]
        if len(ggufs) != 1:
            raise ModelError(f"{model}: a model directory needs config.json, or exactly one .gguf file "
                             f"(found {len(ggufs)})")
        path = ggufs[0]
    if fs.isdir(path):
        if not local:
            path = str(_copy_hf_dir(fs, path, model, cache_dir))
        return _load_hf_dir(path, source=model)
    if path.endswith(".gguf") or _has_gguf_magic(fs, path):
        if not local:
            path = str(_copy_files(fs, [path], _remote_dir(model, cache_dir))[0])
        return _load_gguf(Path(path), source=model, cache_dir=cache_dir)
    raise ModelError(f"{model}: expected an HF model directory (config.json, *.safetensors) or a .gguf file")


# -- GGUF ------------------------------------------------------------------------

def _load_gguf(path: Path, source: str, cache_dir=None) -> ModelBundle:
    """A GGUF file; a small one's float conversion is kept on disk and memory-mapped at later starts
    (engine/load/float_cache.py), the file itself then opened only for its quantized blocks."""
    from jobrunner.engine.load import float_cache
    from jobrunner.engine.load.gguf import GGUFFile

    converted = float_cache.cache_dir(path, cache_root(cache_dir))
    cached = float_cache.read(converted)
    if cached is None:
        f = GGUFFile(path)
        hf_config, tokenizer = f.hf_config(), Tokenizer.from_gguf(f)
        if f.float32_bytes() > float_cache.MAX_FLOAT_BYTES or \
                not float_cache.write(converted, hf_config, tokenizer, f.iter_tensors()):
            # each pass maps the file anew: held by the bundle, one mapping would keep every page read
            # resident for the engine's life, beside the weights built from them
            return ModelBundle(config=_model_config(hf_config, str(path)), hf_config=hf_config, tokenizer=tokenizer,
                               weights=lambda: GGUFFile(path).iter_tensors(), source=source, weight_format="gguf",
                               raw_weights=lambda: GGUFFile(path).iter_raw_tensors())
        cached = hf_config, tokenizer, float_cache.weights_file(converted)
    hf_config, tokenizer, weights_file = cached
    weights = safetensors_weights([weights_file])
    return ModelBundle(config=_model_config(hf_config, str(path)), hf_config=hf_config, tokenizer=tokenizer,
                       weights=weights, source=source, weight_format="gguf",
                       raw_weights=lambda: GGUFFile(path).iter_raw_tensors(), sliced_weights=weights)


# -- HF directories (safetensors) ------------------------------------------------

def _load_hf_dir(path: str, source: str) -> ModelBundle:
    """A local HF directory: config.json, safetensors (one or sharded), tokenizer.json."""
    import fsspec
    from safetensors import safe_open

    root = Path(path)
    hf_config = _read_json(root / "config.json", required=True)
    files = safetensors_files(root, _read_json(root / "model.safetensors.index.json"))
    names: dict[str, Path] = {}
    for file in files:  # validate every header now: truncation and corruption show up here
        try:
            with safe_open(file, framework="pt") as st:
                names.update((k, file) for k in st.keys())
        except Exception as e:
            raise ModelError(f"{file}: corrupt or truncated safetensors file ({e})") from e
    index = _read_json(root / "model.safetensors.index.json")
    missing = [k for k in index.get("weight_map", {}) if k not in names]
    if missing:
        raise ModelError(f"{root}: model.safetensors.index.json names tensors no shard has: {missing[:5]}")

    config = _model_config(hf_config, str(root / "config.json"))
    tokenizer = _processor_template(Tokenizer.from_hf_dir(fsspec.filesystem("file"), str(root)), root)
    generation = GenerationDefaults.from_config(_read_json(root / "generation_config.json"))
    weights = safetensors_weights(files)
    return ModelBundle(config=config, hf_config=hf_config,
                       tokenizer=tokenizer, weights=weights, source=source,
                       weight_format="safetensors", pooling=read_checkpoint_pooling(root), generation=generation,
                       sliced_weights=weights, quantization=read_quantization(hf_config),
                       image_processor=_image_processor(config, hf_config, root, tokenizer))


def _processor_template(tokenizer: Tokenizer, root: Path) -> Tokenizer:
    """The tokenizer with chat_template.json's template (a processor's, as older vision-language
    checkpoints ship it) where no chat_template.jinja overrides it; rebuilt, so that its end-of-turn
    tokens stop generation as a template's do."""
    template = _read_json(root / "chat_template.json").get("chat_template")
    if not template or (root / "chat_template.jinja").is_file():
        return tokenizer
    return Tokenizer(tokenizer.inner, chat_template=template, special_tokens=tokenizer.special_tokens,
                     bos_token_id=tokenizer.bos_token_id, eos_token_ids=tokenizer.eos_token_ids)


def _image_processor(config: ModelConfig, hf_config: dict, root: Path, tokenizer: Tokenizer):
    """A vision-language checkpoint's image processor (preprocessor_config.json), None for a text model."""
    if config.vision is None:
        return None
    preprocessor = root / "preprocessor_config.json"
    if not preprocessor.is_file():
        raise ModelError(f"{root}: a vision-language model ({config.architecture}) needs preprocessor_config.json")
    from jobrunner.engine.vision.processor import load_image_processor
    try:
        return load_image_processor(hf_config, _read_json(preprocessor), tokenizer)
    except (KeyError, ValueError, TypeError) as e:
        raise ModelError(f"{preprocessor}: unsupported image processor settings ({type(e).__name__}: {e})") from e


# -- dummy -----------------------------------------------------------------------



def _load_dummy(spec: str) -> ModelBundle:
    """Config only. Tokenizer: tokenizer.json beside the config if any, else bytes_fallback; a
    vision-language config's image processor: preprocessor_config.json beside it, if any."""
    tokenizer, generation, beside = None, GenerationDefaults(), None     # beside: the config's local folder
    if spec in DUMMY_CONFIGS:
        hf_config = dict(DUMMY_CONFIGS[spec])
    else:
        fs, path = _url_to_fs(spec)
        if fs.isdir(path):
            path = posixpath.join(path, "config.json")
        if not fs.isfile(path):
            raise ModelError(f"dummy:{spec}: not a built-in dummy model ({', '.join(sorted(DUMMY_CONFIGS))}) "
                             "nor a config.json path")
        try:
            hf_config = json.loads(fs.cat_file(path))
        except ValueError as e:
            raise ModelError(f"{path}: invalid JSON ({e})") from e
        folder = posixpath.dirname(path)
        beside = Path(folder) if _is_local(fs) else None
        if fs.exists(posixpath.join(folder, "tokenizer.json")):
            tokenizer = Tokenizer.from_hf_dir(fs, folder)
            tokenizer = tokenizer if beside is None else _processor_template(tokenizer, beside)
        if fs.exists(gen_path := posixpath.join(folder, "generation_config.json")):
            try:
                generation = GenerationDefaults.from_config(json.loads(fs.cat_file(gen_path)))
            except ValueError as e:
                raise ModelError(f"{gen_path}: invalid JSON ({e})") from e
    config = _model_config(hf_config, f"dummy:{spec}")
    if tokenizer is None:
        tokenizer = Tokenizer.bytes_fallback(config.vocab_size)
    image_processor = None
    if config.vision is not None and beside is not None and (beside / "preprocessor_config.json").is_file():
        image_processor = _image_processor(config, hf_config, beside, tokenizer)
    return ModelBundle(config=config, hf_config=hf_config, tokenizer=tokenizer, weights=lambda: iter(()),
                       source=f"dummy:{spec}", weight_format="dummy", generation=generation,
                       image_processor=image_processor)


# -- helpers ---------------------------------------------------------------------

def _model_config(hf_config: dict, where: str) -> ModelConfig:
    try:
        return ModelConfig.from_hf(hf_config)
    except (KeyError, ValueError, TypeError) as e:
        raise ModelError(f"{where}: unsupported or incomplete model config ({type(e).__name__}: {e})") from e


def _read_json(path: Path, required: bool = False) -> dict:
    if not path.is_file():
        if required:
            raise ModelError(f"{path}: missing")
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ModelError(f"{path}: invalid JSON ({e})") from e


def _url_to_fs(url: str):
    import fsspec

    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:
        hint = " (hf:// needs `pip install huggingface_hub`)" if url.startswith("hf://") else ""
        raise ModelError(f"cannot open {url!r}: {e}{hint}") from e


def _is_local(fs) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "file" in protocol or "local" in protocol


def _has_gguf_magic(fs, path: str) -> bool:
    with fs.open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _remote_dir(url: str, cache_dir) -> Path:
    return cache_root(cache_dir) / "remote" / hashlib.sha256(url.encode()).hexdigest()[:16]


def _copy_hf_dir(fs, path: str, url: str, cache_dir) -> Path:
    """Copy an HF directory's config, tokenizer and safetensors files to the local cache."""
    listing = {posixpath.basename(p.rstrip("/")): p for p in fs.ls(path, detail=False)}
    wanted = [listing[n] for n in _HF_FILES if n in listing]
    wanted += [p for n, p in sorted(listing.items()) if n.endswith(".safetensors")]
    dest = _remote_dir(url, cache_dir)
    _copy_files(fs, wanted, dest)
    pooling = posixpath.join(path, "1_Pooling", "config.json")     # sentence-transformers' usual place
    if "modules.json" in listing and fs.exists(pooling):
        _copy_files(fs, [pooling], dest / "1_Pooling")
    return dest


def _copy_files(fs, paths: list[str], dest: Path) -> list[Path]:
    """Copy remote files into dest, skipping ones already there with the same size; atomic per file."""
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for p in paths:
        target = dest / posixpath.basename(p)
        size = fs.info(p).get("size")
        if not (target.is_file() and size is not None and target.stat().st_size == size):
            fd, tmp = tempfile.mkstemp(dir=dest, prefix=f".{target.name}.", suffix=".part")
            try:
                with os.fdopen(fd, "wb") as out_f, fs.open(p, "rb") as src:
                    while chunk := src.read(1 << 22):
                        out_f.write(chunk)
                os.chmod(tmp, 0o644)  # mkstemp makes it 0600
                os.replace(tmp, target)
            except Exception as e:
                raise ModelError(f"cannot copy {p} to {target}: {e}") from e
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        out.append(target)
    return out
