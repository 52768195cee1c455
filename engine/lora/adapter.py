"""One LoRA adapter in PEFT's format: adapter_config.json and adapter_model.safetensors.

    check_adapter(path) -> AdapterSpec     torch-free; ConfigError naming the field we don't support
    adapter_tensors(spec) -> {(HF module path, "A" | "B"): tensor}    safetensors only, never a pickle

The delta of a targeted linear is scaling * B @ A @ x, scaling = lora_alpha / r (rsLoRA: / sqrt(r)).
PEFT names a tensor base_model.model.<module path>.lora_A.weight; the module path is the base
checkpoint's (model.layers.3.self_attn.q_proj).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

from jobrunner.engine.config.engine_config import ConfigError

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# projections an adapter may target: the HF names of what the shared layers fuse or keep
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
# fields that must be unset (None, False, empty): each asks for something other than a plain LoRA
_MUST_BE_UNSET = ("use_dora", "lora_bias", "fan_in_fan_out", "modules_to_save", "rank_pattern", "alpha_pattern",
                  "layer_replication", "trainable_token_indices", "target_parameters", "alora_invocation_tokens",
                  "use_qalora", "use_bdlora", "arrow_config", "kasa_config", "velora_config", "monteclora_config",
                  "megatron_config")


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    path: str                   # a local directory
    rank: int
    scaling: float              # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    content_hash: str           # sha256 over the config's and the weights' bytes


def check_adapter(name: str, path: str) -> AdapterSpec:
    """Reads and checks an adapter directory; ConfigError (naming the adapter and the field) when it
    asks for more than LoRA on the attention and MLP projections."""
    where = Path(path)
    config_file, weights_file = where / CONFIG_FILE, where / WEIGHTS_FILE
    if not config_file.is_file() or not weights_file.is_file():
        raise ConfigError(f"LoRA adapter {name!r}: {path} needs {CONFIG_FILE} and {WEIGHTS_FILE} (PEFT's format; "
                          f"adapter_model.bin is never read)")
    raw = config_file.read_bytes()
    try:
        cfg = json.loads(raw)
    except ValueError as e:
        raise ConfigError(f"LoRA adapter {name!r}: {config_file} is not JSON: {e}") from None
    _refuse_unsupported(name, cfg)
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise ConfigError(f"LoRA adapter {name!r}: r must be a positive integer and lora_alpha a number")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    digest = hashlib.sha256(raw)
    with open(weights_file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return AdapterSpec(name, str(where), rank, float(scaling), digest.hexdigest())


def _refuse_unsupported(name: str, cfg: dict) -> None:
    def refuse(field: str, why: str):
        raise ConfigError(f"LoRA adapter {name!r}: {field} = {cfg.get(field)!r} is not supported ({why})")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        refuse("peft_type", "only LORA adapters are")
    if cfg.get("bias", "none") != "none":
        refuse("bias", "trained biases are not applied; only bias = \"none\" is")
    for field in _MUST_BE_UNSET:
        if cfg.get(field):
            refuse(field, "only plain LoRA on the attention and MLP projections is")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        refuse("target_modules", "a regular expression; list the module names instead")
    unknown = sorted(set(targets or ()) - set(TARGETS))
    if unknown or not targets:
        raise ConfigError(f"LoRA adapter {name!r}: target_modules {sorted(targets or [])} is not supported: "
                          f"LoRA applies to {', '.join(TARGETS[:7])} (or the fused qkv_proj, gate_up_proj)")


def adapter_tensors(spec: AdapterSpec) -> dict[tuple[str, str], object]:     # torch.Tensor values
    """{(module path without base_model.model. and model., "A" | "B"): tensor}; ConfigError for a
    tensor that is not a LoRA A or B weight (embeddings, DoRA magnitudes)."""
    from safetensors.torch import load_file
    out = {}
    for key, tensor in load_file(str(Path(spec.path) / WEIGHTS_FILE)).items():
        module, dot, kind = key.removeprefix("base_model.model.").removeprefix("model.").rpartition(".lora_")
        if not dot or kind not in ("A.weight", "B.weight") or tensor.dim() != 2:
            raise ConfigError(f"LoRA adapter {spec.name!r}: tensor {key!r} is not a LoRA A or B weight of a linear "
                              f"projection; only those are supported")
        out[(module, kind[0])] = tensor
    return out
