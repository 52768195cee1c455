"""Tiny random quantized Hugging Face checkpoints in the formats users ship (a test helper).

    from quantized_checkpoints import make_compressed, make_gptq, make_awq, dequantized_state_dict

make_compressed(path, family, scheme, **sizes)
    compressed-tensors checkpoint (what llmcompressor writes), made with the compressed-tensors
    library alone: its preset scheme, apply_quantization_config, llmcompressor 0.14's default
    observers redone here (memoryless min-max weights; static min-max input activations
    calibrated with forward hooks over make_compressed.py's seeded token rows), then
    ModelCompressor: compress_model, save_pretrained, update_config. Writes config.json (with
    quantization_config), generation_config.json, model.safetensors, tokenizer files. Same tensor
    names, dtypes, shapes and values as tests/quantized/make_compressed.py (llmcompressor 0.14,
    compressed-tensors 0.19) writes, for every family x scheme except qwen3_moe FP8's
    input_scale values (llmcompressor calibrated that model with non-causal attention; see
    _calibrate_inputs).
make_gptq(path, family, bits=4, group_size=128, desc_act=False, sym=True, **sizes)
    GPTQ checkpoint laid out as GPTQModel / AutoGPTQ save it (checkpoint_format "gptq" = v1),
    quantized round-to-nearest min-max per group.
make_awq(path, family, group_size=128, modules_to_not_convert="default", **sizes)
    AWQ checkpoint laid out as AutoAWQ saves it (version "gemm"), round-to-nearest min-max.

make_gptq and make_awq also write <path>/reference/: a plain float32 checkpoint (config.json
without quantization_config, model.safetensors, tokenizer) whose quantized Linears hold
scale * (level - zero), computed from the integer levels before they were packed;
transformers loads it with no GPTQ / AWQ package. dequantized_state_dict(path) returns the
float32 tensors of any of the three kinds (compressed-tensors ones decompressed by
compressed-tensors' own compressors); save_reference(path) writes them as such a checkpoint.

family is one of FAMILIES (llama, qwen2, qwen3_moe); sizes override SIZES (and for qwen3_moe
MOE_SIZES), e.g. make_gptq(p, "llama", hidden_size=256). Every function returns Path(path).
Seeded (torch's global RNG state is left as it was): the same arguments give the same tensors.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import TINY_MODEL_VOCAB, TINY_VOCAB, save_tiny_tokenizer  # noqa: E402

# As tests/quantized/make_compressed.py: sizes where a group of 128 and a 128 x 128 block fit
# (k/v rows: 64, half a block)
SIZES = dict(vocab_size=TINY_MODEL_VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
             rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
MOE_SIZES = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True,
                 decoder_sparse_step=1, mlp_only_layers=[])
FAMILIES = {"llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
            "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
            "qwen3_moe": ("Qwen3MoeConfig", dict(MOE_SIZES, tie_word_embeddings=False))}
# llmcompressor's preset schemes as make_compressed.py uses them; FP8 (static per-tensor
# activation scale) is the one that calibrates
SCHEMES = ("W4A16", "W4A16_ASYM", "W8A16", "W8A8", "FP8", "FP8_DYNAMIC", "FP8_BLOCK")
IGNORE = {"llama": ["lm_head"], "qwen2": ["lm_head"], "qwen3_moe": ["lm_head", "re:.*mlp.gate$"]}
# make_compressed.py's calibration set: 8 rows of 48 tokens in [3, 320), torch.Generator seed 1
CALIBRATION_ROWS, CALIBRATION_LEN, CALIBRATION_SEED = 8, 48, 1


def model_config(family: str, **sizes):
    """The transformers config of a tiny `family` model (SIZES, MOE_SIZES, overridden by `sizes`)."""
    import transformers

    cls_name, extra = FAMILIES[family]
    return getattr(transformers, cls_name)(**{**SIZES, **extra, **sizes})


def random_model(family: str, **sizes):
    """make_compressed.py's random_model: seeded random weights (norms ~1, biases ~0, all off
    their constants), float32 init then cast to bfloat16 (the dtype users quantize from); the
    parameters equal those of the saved /tmp/ckpt/<family>-bf16 base."""
    import transformers

    cfg = model_config(family, **sizes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.ndim == 1:
                    p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
                else:
                    p.normal_(0.0, 0.08)
    # bfloat16 as the model comes back from a bf16 save + from_pretrained (where llmcompressor
    # starts): parameters cast, float32 buffers (RoPE inv_freq) left float32
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    model.to(torch.bfloat16)
    for name, buf in buffers.items():
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, buf)
    return model.eval()


def calibration_ids(vocab_size: int = TINY_MODEL_VOCAB) -> list[torch.Tensor]:
    """make_compressed.py's calibration rows, each a [1, 48] int64 tensor."""
    g = torch.Generator().manual_seed(CALIBRATION_SEED)
    high = min(TINY_VOCAB, vocab_size)
    return [torch.randint(3, high, (CALIBRATION_LEN,), generator=g)[None] for _ in range(CALIBRATION_ROWS)]


def _isolated(fn):
    """Run `fn` with torch on one thread and torch's global RNG state restored afterwards.
    These models are tiny: on a busy 2-core machine two OpenMP threads make each small
    matmul ~5x slower (one thread gives the same bits: checked against the llmcompressor
    reference); building Linears draws from the global RNG, which tests may rely on."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.random.fork_rng(devices=[]):
                return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(n)
    return wrapper


# --------------------------------------------------------------------------------------------
# MoE experts as separate Linear modules
# --------------------------------------------------------------------------------------------

class _ExpertMLP(torch.nn.Module):
    """One expert as gate_proj / up_proj / down_proj Linears (llmcompressor's
    modeling/moe/linear_experts.py ExpertMLPWithGate)."""

    def __init__(self, hidden: int, inter: int, act, dtype):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.up_proj = torch.nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.down_proj = torch.nn.Linear(inter, hidden, bias=False, dtype=dtype)
        self._act = act

    def forward(self, x):
        gate, up = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1).chunk(2, dim=-1)
        return self.down_proj(self._act(gate) * up)


class _LinearExperts(torch.nn.ModuleList):
    """Replaces transformers' fused Qwen3MoeExperts (gate_up_proj [E, 2I, H], down_proj
    [E, H, I]) by a ModuleList of _ExpertMLP, as llmcompressor's `linearize_moe` does before
    quantizing; state dict keys are then the checkpoint's mlp.experts.<e>.<proj>.weight.
    `calibrate_all` runs every expert on every token (llmcompressor's
    moe_calibrate_all_experts, its default) while keeping the routed output."""

    calibrate_all = False

    def __init__(self, fused):
        inter = fused.down_proj.shape[-1]
        dtype = fused.down_proj.dtype
        experts = []
        for e in range(fused.gate_up_proj.shape[0]):
            mlp = _ExpertMLP(fused.gate_up_proj.shape[-1], inter, fused.act_fn, dtype)
            with torch.no_grad():
                mlp.gate_proj.weight.copy_(fused.gate_up_proj[e, :inter])
                mlp.up_proj.weight.copy_(fused.gate_up_proj[e, inter:])
                mlp.down_proj.weight.copy_(fused.down_proj[e])
            experts.append(mlp)
        super().__init__(experts)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        # llmcompressor's LinearExperts2D.forward: expert e adds its weighted output into the
        # routed tokens' rows in order e = 0, 1, ... (index_add_); done here as dense adds of
        # zero-padded contributions (the same roundings; bf16 index_add_ is slow on CPU)
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = torch.nn.functional.one_hot(top_k_index, len(self)).permute(2, 1, 0)
        for e, expert in enumerate(self):
            pos, tokens = torch.where(mask[e])
            y = expert(hidden_states)[tokens] if self.calibrate_all else expert(hidden_states[tokens])
            contrib = torch.zeros_like(out)
            contrib[tokens] = (y * top_k_weights[tokens, pos, None]).to(out.dtype)
            out = out + contrib
        return out


def _linearize_moe(model) -> None:
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("Experts") and hasattr(module, "gate_up_proj"):
            model.set_submodule(name, _LinearExperts(module))


# --------------------------------------------------------------------------------------------
# compressed-tensors
# --------------------------------------------------------------------------------------------

def _scheme(scheme: str):
    """The preset scheme with the observer fields llmcompressor's QuantizationModifier writes
    (modifiers/quantization/quantization/mixin.py _apply_observer_overrides): weights
    memoryless_minmax; static activations keep the preset's (FP8: static_minmax) else minmax;
    dynamic activations none."""
    from compressed_tensors.quantization import preset_name_to_scheme

    s = preset_name_to_scheme(scheme, ["Linear"])
    for args, default in ((s.weights, "memoryless_minmax"), (s.input_activations, "minmax"),
                          (s.output_activations, "minmax")):
        if args is None or ("observer" in args.model_fields_set and args.observer is not None):
            continue
        args.observer = None if args.dynamic is True else default
    return s


def _flatten_weight(w: torch.Tensor, args) -> torch.Tensor:
    """llmcompressor's observers/helpers.py _flatten_weight: the weight as
    (1, *qparam_shape, elements per qparam)."""
    from compressed_tensors.quantization import QuantizationStrategy as S
    from compressed_tensors.quantization.utils import maybe_pad_tensor_for_block_quant

    if args.strategy == S.TENSOR:
        return w.reshape(1, 1, -1)
    if args.strategy == S.CHANNEL:
        return w.unsqueeze(-2).unsqueeze(0)
    if args.strategy in (S.GROUP, S.TENSOR_GROUP):
        return w.unflatten(-1, (-1, args.group_size)).unsqueeze(0)
    if args.strategy == S.BLOCK:
        bh, bw = args.block_structure
        w = maybe_pad_tensor_for_block_quant(w, args.block_structure)
        rows, cols = w.shape
        return w.reshape(rows // bh, bh, cols // bw, bw).transpose(1, 2).flatten(-2, -1).unsqueeze(0)
    raise ValueError(f"weight strategy {args.strategy}")


def _min_max(observed: torch.Tensor):
    # llmcompressor's observers/min_max.py _get_min_max
    return torch.amin(observed, dim=(0, -1)), torch.amax(observed, dim=(0, -1))


def _set_qparams(module, base: str, min_vals, max_vals, args) -> None:
    from compressed_tensors.quantization.utils import calculate_qparams
    from compressed_tensors.utils import update_offload_parameter

    scale, zero_point = calculate_qparams(min_vals=min_vals, max_vals=max_vals, quantization_args=args)
    update_offload_parameter(module, f"{base}_scale", scale)
    if hasattr(module, f"{base}_zero_point"):
        update_offload_parameter(module, f"{base}_zero_point", zero_point)


def _calibrate_inputs(model, modules: dict, vocab_size: int) -> None:
    """Static input-activation qparams (llmcompressor's static_minmax observer: running min and
    max over every calibration token), from forward pre-hooks during float forwards of the
    calibration rows, one row per batch, eager attention, MoE experts seeing every token
    (as llmcompressor's sequential pipeline runs them: quantization disabled). Attention is
    causal. llmcompressor 0.14 calibrated qwen3_moe without the causal mask (its traced
    graph attends both ways): with a zero mask instead, the qwen3_moe FP8 input_scales here
    equal the reference's bit for bit; llama / qwen2 match as they are."""
    stats: dict[str, tuple] = {}

    def hook(name, args):
        def pre(module, inputs):
            x = inputs[0]
            lo, hi = _min_max(x.reshape(-1, 1, x.shape[-1]))   # per-tensor: (tokens, 1, hidden)
            if name in stats:
                lo, hi = torch.minimum(lo, stats[name][0]), torch.maximum(hi, stats[name][1])
            stats[name] = (lo, hi)
        return pre

    from compressed_tensors.quantization import QuantizationStrategy

    handles = []
    for name, module in modules.items():
        args = module.quantization_scheme.input_activations
        if args is not None and args.dynamic is False:
            if args.strategy != QuantizationStrategy.TENSOR:
                raise NotImplementedError(f"static {args.strategy} activations")
            handles.append(module.register_forward_pre_hook(hook(name, args)))
    if not handles:
        return
    impl = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    _LinearExperts.calibrate_all = True
    try:
        with torch.no_grad():
            for ids in calibration_ids(vocab_size):
                model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    finally:
        _LinearExperts.calibrate_all = False
        model.config._attn_implementation = impl
        for h in handles:
            h.remove()
    for name, (lo, hi) in stats.items():
        module = modules[name]
        _set_qparams(module, "input", lo, hi, module.quantization_scheme.input_activations)


@_isolated
def make_compressed(path, family: str, scheme: str, **sizes) -> Path:
    """A tiny random `family` model quantized with compressed-tensors' preset `scheme` (one of
    SCHEMES) and saved compressed, as make_compressed.py's llmcompressor oneshot does: targets
    Linear, ignore IGNORE[family] (lm_head; the MoE router), qwen3_moe experts as separate
    Linears (mlp.experts.<e>.<proj>). Writes config.json (quantization_config from
    ModelCompressor.update_config), generation_config.json, model.safetensors, tokenizer."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationStatus,
                                                 apply_quantization_config, disable_quantization)

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = random_model(family, **sizes)
    _linearize_moe(model)
    config = QuantizationConfig(config_groups={"group_0": _scheme(scheme)}, ignore=IGNORE[family],
                                quantization_status=QuantizationStatus.INITIALIZED)
    apply_quantization_config(model, config, show_progress=False)
    model.apply(disable_quantization)      # calibration forwards are float
    modules = {n: m for n, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None}
    _calibrate_inputs(model, modules, model.config.vocab_size)
    for module in modules.values():        # memoryless min-max over the weight, per strategy
        args = module.quantization_scheme.weights
        _set_qparams(module, "weight", *_min_max(_flatten_weight(module.weight.data, args)), args)
        module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(str(path))
    compressor.update_config(str(path))
    save_tiny_tokenizer(path)
    return path


# --------------------------------------------------------------------------------------------
# GPTQ and AWQ: packed int32 layouts written here (their packers need CUDA-era stacks that
# cannot live in the test environment: GPTQModel pins torch>=2.14 and pulls CUDA wheels,
# AutoAWQ is archived and pins nothing it still runs with), quantized round-to-nearest
# min-max per group: no calibration, no activation-aware scaling. Byte-checked against
# GPTQModel 7.7.0's pack_original + v2->v1 export and AutoAWQ 0.2.9's WQLinear_GEMM.from_linear.
# --------------------------------------------------------------------------------------------

# AutoAWQ awq/modules/linear/gemm.py WQLinear_GEMM.from_linear: eight 4-bit values per int32,
# word nibble i holding column 8*c + AWQ_ORDER[i] (undone by awq/utils/packing_utils.py
# AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7])
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _quant_targets(model) -> list[tuple[str, torch.nn.Linear]]:
    """The Linears GPTQModel / AutoAWQ quantize: every Linear inside the decoder layers
    (attention, MLP, each MoE expert), not lm_head, not the MoE router (mlp.gate)."""
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and ".layers." in f".{n}" and not n.endswith("mlp.gate")]


def _pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] ints in [0, 2**bits) -> int32 [R*bits/32, C]: word r holds rows r*f .. r*f+f-1,
    row r*f+j at bits j*bits.. (low bits first). GPTQModel nn_modules/qlinear/__init__.py
    pack_original (AutoGPTQ's pack) for qweight."""
    f = 32 // bits
    q = q.to(torch.int64).reshape(q.shape[0] // f, f, q.shape[1])
    shifts = (torch.arange(f, dtype=torch.int64) * bits)[None, :, None]
    return _to_int32((q << shifts).sum(1))


def _pack_cols(q: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """[R, C] ints -> int32 [R, C*bits/32]: word c holds columns c*f + order[j] at bits
    j*bits.. (low bits first). GPTQ qzeros (order = identity); AWQ qweight / qzeros
    (order = AWQ_ORDER)."""
    f = 32 // bits
    q = q.to(torch.int64).reshape(q.shape[0], q.shape[1] // f, f)
    if order is not None:
        q = q[..., list(order)]
    shifts = (torch.arange(f, dtype=torch.int64) * bits)[None, None, :]
    return _to_int32((q << shifts).sum(-1))


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 bit patterns held in int64 -> int32 with the same bits."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _gptq_quantize(w: torch.Tensor, bits: int, group_size: int, desc_act: bool, sym: bool,
                   generator: torch.Generator):
    """Round-to-nearest GPTQ levels for one weight w [N, K] (float32).

    Scale and zero per (output row, group) as GPTQ's quantizer (GPTQModel
    quantization/quantizer.py Quantizer.find_params, from AutoGPTQ / the GPTQ paper code):
    xmin = min(x.min, 0), xmax = max(x.max, 0); sym: xmax = max(|xmin|, xmax), xmin = -xmax
    where xmin < 0; both 0 -> -1, +1; scale = (xmax - xmin) / maxq; zero = (maxq + 1) / 2 if
    sym else round(-xmin / scale); q = clamp(round(x / scale) + zero, 0, maxq).
    desc_act: columns visited in order perm = argsort(hessian diagonal, descending) (here a
    seeded random diagonal), groups are runs of group_size columns in that order, and
    g_idx[perm[i]] = i // group_size (GPTQ's `g_idx = [i // groupsize ...][invperm]`).
    Returns q int64 [N, K], scale float32 [N, G], zero int64 [N, G], g_idx int32 [K]."""
    n, k = w.shape
    g = k if group_size == -1 else group_size
    if k % g:
        raise ValueError(f"in_features {k} not a multiple of group_size {g}")
    maxq = 2**bits - 1
    perm = (torch.argsort(torch.rand(k, generator=generator), descending=True) if desc_act
            else torch.arange(k))
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // g).to(torch.int32)
    x = w[:, perm].reshape(n, k // g, g)
    xmin = torch.clamp(x.amin(-1), max=0)
    xmax = torch.clamp(x.amax(-1), min=0)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    both0 = (xmin == 0) & (xmax == 0)
    xmin, xmax = torch.where(both0, -1.0, xmin), torch.where(both0, 1.0, xmax)
    scale = (xmax - xmin) / maxq
    zero = torch.full_like(scale, (maxq + 1) // 2) if sym else torch.round(-xmin / scale)
    qp = torch.clamp(torch.round(x / scale[..., None]) + zero[..., None], 0, maxq).reshape(n, k)
    q = torch.empty_like(qp)
    q[:, perm] = qp
    return q.to(torch.int64), scale, zero.to(torch.int64), g_idx


def _awq_quantize(w: torch.Tensor, group_size: int):
    """Round-to-nearest AWQ levels for w [N, K] (float32), AutoAWQ awq/quantize/quantizer.py
    pseudo_quantize_tensor with zero_point=True, w_bit=4: per (row, group) of consecutive
    columns scale = clamp(max - min, 1e-5) / 15, zero = clamp(-round(min / scale), 0, 15),
    q = clamp(round(w / scale) + zero, 0, 15). Returns q int64 [N, K], scale float32
    [N, G], zero int64 [N, G]."""
    n, k = w.shape
    g = k if group_size == -1 else group_size
    if k % g:
        raise ValueError(f"in_features {k} not a multiple of group_size {g}")
    x = w.reshape(n, k // g, g)
    mx, mn = x.amax(-1), x.amin(-1)
    scale = torch.clamp(mx - mn, min=1e-5) / 15
    zero = torch.clamp(-torch.round(mn / scale), 0, 15)
    q = torch.clamp(torch.round(x / scale[..., None]) + zero[..., None], 0, 15).reshape(n, k)
    return q.to(torch.int64), scale, zero.to(torch.int64)


def _write_packed(path: Path, model, packed: dict, dequant: dict, quantization_config: dict,
                  dtype: torch.dtype, extra_files: dict | None = None) -> Path:
    """config.json (+ quantization_config), generation_config.json, model.safetensors (the
    packed tensors in `packed`, every other tensor of the model in `dtype`), tokenizer; and
    reference/ with the same config minus quantization_config, every tensor float32, the
    quantized Linears' weights from `dequant`."""
    import copy

    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    quantized = {name.rsplit(".", 1)[0] for name in packed}
    plain, reference = {}, {}
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    for name, t in model.state_dict().items():
        if name in tied or name.rsplit(".", 1)[0] in quantized:
            continue
        plain[name] = t.to(dtype).contiguous()
        reference[name] = plain[name].float()
    for name, t in packed.items():
        if name.endswith(".bias"):
            reference[name] = t.float()
    save_file({**plain, **packed}, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = copy.deepcopy(model.config)
    cfg.architectures = [type(model).__name__]
    cfg.dtype = dtype
    cfg.quantization_config = quantization_config
    cfg.save_pretrained(str(path))
    model.generation_config.save_pretrained(str(path))
    save_tiny_tokenizer(path)
    for name, content in (extra_files or {}).items():
        (path / name).write_text(content)

    ref = path / "reference"
    ref.mkdir(exist_ok=True)
    save_file({**reference, **{k: v.contiguous() for k, v in dequant.items()}}, str(ref / "model.safetensors"),
              metadata={"format": "pt"})
    cfg = copy.deepcopy(model.config)
    cfg.architectures = [type(model).__name__]
    cfg.dtype = torch.float32
    cfg.save_pretrained(str(ref))
    model.generation_config.save_pretrained(str(ref))
    save_tiny_tokenizer(ref)
    return path


def gptq_quantization_config(bits: int = 4, group_size: int = 128, desc_act: bool = False,
                             sym: bool = True) -> dict:
    """config.json's quantization_config (also quantize_config.json) as GPTQModel 7.7.0 writes
    it with checkpoint_format "gptq" (v1; AutoGPTQ's and optimum's format, the one
    transformers / vLLM / TGI read), its `meta` block minus the run's offload_to_disk_path.
    GPTQModel's default act_group_aware is on only without desc_act."""
    return {
        "bits": bits, "group_size": group_size, "desc_act": desc_act, "lm_head": False,
        "method": "gptq", "quant_method": "gptq", "format": "gptq", "checkpoint_format": "gptq",
        "pack_dtype": "int32",
        "meta": {"quantizer": ["gptqmodel:7.7.0"], "uri": "https://github.com/modelcloud/gptqmodel",
                 "damp_percent": 0.05, "damp_auto_increment": 0.01, "static_groups": False,
                 "true_sequential": True, "mse": 0.0, "gptaq": None, "foem": None,
                 "act_group_aware": not desc_act,
                 "fallback": {"strategy": "rtn", "threshold": "0.5%", "smooth": None},
                 "offload_to_disk": True, "telemetry": {"device": False}, "pack_impl": "auto",
                 "gc_mode": "interval", "wait_for_submodule_finalizers": False,
                 "auto_forward_data_parallel": True, "dense_vram_strategy": "exclusive",
                 "dense_vram_strategy_devices": None, "moe_vram_strategy": "exclusive",
                 "moe_vram_strategy_devices": None, "mock_quantization": False,
                 "hessian": {"chunk_size": None, "chunk_bytes": None, "staging_dtype": "float32",
                             "dedup_shared_inputs": True}},
        "sym": sym,
    }


@_isolated
def make_gptq(path, family: str, bits: int = 4, group_size: int = 128, desc_act: bool = False,
              sym: bool = True, **sizes) -> Path:
    """A tiny random `family` model as a GPTQ checkpoint, checkpoint_format "gptq" (v1), as
    GPTQModel / AutoGPTQ save it: for each quantized Linear (out N, in K, G = group_size or K
    when -1, f = 32 // bits; bits in 2, 4, 8):
      qweight int32 [K/f, N]   levels q[n, k] packed along K: word (r, n) holds k = r*f + j at
                               bits j*bits (low bits first)
      qzeros  int32 [K/G, N/f] zero points packed along N the same way (word (g, c) holds
                               n = c*f + j), stored v1: the packed word minus 0x11111111
                               (4-bit; 0x01010101 8-bit, 0x55555555 2-bit) = zero - 1 per field
                               (zeros here are >= 1); sym: zero = 2**(bits-1) (0x77777777)
      scales  float16 [K/G, N]
      g_idx   int32 [K]        group of each input column: k // G; desc_act: a permutation
                               (see _gptq_quantize), not monotonic
      bias    float16 [N]      where the Linear has one (qwen2 q/k/v)
    weight[n, k] = scales[g_idx[k], n] * (q[n, k] - zero[g_idx[k], n]). Other tensors bf16
    (GPTQModel keeps the model's dtype); lm_head, embeddings, norms, MoE router unquantized.
    Also writes quantize_config.json and reference/ (float32, dequantized from the levels)."""
    if bits not in (2, 4, 8):
        raise ValueError("bits must be 2, 4 or 8")
    path = Path(path)
    model = random_model(family, **sizes)
    _linearize_moe(model)
    gen = torch.Generator().manual_seed(1234)
    packed, dequant = {}, {}
    with torch.no_grad():
        for name, lin in _quant_targets(model):
            w = lin.weight.float()
            q, scale, zero, g_idx = _gptq_quantize(w, bits, group_size, desc_act, sym, gen)
            scales16 = scale.to(torch.float16)
            gi = g_idx.long()
            dequant[f"{name}.weight"] = scales16.float()[:, gi] * (q - zero[:, gi]).float()
            step = sum(1 << (bits * j) for j in range(32 // bits))   # 0x11111111 for 4-bit
            packed[f"{name}.qweight"] = _pack_rows(q.T.contiguous(), bits)
            packed[f"{name}.qzeros"] = _to_int32(_pack_cols(zero.T.contiguous(), bits).to(torch.int64) - step)
            packed[f"{name}.scales"] = scales16.T.contiguous()
            packed[f"{name}.g_idx"] = g_idx
            if lin.bias is not None:
                packed[f"{name}.bias"] = lin.bias.to(torch.float16)
    qcfg = gptq_quantization_config(bits, group_size, desc_act, sym)
    return _write_packed(path, model, packed, dequant, qcfg, torch.bfloat16,
                         {"quantize_config.json": json.dumps(qcfg, indent=2)})


def awq_quantization_config(group_size: int = 128, modules_to_not_convert=None) -> dict:
    """config.json's quantization_config as AutoAWQ 0.2.9 writes it (AwqConfig.to_transformers_dict)."""
    return {"quant_method": "awq", "zero_point": True, "group_size": group_size, "bits": 4,
            "version": "gemm", "modules_to_not_convert": modules_to_not_convert}


@_isolated
def make_awq(path, family: str, group_size: int = 128, modules_to_not_convert="default", **sizes) -> Path:
    """A tiny random `family` model as an AWQ checkpoint as AutoAWQ saves it (version "gemm",
    4-bit, zero_point): for each quantized Linear (out N, in K, G = group_size or K when -1):
      qweight int32 [K, N/8]   levels q[n, k] transposed and packed along N: word (k, c) holds
                               n = 8*c + AWQ_ORDER[j] at bits 4*j, AWQ_ORDER = 0 2 4 6 1 3 5 7
      qzeros  int32 [K/G, N/8] zero points (0..15, no offset) packed the same way
      scales  float16 [K/G, N]
      bias    float16 [N]      where the Linear has one
    weight[n, k] = scales[k // G, n] * (q[n, k] - zero[k // G, n]). Other tensors float16
    (AutoAWQ loads and saves the model in float16). modules_to_not_convert: AutoAWQ writes
    null for llama / qwen2; "default" gives that, and ["mlp.gate"] for qwen3_moe (its
    router; AutoAWQ, vLLM match it as a substring, transformers as a dotted prefix/suffix,
    so "gate" alone would also hit gate_proj). Also writes reference/ (float32, dequantized
    from the levels)."""
    path = Path(path)
    if modules_to_not_convert == "default":
        modules_to_not_convert = ["mlp.gate"] if family == "qwen3_moe" else None
    model = random_model(family, **sizes)
    _linearize_moe(model)
    packed, dequant = {}, {}
    with torch.no_grad():
        for name, lin in _quant_targets(model):
            w = lin.weight.float()
            if w.shape[0] % 8:
                raise ValueError(f"{name}: out_features {w.shape[0]} not a multiple of 8")
            q, scale, zero = _awq_quantize(w, group_size)
            scales16 = scale.to(torch.float16)
            g = w.shape[1] // scale.shape[1]
            dequant[f"{name}.weight"] = (scales16.float().repeat_interleave(g, 1) *
                                         (q - zero.repeat_interleave(g, 1)).float())
            packed[f"{name}.qweight"] = _pack_cols(q.T.contiguous(), 4, AWQ_ORDER)
            packed[f"{name}.qzeros"] = _pack_cols(zero.T.contiguous(), 4, AWQ_ORDER)
            packed[f"{name}.scales"] = scales16.T.contiguous()
            if lin.bias is not None:
                packed[f"{name}.bias"] = lin.bias.to(torch.float16)
    return _write_packed(path, model, packed, dequant, awq_quantization_config(group_size, modules_to_not_convert),
                         torch.float16)


# --------------------------------------------------------------------------------------------
# float references
# --------------------------------------------------------------------------------------------

def dequantized_state_dict(path) -> dict[str, torch.Tensor]:
    """The float32 tensors of the checkpoint at `path` under its own (checkpoint) names, each
    quantized Linear as `<module>.weight` (activation scales dropped).
    GPTQ / AWQ: <path>/reference/model.safetensors, computed from the integer levels before
    packing. compressed-tensors: each module decompressed by compressed-tensors' own
    compressor for its format (the one transformers uses on load)."""
    from safetensors.torch import load_file

    path = Path(path)
    qcfg = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
    if qcfg.get("quant_method") in ("gptq", "awq"):
        return load_file(str(path / "reference" / "model.safetensors"))
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    if qcfg.get("quant_method") != "compressed-tensors":
        return {k: v.float() for k, v in tensors.items()}

    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils import match_name

    config = QuantizationConfig.model_validate(qcfg)
    groups = list(config.config_groups.values())
    params = ("weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_shape",
              "weight_g_idx", "weight_global_scale")
    modules = {k.rsplit(".", 1)[0] for k in tensors if k.endswith((".weight_scale", ".weight_packed"))}
    out = {}
    for module in sorted(modules):
        scheme = next((s for s in groups if any(match_name(module, t) for t in s.targets)), None)
        if scheme is None or len(groups) == 1:   # class targets ("Linear"): no names to match
            scheme = groups[0]
        local = {p: tensors.pop(f"{module}.{p}") for p in params if f"{module}.{p}" in tensors}
        # scales in float32 first, as transformers casts them on load with dtype=float32: the float
        # weight is then the exact product, not one rounded to the checkpoint's bfloat16
        local = {p: t.float() if p.endswith("scale") else t for p, t in local.items()}
        fmt = scheme.format or config.format
        dense = BaseCompressor.get_value_from_registry(fmt).decompress(local, scheme)
        out[f"{module}.weight"] = dense["weight"].float()
        for suffix in ("input_scale", "input_zero_point", "output_scale", "output_zero_point"):
            tensors.pop(f"{module}.{suffix}", None)
    out.update({k: v.float() for k, v in tensors.items()})
    return out


def save_reference(path, out=None) -> Path:
    """Writes dequantized_state_dict(path) as a plain float32 checkpoint (config.json without
    quantization_config, model.safetensors, tokenizer) to `out` (default <path>/reference) and
    returns it; GPTQ / AWQ checkpoints already have theirs."""
    from safetensors.torch import save_file

    path = Path(path)
    out = Path(out) if out is not None else path / "reference"
    if (out / "model.safetensors").is_file() and out == path / "reference":
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    tensors = dequantized_state_dict(path)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    save_tiny_tokenizer(out)
    return out
