"""SmoothQuant for w8a8: move activation outliers into the weights before quantizing both.

Per-token int8 activations lose the small channels of a token that has a few huge ones, and
RMSNorm outputs have such channels (the norm weight amplifies fixed channels). For each
decoder linear we take, per input channel j, the activations' max |x_j| over a short
calibration text and the weights' max |W[:, j]|, and choose

    t_j = max|x_j|^alpha / max|W[:, j]|^(1 - alpha)              (alpha = 0.5)

then divide the input by t and multiply the weight's columns by t. The division is folded
into whatever produces the input, so the float model computes the same function and the
quantized model pays nothing at run time:

    linear          its input is                     1 / t folded into
    qkv_proj        input_layernorm(x)               input_layernorm.weight
    gate_up_proj    post_attention_layernorm(x)      post_attention_layernorm.weight
    down_proj       silu(gate) * up                  the up rows of gate_up_proj
    o_proj          attention output, linear in v    the v rows of qkv_proj; with grouped-query
                                                     attention a v channel feeds one channel of
                                                     each query head in its group, so t is shared
                                                     across the group (max of the group's stats)

The lm_head is left alone: it is tied to the embedding in the default model, and smoothing it
(into the final norm, with its own int8 copy) measured no better: perplexity 31.05 against 31.11.
Reference: Xiao et al., SmoothQuant (2022).
"""
from __future__ import annotations

import torch
from torch import nn

ALPHA = 0.5
CALIBRATION_TOKENS = 256
# A mix of prose, a chat turn and code; it only sets per-channel ranges, so a few hundred tokens do.
CALIBRATION_TEXT = """\
<|im_start|>system
You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
<|im_start|>user
Can you explain why the sky is blue, and give me a short Python example that sorts a list of words by length?<|im_end|>
<|im_start|>assistant
The sky looks blue because air molecules scatter short wavelengths of sunlight much more strongly than long ones, \
so blue light reaches our eyes from every direction. At sunrise and sunset the light travels through more air, \
the blue is scattered away, and the reds and oranges remain.

Here is the Python example:

```python
words = ["banana", "fig", "cherry", "kiwi"]
by_length = sorted(words, key=len)
print(by_length)  # ['fig', 'kiwi', 'banana', 'cherry']
```<|im_end|>
Report for the quarter: revenue grew 12% to $4.3 million, while costs fell slightly. The committee met on \
March 3, 2024, and approved the budget (7 votes to 2). Next steps: hire two engineers, renew the lease, and \
review the 2025 plan by June 30.
"""


def calibration_ids(tokenizer, n: int = CALIBRATION_TOKENS) -> list[int]:
    return list(tokenizer.encode(CALIBRATION_TEXT))[:n]


@torch.no_grad()
def input_amax(model: nn.Module, token_ids: list[int]) -> dict[str, torch.Tensor]:
    """Max |x| per input channel of every decoder linear over one prefill of token_ids (float model).
    Keys like "layers.3.mlp.down_proj"; values float32 [in_features]."""
    from jobrunner.kernels.ops import AttentionMetadata

    cfg = model.config
    device = model.norm.weight.device
    dtype = model.norm.weight.dtype
    bs, t = 16, len(token_ids)
    blocks = -(-t // bs)
    caches = [(torch.zeros(blocks, bs, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device),
               torch.zeros(blocks, bs, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device))
              for _ in range(cfg.num_layers)]
    meta = AttentionMetadata.build(bs, 0, [t], [t], list(range(t)), [list(range(blocks))], device,
                                   cfg.sliding_window)
    stats: dict[str, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for name, mod in (("self_attn.qkv_proj", attn.qkv_proj), ("self_attn.o_proj", attn.o_proj),
                          ("mlp.gate_up_proj", mlp.gate_up_proj), ("mlp.down_proj", mlp.down_proj)):
            key = f"layers.{i}.{name}"

            def hook(_m, args, key=key):
                stats[key] = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0).float()
            hooks.append(mod.register_forward_pre_hook(hook))
    try:
        ids = torch.tensor(token_ids, device=device)
        model(ids, torch.arange(t, device=device), caches, meta)
    finally:
        for h in hooks:
            h.remove()
    return stats


def _factor(x_amax: torch.Tensor, w_amax: torch.Tensor, alpha: float) -> torch.Tensor:
    t = x_amax.clamp(min=1e-5).pow(alpha) / w_amax.clamp(min=1e-5).pow(1 - alpha)
    return t.clamp(min=1e-5)


def applies_to(model: nn.Module) -> bool:
    """The factors fold into the RMSNorm before qkv_proj (input_layernorm) and the one before gate_up_proj
    (post_attention_layernorm): Llama's layer (Qwen, Phi-3 and Granite use it). Gemma's (1 + weight)
    sandwich norms and OLMo 2's post-norms have no such norm: those models quantize unsmoothed."""
    from jobrunner.engine.models.llama import LlamaDecoderLayer
    return all(isinstance(layer, LlamaDecoderLayer) for layer in model.layers)


@torch.no_grad()
def smooth_model(model: nn.Module, stats: dict[str, torch.Tensor], alpha: float = ALPHA) -> None:
    """Folds SmoothQuant factors into the float model in place (see the module doc): same function,
    activations with flatter channel ranges. Call before quantizing the linears."""
    cfg = model.config
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    group = cfg.num_heads // cfg.num_kv_heads
    inter = cfg.intermediate_size
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        qkv, o, gu, down = attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight

        # qkv_proj <- input_layernorm
        t = _factor(stats[f"layers.{i}.self_attn.qkv_proj"], qkv.abs().amax(0).float(), alpha).to(qkv.dtype)
        layer.input_layernorm.weight.div_(t)
        qkv.mul_(t)

        # gate_up_proj <- post_attention_layernorm
        t = _factor(stats[f"layers.{i}.mlp.gate_up_proj"], gu.abs().amax(0).float(), alpha).to(gu.dtype)
        layer.post_attention_layernorm.weight.div_(t)
        gu.mul_(t)

        # down_proj <- the up half of gate_up_proj (rows inter..2*inter)
        t = _factor(stats[f"layers.{i}.mlp.down_proj"], down.abs().amax(0).float(), alpha).to(down.dtype)
        gu[inter:].div_(t[:, None])
        down.mul_(t)

        # o_proj <- v rows of qkv_proj; one factor per (kv head, dim), shared by the query heads of its group
        x = stats[f"layers.{i}.self_attn.o_proj"].view(cfg.num_kv_heads, group, cfg.head_dim).amax(1)
        w = o.abs().amax(0).float().view(cfg.num_kv_heads, group, cfg.head_dim).amax(1)
        t = _factor(x, w, alpha).to(o.dtype)                                        # [Hk, D]
        v = slice(q_size + kv_size, q_size + 2 * kv_size)
        qkv[v].div_(t.reshape(-1, 1))
        if attn.qkv_proj.bias is not None:
            attn.qkv_proj.bias[v].div_(t.reshape(-1))
        o.mul_(t[:, None, :].expand(-1, group, -1).reshape(1, -1))

