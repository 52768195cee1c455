"""A checkpoint's `quantization_config` -> ShippedQuant: which modules are quantized, how, and under what name.

Read once when the bundle opens (engine/load/loader.py); everything it cannot run is a ConfigError naming
the scheme, before any weight is read: never a traceback, never a silent float model.

    compressed-tensors   formats pack-quantized (int4/int8 packed in int32), int-quantized (int8),
                         float-quantized (fp8 e4m3), naive-quantized (int levels stored as they are);
                         weights: int 4/8 bits (tensor, channel, group; symmetric or with zero points),
                         float 8 (tensor, channel, block); input activations: none, int8 (per token
                         dynamic or per tensor static, symmetric), fp8 (per token or group dynamic,
                         per tensor static)
    gptq                 4 and 8 bits, any group size (-1: per channel), desc_act (g_idx), sym or not,
                         checkpoint_format gptq (zeros stored minus one) or gptq_v2
    awq                  version gemm, 4 bits, zero points
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from jobrunner.engine.config.engine_config import ConfigError

METHODS = ("compressed-tensors", "gptq", "awq")
CT_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")


@dataclass(frozen=True)
class WeightArgs:
    type: str                          # "int" | "float"
    bits: int
    strategy: str                      # "tensor" | "channel" | "group" | "block"
    group_size: int | None = None      # group: columns a scale covers
    block: tuple[int, int] | None = None
    symmetric: bool = True


@dataclass(frozen=True)
class ActArgs:
    type: str                          # "int" | "float"
    strategy: str                      # "token" | "tensor" | "group"
    dynamic: bool
    group_size: int | None = None


@dataclass(frozen=True)
class ModuleScheme:
    """How one linear is stored and run."""
    format: str                        # compressed-tensors' format, or "gptq" / "awq"
    weights: WeightArgs
    acts: ActArgs | None = None        # None: weight-only
    desc_act: bool = False             # gptq: columns in g_idx's groups, not in order
    zeros_minus_one: bool = False      # gptq v1: qzeros hold the zero point minus one

    def describe(self) -> str:
        w = self.weights
        what = f"{'int' if w.type == 'int' else 'fp'}{w.bits}"
        how = {"group": f"g{w.group_size}", "block": f"block{w.block[0]}x{w.block[1]}" if w.block else "block",
               "channel": "per-channel", "tensor": "per-tensor"}[w.strategy]
        act = "" if self.acts is None else (
            f", {'int8' if self.acts.type == 'int' else 'fp8'} activations "
            f"{'dynamic' if self.acts.dynamic else 'static'} per {self.acts.strategy}")
        return f"{what} {how}{'' if w.symmetric else ' asym'}{' act-order' if self.desc_act else ''}{act}"


@dataclass(frozen=True)
class ShippedQuant:
    method: str
    groups: tuple[tuple[tuple[str, ...], ModuleScheme], ...]     # (targets, scheme), first match wins
    ignore: tuple[str, ...] = ()
    kv_cache: dict | None = None

    @property
    def name(self) -> str:
        """One line for logs, the manifest and cache keys: the method and each distinct scheme."""
        schemes = sorted({s.describe() for _, s in self.groups})
        return f"{self.method}: {'; '.join(schemes)}"

    @property
    def int4_weight_only(self) -> bool:
        """Every quantized linear int4 with float activations: the linears `--quantization w4a8` can run."""
        return all(s.weights.type == "int" and s.weights.bits == 4 and s.acts is None for _, s in self.groups)

    def scheme_for(self, module: str) -> ModuleScheme | None:
        """The scheme of the linear named `module` (HF's name, e.g. "model.layers.0.mlp.down_proj"), or
        None where it stays float (ignored, or no group targets it)."""
        if any(_matches(pattern, module) for pattern in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(_matches(t, module) for t in targets):
                return scheme
        return None


def _matches(pattern: str, module: str) -> bool:
    """compressed-tensors' target matching: "re:<regex>" against the whole name, "Linear" for every
    linear, else the name itself or its last parts."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None or re.match(pattern[3:], module.removeprefix("model.")) \
            is not None
    if pattern == "Linear":
        return True
    return module == pattern or module.endswith("." + pattern)


def read_quantization(hf_config: dict) -> ShippedQuant | None:
    """The checkpoint's scheme, None for a float checkpoint; ConfigError for one we do not run."""
    qc = hf_config.get("quantization_config") or hf_config.get("compression_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "?")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "gptq":
        return _gptq(qc)
    if method == "awq":
        return _awq(qc)
    raise ConfigError(f"the checkpoint is quantized with {method!r} (config.json quantization_config.quant_method), "
                      f"which jobrunner does not load; it loads {', '.join(METHODS)} checkpoints and GGUF files, "
                      f"or quantizes a float checkpoint itself (--quantization)")


def _refuse(what: str) -> ConfigError:
    return ConfigError(f"the checkpoint's quantization is not supported: {what}. Supported: compressed-tensors "
                       f"({', '.join(CT_FORMATS)}: int4/int8 weights, fp8 weights, int8/fp8 activations), "
                       f"GPTQ 4/8-bit, AWQ gemm 4-bit")


# ----------------------------------------------------------------------------- compressed-tensors

def _compressed_tensors(qc: dict) -> ShippedQuant:
    if qc.get("sparsity_config"):
        raise _refuse(f"compressed-tensors sparsity ({qc['sparsity_config'].get('format', '?')})")
    if qc.get("transform_config"):
        raise _refuse("compressed-tensors transforms (transform_config: rotations)")
    groups = []
    for name, group in (qc.get("config_groups") or {}).items():
        fmt = group.get("format") or qc.get("format") or "?"
        if fmt not in CT_FORMATS:
            raise _refuse(f"compressed-tensors format {fmt!r} (config group {name})")
        if group.get("output_activations"):
            raise _refuse(f"output activation quantization (config group {name})")
        weights = _ct_weights(group.get("weights"), name)
        acts = _ct_acts(group.get("input_activations"), weights, name)
        if weights.type == "float" and fmt not in ("float-quantized", "naive-quantized"):
            raise _refuse(f"fp8 weights in format {fmt!r} (config group {name})")
        if weights.type == "int" and fmt == "float-quantized":
            raise _refuse(f"int weights in format float-quantized (config group {name})")
        desc_act = (group.get("weights") or {}).get("actorder") == "group"     # a weight_g_idx per linear
        groups.append((tuple(group.get("targets") or ()), ModuleScheme(fmt, weights, acts, desc_act=desc_act)))
    if not groups:
        raise _refuse("a compressed-tensors config with no config_groups")
    kv = qc.get("kv_cache_scheme")
    return ShippedQuant("compressed-tensors", tuple(groups), tuple(qc.get("ignore") or ()), kv)


def _ct_weights(w: dict | None, group: str) -> WeightArgs:
    if not w:
        raise _refuse(f"config group {group} quantizes no weights")
    kind, bits, strategy = w.get("type", "int"), int(w.get("num_bits", 0)), w.get("strategy") or "tensor"
    label = f"{kind}{bits} weights, strategy {strategy} (config group {group})"
    if (kind, bits) not in (("int", 4), ("int", 8), ("float", 8)):
        raise _refuse(label)
    if w.get("dynamic") or w.get("actorder") not in (None, False, "static", "weight", "group"):
        raise _refuse(f"{label}{', dynamic' if w.get('dynamic') else ''}, actorder {w.get('actorder')!r}")
    if kind == "float" and not w.get("symmetric", True):
        raise _refuse(f"asymmetric {label}")
    if strategy == "group":
        if not w.get("group_size") or int(w["group_size"]) < 1:
            raise _refuse(f"{label} without a group_size")
        return WeightArgs(kind, bits, "group", group_size=int(w["group_size"]), symmetric=w.get("symmetric", True))
    if strategy == "block":
        block = w.get("block_structure")
        if kind != "float" or not block or len(block) != 2:
            raise _refuse(label)
        return WeightArgs(kind, bits, "block", block=(int(block[0]), int(block[1])))
    if strategy not in ("tensor", "channel"):
        raise _refuse(label)
    return WeightArgs(kind, bits, strategy, symmetric=w.get("symmetric", True))


def _ct_acts(a: dict | None, weights: WeightArgs, group: str) -> ActArgs | None:
    if not a:
        return None
    kind, bits, strategy = a.get("type", "int"), int(a.get("num_bits", 0)), a.get("strategy") or "tensor"
    dynamic = a.get("dynamic") in (True, "true", "local")
    label = (f"{kind}{bits} input activations ({'dynamic' if dynamic else 'static'} per {strategy}) with "
             f"{weights.type}{weights.bits} weights (config group {group})")
    if not a.get("symmetric", True) or bits != 8 or kind not in ("int", "float"):
        raise _refuse(label)
    if kind == "int":
        ok = weights.type == "int" and weights.bits == 8 and weights.strategy in ("channel", "tensor") \
            and weights.symmetric and (strategy == "token" and dynamic or strategy == "tensor" and not dynamic)
    else:
        ok = weights.type == "float" and (strategy == "token" and dynamic or strategy == "tensor"
                                          or strategy == "group" and dynamic and a.get("group_size"))
    if not ok:
        raise _refuse(label)
    if kind == "float" and strategy == "tensor" and dynamic:     # one scale for the whole batch: rows would mix
        raise _refuse(f"{label}: a batch-wide dynamic scale makes a row's result depend on its batch mates")
    return ActArgs(kind, strategy, dynamic, int(a["group_size"]) if strategy == "group" else None)


# ----------------------------------------------------------------------------- GPTQ, AWQ

def _gptq(qc: dict) -> ShippedQuant:
    bits, group = int(qc.get("bits", 0)), int(qc.get("group_size", -1))
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if qc.get("is_marlin_format") or fmt not in ("gptq", "gptq_v2"):
        raise _refuse(f"GPTQ checkpoint_format {fmt!r}" + (" (marlin pre-packed)" if qc.get("is_marlin_format") else ""))
    if bits not in (4, 8):
        raise _refuse(f"GPTQ {bits}-bit")
    sym = bool(qc.get("sym", True))
    weights = WeightArgs("int", bits, "channel" if group in (-1, 0) else "group",
                         group_size=None if group in (-1, 0) else group, symmetric=sym)
    scheme = ModuleScheme("gptq", weights, desc_act=bool(qc.get("desc_act", False)), zeros_minus_one=fmt == "gptq")
    ignore = tuple(qc.get("modules_to_not_convert") or ()) + ("lm_head", "re:.*mlp\\.gate$", "re:.*shared_expert_gate$")
    return ShippedQuant("gptq", ((("Linear",), scheme),), ignore)


def _awq(qc: dict) -> ShippedQuant:
    version = str(qc.get("version", "gemm")).lower()
    bits, group = int(qc.get("bits", qc.get("w_bit", 0))), int(qc.get("group_size", qc.get("q_group_size", 128)))
    if version != "gemm":
        raise _refuse(f"AWQ version {version!r} (only the GEMM layout loads)")
    if bits != 4:
        raise _refuse(f"AWQ {bits}-bit")
    if not qc.get("zero_point", True):
        raise _refuse("AWQ without zero points")
    weights = WeightArgs("int", 4, "group" if group > 0 else "channel", group_size=group if group > 0 else None,
                         symmetric=False)
    ignore = tuple(qc.get("modules_to_not_convert") or ()) + ("lm_head", "re:.*mlp\\.gate$", "re:.*shared_expert_gate$")
    return ShippedQuant("awq", ((("Linear",), ModuleScheme("awq", weights)),), ignore)
