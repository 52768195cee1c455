"""Start-up: resolve device and dtype, load the model, size the KV cache.

Values found at start-up live here, not in the frozen EngineConfig.
"""
from __future__ import annotations

import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from jobrunner.engine.config.engine_config import CPU_KV_CACHE_BYTES, EngineConfig
from jobrunner.engine.config.engine_config import ConfigError
from jobrunner.engine.config.embedding import CheckpointPooling
from jobrunner.engine.config.generation import GenerationDefaults
from jobrunner.engine.api.info import Tokenizer
from jobrunner.engine.lora.adapter import check_adapter
from jobrunner.engine.lora.wrapped import LoraSet, apply_loras
from jobrunner.engine.config.model_config import ModelConfig
from jobrunner.engine.models import model_class
from jobrunner.engine.models.base import CausalLM
from jobrunner.engine.run.model_runner import ModelRunner
from jobrunner.engine.run.cpu_decode import DecodeKernels
from jobrunner.engine.run.packed_weights import pack_linears
from jobrunner.engine.run import batch_invariance
from jobrunner.engine.run.cpu_kernel_build import attach_cpu_kernels, panel_kernel
from jobrunner.engine.parallel.group import SINGLE, TensorParallel, building
from jobrunner.engine.parallel.launch import Followers
from jobrunner.engine.parallel.shards import check_split
from jobrunner.engine.run import process_settings

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# (max_num_seqs, max_num_batched_tokens) when the config leaves them None. On an H200 with an 8B
# model, 1024 sequences and 8192-token steps ran 256/256 prompts at 26.7k tok/s (benchmarks/RESULTS.md);
# on CPU a step's cost grows with its tokens, so smaller steps keep rows flowing.
BATCH_LIMITS = {"cuda": (1024, 8192), "cpu": (256, 2048)}


@dataclass
class EngineRuntime:
    model: CausalLM
    model_config: ModelConfig
    tokenizer: Tokenizer
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    num_blocks: int
    eos_token_ids: tuple[int, ...]
    weight_bytes: int
    load_s: float
    source: str
    max_num_seqs: int                   # the config's, or BATCH_LIMITS for the device
    max_num_batched_tokens: int
    pooling: CheckpointPooling | None = None    # what the checkpoint says embeddings are (engine.embedding_config)
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)   # the checkpoint's sampling defaults
    tp: TensorParallel = SINGLE                 # this process's rank in its tensor-parallel group
    followers: Followers | None = None          # rank 0 of a group: the other ranks' processes
    loras: LoraSet = field(default_factory=lambda: LoraSet([], {}, {}, 0))   # the job's LoRA adapters (engine/lora)
    image_processor: object | None = None       # a vision-language checkpoint's (engine.vision.processor), else None

    def max_model_len(self, block_size: int) -> int:
        """The longest sequence: the model's positions, or the KV cache's tokens if fewer."""
        return min(self.model_config.max_position_embeddings, self.num_blocks * block_size)


def resolve_device(name: str, tp_rank: int = 0) -> torch.device:
    """The device of `name`; tensor-parallel rank r takes the r-th GPU from the one named (or from 0)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA GPU is visible")
    device = torch.device(name)
    if device.type == "cuda" and (tp_rank or device.index is not None):
        device = torch.device("cuda", (device.index or 0) + tp_rank)
    if device.type == "cuda" and device.index is not None:
        if device.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {name}: only {torch.cuda.device_count()} CUDA GPU(s) are visible")
        # one engine per process and device: graphs, events and streams made later belong to it (the device
        # before comes back when the last engine closes: engine/run/process_settings.py)
        process_settings.set_cuda_device(device)
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; choose one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def resolve_kv_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    if name == "auto":
        return dtype
    if name == "int8":
        return torch.int8
    if name == "fp8":
        raise ConfigError("--kv-cache-dtype fp8 is not supported yet; use int8 (same size, works on CPU and GPU)")
    raise ConfigError(f"unknown --kv-cache-dtype {name!r}; choose auto or int8")


def build_runtime(config: EngineConfig, bundle=None, tp: TensorParallel | None = None) -> EngineRuntime:
    """Device, model and KV cache size. With config.tensor_parallel > 1 the caller is rank 0 (tp None:
    it starts the other ranks here, once the checkpoint has opened) or one of the others (tp given)."""
    t0 = time.perf_counter()
    device = resolve_device(config.device, tp.rank if tp else 0)
    dtype = resolve_dtype(config.dtype, device)
    kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, dtype)
    seqs, tokens = BATCH_LIMITS["cuda" if device.type == "cuda" else "cpu"]
    seqs = seqs if config.max_num_seqs is None else config.max_num_seqs
    tokens = tokens if config.max_num_batched_tokens is None else config.max_num_batched_tokens
    if seqs < 1 or tokens < 1:
        raise ConfigError(f"max_num_seqs ({seqs}) and max_num_batched_tokens ({tokens}) must be >= 1")
    if config.quantization != "none":  # quantization: refuse an impossible scheme before opening anything
        from jobrunner.engine.quant import check_quantization
        check_quantization(config.quantization, device, dtype)
    if config.num_threads and device.type == "cpu":
        process_settings.set_threads(config.num_threads)      # the count before: back at the last engine's close
    if config.max_loras is not None and config.max_loras < 1:
        raise ConfigError(f"max_loras ({config.max_loras}) must be >= 1")
    adapters = [check_adapter(name, path) for name, path in config.loras]   # refused before any weight is read
    if bundle is None:                 # the checkpoint's files and config, no weight read yet
        from jobrunner.engine.load.loader import load_model_bundle
        bundle = load_model_bundle(config.model)
    if config.quantization != "none" and bundle.config.moe is not None:     # and the experts', before any weight
        check_quantization(config.quantization, device, dtype, moe=True)
    _check_shipped(config, getattr(bundle, "quantization", None))
    image_processor = getattr(bundle, "image_processor", None)
    if image_processor is not None and config.tensor_parallel > 1:
        raise ConfigError("tensor parallelism does not split a vision-language model's vision tower; "
                          "run it on one device (--data-parallel spreads rows over several)")
    followers = None
    if config.tensor_parallel > 1 and tp is None:
        check_split(bundle.config, config.tensor_parallel, config.moe_split)
        if config.quantization != "none":
            check_quantization(config.quantization, device, dtype, tensor_parallel=config.tensor_parallel)
        followers = Followers(config, device)
        tp = followers.tp
    try:
        model, num_blocks, weight_bytes = _build_shard(config, bundle, device, dtype, kv_dtype, tp or SINGLE)
        # max_loras bounds the device slots (None: every adapter resident)
        loras = apply_loras(model, adapters, config.max_loras)
    except BaseException as e:
        if followers is None:
            raise
        lost = followers.lost(wait_s=5.0)   # a rank that failed (its closed connection may come first)
        followers.close(abort=True)          # the group can't go on without every rank's shard
        if isinstance(e, RuntimeError) and lost:      # another rank failed: its error is in its log above
            raise ConfigError(f"{lost} while building its shard of the model; see its error above") from e
        raise
    eos = tuple(getattr(bundle.tokenizer, "eos_token_ids", ()) or bundle.config.eos_token_ids)
    return EngineRuntime(model, bundle.config, bundle.tokenizer, device, dtype, kv_dtype, num_blocks, eos,
                         weight_bytes, time.perf_counter() - t0, bundle.source,
                         seqs, tokens, pooling=getattr(bundle, "pooling", None),
                         generation=getattr(bundle, "generation", None) or GenerationDefaults(),
                         tp=tp or SINGLE, followers=followers, loras=loras, image_processor=image_processor)


def _check_shipped(config: EngineConfig, shipped) -> None:
    """ConfigError for what a quantized checkpoint (`shipped`, None: a float one) cannot take."""
    if shipped is None:
        return
    if config.quantization not in ("none", "w4a8"):
        raise ConfigError(f"--quantization {config.quantization}: the checkpoint is quantized already "
                          f"({shipped.name}) and runs as shipped; drop --quantization (or give a float checkpoint)")
    if config.quantization == "w4a8" and not shipped.int4_weight_only:
        raise ConfigError(f"--quantization w4a8 runs a checkpoint's int4 weights with int8 activations; this one's "
                          f"are {shipped.name}: drop --quantization")
    if config.loras:
        raise ConfigError(f"LoRA adapters apply to float checkpoints; this one is quantized ({shipped.name})")


def _build_shard(config: EngineConfig, bundle, device, dtype, kv_dtype, tp: TensorParallel):
    """This rank's model (all of it on one device) and the KV blocks every rank has room for:
    (model, num_blocks, weight bytes)."""
    if config.batch_invariant:         # what the mode does not cover yet, refused before any weight is read
        batch_invariance.check_config(config, bundle, device, kv_dtype)
    with building(tp):
        model = build_model(bundle, device, dtype, config.seed, config.quantization)
    if config.quantization != "none":
        from jobrunner.engine.quant import int8_activations, quantize_model
        if getattr(bundle, "quantization", None) is not None:
            int8_activations(model)            # w4a8 over a shipped int4 checkpoint's own linears
        else:
            quantize_model(model, config.quantization, bundle, layers_done=model.quantized_as_loaded)
    weight_bytes = sum(t.numel() * t.element_size() for t in _unique_tensors(model))
    if config.packed_weights and device.type == "cpu":     # after quantizing: the float nn.Linear left
        added = pack_linears(model, batch_invariant=config.batch_invariant, panel_kernel=panel_kernel())
        model.packed_weights = added is not None
        weight_bytes += added or 0
    if config.batch_invariant:                             # read by the runner and EngineInfo
        batch_invariance.check_model(model, DecodeKernels())
        model.batch_invariant = True
    if device.type == "cpu":                               # int4 and int8 linears (ours or shipped): C kernels
        attach_cpu_kernels(model)
    per_block = ModelRunner.kv_bytes_per_block(bundle.config, config.block_size, kv_dtype, tp.size)
    budget = config.kv_cache_memory or _default_kv_budget(device, config)
    num_blocks = _agreed(budget // per_block, tp)
    if num_blocks < 1:
        raise ConfigError(f"--kv-cache-memory {budget} bytes holds no KV block of {per_block} bytes; raise it")
    return model, int(num_blocks), weight_bytes


def _agreed(num_blocks: int, tp: TensorParallel) -> int:
    """The fewest KV blocks any rank has room for: every rank holds the same block ids."""
    if tp.size == 1:
        return num_blocks
    import torch.distributed as dist
    n = torch.tensor([num_blocks], dtype=torch.int64)
    dist.all_reduce(n, op=dist.ReduceOp.MIN, group=tp.host)
    return int(n.item())


def build_model(bundle, device: torch.device, dtype: torch.dtype, seed: int = 0, quantization: str = "none") -> CausalLM:
    """Allocates the model without initializing it, then fills it from the weights, one tensor at a time. With a
    `quantization` whose decoder linears quantize one layer at a time (engine/quant: layer_quantizer), each layer
    is quantized as soon as its weights are in (model.quantized_as_loaded): the float copies of the model's
    linears never exist all at once, so the peak memory follows the quantized bytes. Storage is touched only
    when written (torch.empty), and a quantized layer's float storage is freed before the next is read."""
    cfg = bundle.config
    with _uninitialized():
        model = model_class(cfg.architecture)(cfg)
    shipped = getattr(bundle, "quantization", None)
    if shipped is not None:     # a quantized checkpoint: its linears never exist in float (placeholders)
        from jobrunner.engine.shipped import ShippedLoader
        shipped = ShippedLoader(model, shipped, device)
    _materialize(model, device, dtype)       # allocated in dtype at once: no float32 copy of a 30B model
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.init_buffers()
    model.quantized_as_loaded = False
    if bundle.weight_format == "dummy":
        _random_init(model, seed)
    else:
        weights = bundle.weights() if model.tp.size == 1 else bundle.shard_weights(model.shards.select)
        layer_done = _layer_quantizer(model, bundle, quantization) if shipped is None else None
        model.quantized_as_loaded = layer_done is not None
        if layer_done is not None:     # only CausalLM's own load_weights takes it (_layer_quantizer)
            filled = model.load_weights(weights, layer_done=layer_done)
        else:
            filled = model.load_weights(weights if shipped is None else shipped.split(weights))
        missing = model.expected_weight_names() - filled
        if shipped is not None:
            shipped.finish()
            missing = {m for m in missing if not shipped.covers(m)}
        if missing:
            raise ConfigError(f"model {bundle.source} lacks weights: {', '.join(sorted(missing)[:5])}"
                              + (" ..." if len(missing) > 5 else ""))
    model.eval().requires_grad_(False)
    return model


def _layer_quantizer(model: CausalLM, bundle, quantization: str):
    """engine/quant's layer_quantizer where this model's loading can call it (a dense model's own load_weights:
    experts and vision towers load their own way), else None."""
    if quantization == "none" or type(model).load_weights is not CausalLM.load_weights:
        return None
    from jobrunner.engine.quant import layer_quantizer
    return layer_quantizer(model, quantization, bundle)


_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "kaiming_uniform_",
                   "kaiming_normal_", "xavier_uniform_", "xavier_normal_")


@contextmanager
def _uninitialized():
    """Build modules on the meta device without their default initialization (the checkpoint fills
    every weight): initializing meta tensors runs Python decompositions that import torch._dynamo,
    seconds of every start-up."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    try:
        for name in _INIT_FUNCTIONS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        with torch.device("meta"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Real, uninitialized storage for a meta-built model, floating tensors in `dtype` (Module.to_empty
    runs Python decompositions of empty_like that import sympy: another second of start-up).
    Shared parameters come out unshared: the caller ties them again."""
    def empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(empty(p), requires_grad=p.requires_grad))
        for name, b in list(module.named_buffers(recurse=False)):
            module.register_buffer(name, empty(b), persistent=name not in module._non_persistent_buffers_set)


def _random_init(model: CausalLM, seed: int) -> None:
    """Dummy weights, each tensor drawn from its own seed (the seed and its name): a tensor-parallel
    rank's copies of the replicated tensors (routers, gates) equal the other ranks'."""
    g = torch.Generator(device=model.embed_tokens.weight.device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=g.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode())))


def _unique_tensors(model):
    seen = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen[t.data_ptr()] = t
    return seen.values()


def _default_kv_budget(device: torch.device, config: EngineConfig) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * config.gpu_memory_share)
    return CPU_KV_CACHE_BYTES
