"""quantize_model: swap a loaded CausalLM's linears (and its embedding) for quantized modules.

What each scheme quantizes (decoder linears = qkv_proj, o_proj, gate_up_proj, down_proj):

    scheme  decoder linears                      embedding + lm_head
    int8    Int8Linear, per channel              int8 (QuantEmbedding; a tied lm_head shares it)
    int4    Int4Linear, group 32 (or 64, 128)    int8 (as int8)
    w8a8    W8A8Linear, after SmoothQuant        int8 per row; lm_head W8A8Linear
    w4a8    W4A8Linear: int4's weights, int8     int8 (as int8)
            activations per group (CPU)
    fp8     Fp8Linear                            left in the model dtype

Mixture-of-experts blocks: the stacked experts are int8 or fp8 per output channel of each
expert, weight-only (engine/quant/experts.py), under int8 and fp8; a shared expert is a decoder
linear like the others; the router stays in the model dtype. int4, w4a8 and w8a8 refuse MoE models.

The embedding and lm_head are int8 even under int4: SmolLM2-135M's tied 49152 x 576
embedding is a fifth of its weights, so 0.2x of float32 is out of reach with a float
embedding, and 4-bit logits cost more quality than 8-bit ones (llama.cpp keeps its output
matrix at 6-8 bits for the same reason).

GGUF checkpoints (bundle.raw_weights): tensors stored as Q4_0/Q4_1 load into int4 (group 32)
and Q8_0 into int8 (group 32) straight from the file's bytes, no float round trip, so the
default model runs in int4 (and w4a8) exactly as shipped. Other cases quantize the float weights the
loader already put in the model.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from jobrunner.engine.config.engine_config import ConfigError
from jobrunner.engine.quant import formats, smooth
from jobrunner.engine.quant.experts import check_expert_scheme, quantize_experts
from jobrunner.engine.quant.linear import Fp8Linear, Int4Linear, Int8Linear, QuantEmbedding, W4A8Linear, W8A8Linear
from jobrunner.kernels.ops import int_mm_exact

SCHEMES = ("none", "int8", "int4", "w8a8", "w4a8", "fp8")
GROUPED = ("int4", "w4a8")          # schemes with int4 groups: "int4-g64", "w4a8-g128"
INT4_GROUP_SIZES = (32, 64, 128)
_LINEARS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


def parse_scheme(scheme: str) -> tuple[str, int | None]:
    """"int4" | "int4-g64" | "w4a8" | ... -> (name, int4 group size or None); ConfigError when unknown."""
    name, _, group = (scheme or "none").partition("-g")
    if name not in SCHEMES or (group and name not in GROUPED):
        raise ConfigError(f"unknown quantization {scheme!r}; choose one of {', '.join(SCHEMES)} "
                          f"(int4 and w4a8 take a group size as int4-g32, int4-g64 or int4-g128)")
    if name not in GROUPED:
        return name, None
    size = int(group) if group.isdigit() else (32 if not group else -1)
    if size not in INT4_GROUP_SIZES:
        raise ConfigError(f"int4 group size {group!r}: choose one of {', '.join(map(str, INT4_GROUP_SIZES))}")
    return name, size


def check_quantization(scheme: str, device: torch.device | str, dtype: torch.dtype | None = None,
                       moe: bool = False, tensor_parallel: int = 1) -> None:
    """Raises ConfigError (before any weight is loaded) when `scheme` cannot run on `device`, on
    a mixture-of-experts model's experts (`moe`), or split over `tensor_parallel` ranks."""
    name, _ = parse_scheme(scheme)
    if name == "w8a8" and tensor_parallel > 1:
        raise ConfigError("--quantization w8a8 calibrates SmoothQuant on the whole model, which one rank of a "
                          "tensor-parallel group does not hold; use int8, int4 or fp8 with --tensor-parallel")
    if moe and name != "none":
        check_expert_scheme(name)
    device = torch.device(device)
    if name == "w4a8" and device.type != "cpu":
        raise ConfigError(f"--quantization w4a8 is a CPU mode (int8 dot products over int4 weights); the engine runs "
                          f"on {device.type}: use int4 (weights only) or fp8 there")
    if name == "fp8":
        if device.type != "cuda":
            raise ConfigError(f"--quantization fp8 needs a CUDA GPU of compute capability 8.9 or newer "
                              f"(Ada, Hopper, Blackwell); the engine runs on {device.type}. "
                              f"On CPU use w8a8 (fast) or int8/int4 (small)")
        cc = torch.cuda.get_device_capability(device)
        if cc < (8, 9) or not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
            raise ConfigError(f"--quantization fp8 needs compute capability 8.9 or newer and torch._scaled_mm; "
                              f"{torch.cuda.get_device_name(device)} has {cc[0]}.{cc[1]}. Use int8 or int4")
    if name in ("w8a8", "fp8") and dtype is not None and dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ConfigError(f"--quantization {name} needs float activations, got {dtype}")


def w8a8_backend(device: torch.device) -> tuple[str, int]:
    """(backend, weight qmax) for W8A8Linear on `device`; see kernels.quant_matmul.int_mm_exact."""
    if device.type == "cuda":
        return "int_mm", 127
    for qmax in (127, 63):
        if int_mm_exact(qmax):
            return "int_mm", qmax
    if {"fbgemm", "x86"} & set(torch.backends.quantized.supported_engines):
        return "fbgemm", 127
    warnings.warn("w8a8: no exact int8 GEMM on this machine (torch._int_mm, fbgemm); using the slow reference")
    return "ref", 127


def layer_quantizer(model: nn.Module, scheme: str, bundle=None):
    """f(i) that quantizes decoder layer i's linears, for build_model to call as each layer's weights arrive (so a
    quantized model's float weights never exist all at once), or None where the scheme needs the whole float
    model first (w8a8: SmoothQuant calibrates on it; fp8) or the model has experts. quantize_model then does
    the rest (embedding, head) with layers_done=True."""
    name, group = parse_scheme(scheme)
    if name not in ("int8", *GROUPED) or any(hasattr(layer.mlp, "experts") for layer in model.layers):
        return None
    quantizer = _LinearQuantizer.choose(model, name, group, bundle, model.embed_tokens.weight.device, None)
    return torch.no_grad()(lambda i: _quantize_layer(model, i, quantizer))


@torch.no_grad()
def quantize_model(model: nn.Module, scheme: str, bundle=None, *, w8a8_backend_name: str | None = None,
                   quantize_lm_head: bool | None = None, smooth_alpha: float | None = smooth.ALPHA,
                   layers_done: bool = False) -> nn.Module:
    """Swaps `model`'s modules in place for quantized ones (see the module doc); returns model.

    bundle: the ModelBundle the model was loaded from; with a GGUF bundle, Q4_0/Q4_1/Q8_0 tensors
    load straight from the file. w8a8_backend_name: "int_mm" | "fbgemm" | "ref" (default: the
    fastest exact one here). quantize_lm_head: default True for int8/int4/w8a8, False for fp8.
    smooth_alpha: w8a8 only: SmoothQuant strength (engine/quant/smooth.py), calibrated on a short
    built-in text with the bundle's tokenizer; None (or no bundle) skips it. layers_done: the decoder layers
    were quantized as they loaded (layer_quantizer); only the embedding and head are left."""
    name, group = parse_scheme(scheme)
    if name == "none":
        return model
    device = model.embed_tokens.weight.device
    dtype = model.embed_tokens.weight.dtype
    check_quantization(scheme, device, dtype, moe=any(hasattr(layer.mlp, "experts") for layer in model.layers))
    quantizer = _LinearQuantizer.choose(model, name, group, bundle, device, w8a8_backend_name)
    if name == "w8a8" and smooth_alpha is not None and getattr(bundle, "tokenizer", None) is not None \
            and smooth.applies_to(model):
        ids = smooth.calibration_ids(bundle.tokenizer)
        smooth.smooth_model(model, smooth.input_amax(model, ids), smooth_alpha)
    if not layers_done:
        for i in range(len(model.layers)):
            _quantize_layer(model, i, quantizer)
    if quantize_lm_head is None:
        quantize_lm_head = name != "fp8"
    if quantize_lm_head:
        _quantize_embedding_and_head(model, name, quantizer.raw, device, dtype,
                                     qmax=quantizer.qmax, backend=quantizer.backend)
    model.quantization = scheme
    return model


@dataclass(frozen=True)
class _LinearQuantizer:
    """One quantize_model call's choices: how a decoder linear becomes its quantized module."""
    name: str
    group: int | None
    device: torch.device
    raw: dict                    # our module name -> its GGUF RawTensors (int8, int4 of an unsplit model), or {}
    qmax: int = 127              # w8a8: the weights' range for the backend
    backend: str | None = None   # w8a8's GEMM
    rowwise: bool = False        # fp8: per-row scales (compute capability 9.0 and newer)

    @classmethod
    def choose(cls, model, name: str, group: int | None, bundle, device, w8a8_backend_name: str | None):
        # GGUF blocks map onto int8 and int4 whole; a tensor-parallel rank quantizes its float shard
        raw = _raw_tensors(bundle, model.FUSED_SHARDS) if name in ("int8", *GROUPED) and model.tp.size == 1 else {}
        if name == "w8a8":
            backend, qmax = w8a8_backend(device)
            if w8a8_backend_name is not None:
                backend, qmax = w8a8_backend_name, (qmax if w8a8_backend_name == "int_mm" else 127)
            return cls(name, group, device, raw, qmax, backend)
        rowwise = name == "fp8" and torch.cuda.get_device_capability(device) >= (9, 0)
        return cls(name, group, device, raw, rowwise=rowwise)

    def __call__(self, full: str, lin: nn.Linear) -> nn.Module:
        """The quantized module for `lin`, the model's module `full` (e.g. "layers.0.self_attn.qkv_proj")."""
        parts = self.raw.pop(full, None)        # a module's blocks are read once: copied, then their pages dropped
        try:
            return self._quantized(lin, parts)
        finally:
            for part in parts or ():
                part.drop_pages()

    def _quantized(self, lin: nn.Linear, parts: list | None) -> nn.Module:
        w, bias, device = lin.weight, lin.bias, self.device
        if self.name == "int8":
            if parts and all(p.ggml_type in formats.GGUF_INT8_TYPES for p in parts):
                return Int8Linear(*_to(formats.int8_from_gguf(parts), device), bias=bias)
            return Int8Linear(*formats.quantize_int8(w), bias=bias)
        if self.name in GROUPED:
            cls = Int4Linear if self.name == "int4" else W4A8Linear
            if self.group == formats.GGUF_GROUP and parts \
                    and all(p.ggml_type in formats.GGUF_INT4_TYPES for p in parts) \
                    and len({p.ggml_type for p in parts}) == 1:
                packed, s, z = _to(formats.int4_from_gguf(parts), device)
                return cls(packed, s, z, formats.GGUF_GROUP, lin.in_features, bias=bias)
            return cls(*formats.quantize_int4(w, self.group), self.group, lin.in_features, bias=bias)
        if self.name == "w8a8":
            return W8A8Linear(*formats.quantize_int8(w, qmax=self.qmax), bias=bias, backend=self.backend)
        return Fp8Linear(*formats.quantize_fp8(w), bias=bias, rowwise=self.rowwise)


def int8_activations(model: nn.Module) -> int:
    """w4a8 over int4 linears already built (a shipped W4A16 / GPTQ / AWQ checkpoint's, inside act-order or
    concatenated wrappers too): each becomes a W4A8Linear over the same buffers. Returns how many."""
    swaps = [(name, m) for name, m in model.named_modules() if type(m) is Int4Linear]
    for name, m in swaps:
        parent, _, attr = name.rpartition(".")
        w4a8 = W4A8Linear(m.packed, m.scales, m.zeros, m.group_size, m.in_features, bias=m.bias)
        setattr(model.get_submodule(parent) if parent else model, attr, w4a8)
    model.quantization = "w4a8"
    return len(swaps)


def _quantize_layer(model: nn.Module, i: int, quantize: _LinearQuantizer) -> None:
    """Decoder layer i's linears swapped for quantize's modules; a MoE block's experts quantized too."""
    layer = model.layers[i]
    for parent_name, attr in _decoder_linears(layer):
        parent = layer.get_submodule(parent_name)
        lin = getattr(parent, attr)
        setattr(parent, attr, quantize(f"layers.{i}.{parent_name}.{attr}", lin))
        del lin
    if hasattr(layer.mlp, "experts"):       # a MoE block: its router stays in the model dtype
        quantize_experts(layer.mlp.experts, quantize.name)


def _decoder_linears(layer):
    """(parent module path, attribute) of a layer's linears: _LINEARS, or in a MoE block its shared expert's."""
    for parent, attr in _LINEARS:
        if parent == "mlp" and hasattr(layer.mlp, "experts"):
            if layer.mlp.shared_expert is not None:
                yield "mlp.shared_expert", attr
        else:
            yield parent, attr


def _quantize_embedding_and_head(model, name, raw, device, dtype, qmax, backend) -> None:
    """int8 embedding (GGUF Q8_0 as stored, else per row) and an int8 lm_head sharing it when tied."""
    tied = model.lm_head.weight is model.embed_tokens.weight
    emb_raw = raw.get("embed_tokens")
    if name != "w8a8" and emb_raw and emb_raw[0].ggml_type in formats.GGUF_INT8_TYPES:
        q, s = _to(formats.int8_from_gguf(emb_raw), device)
    else:   # w8a8's head needs per-row (= per output channel) scales
        q, s = formats.quantize_int8(model.embed_tokens.weight, qmax=qmax)
    head_weight = None if tied else model.lm_head.weight
    model.embed_tokens = QuantEmbedding(q, s, dtype)
    if not tied:
        head_raw = raw.get("lm_head")
        if name != "w8a8" and head_raw and head_raw[0].ggml_type in formats.GGUF_INT8_TYPES:
            q, s = _to(formats.int8_from_gguf(head_raw), device)
        else:
            q, s = formats.quantize_int8(head_weight, qmax=qmax)
    model.lm_head = (W8A8Linear(q, s, backend=backend) if name == "w8a8" else Int8Linear(q, s))


def _to(tensors, device):
    return tuple(t.to(device) for t in tensors)


def _raw_tensors(bundle, fused_shards: dict[str, tuple[str, int]]) -> dict[str, list]:
    """Our module name -> its GGUF RawTensors in shard order ({} when not a GGUF bundle).
    e.g. "layers.0.self_attn.qkv_proj" -> [q_proj, k_proj, v_proj]; "embed_tokens"; "lm_head".
    fused_shards: the model's HF name piece -> (fused module, shard index) (CausalLM.FUSED_SHARDS)."""
    if bundle is None or getattr(bundle, "raw_weights", None) is None:
        return {}
    shards: dict[str, dict[int, object]] = {}
    for t in bundle.raw_weights():
        hf = t.name.removeprefix("model.")
        if not hf.endswith(".weight"):
            continue
        module = hf[:-len(".weight")]
        index = 0
        for piece, (fused, shard) in fused_shards.items():
            if module.endswith(f".{piece}"):
                module, index = module[:-len(piece)] + fused, shard
                break
        shards.setdefault(module, {})[index] = t
    return {m: [parts[i] for i in sorted(parts)] for m, parts in shards.items()}
