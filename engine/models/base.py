"""CausalLM: what every decoder family shares around its layers, and HF weight names -> our parameters.

    input_ids [T] -> embed (x embedding_multiplier) -> layers (a family's `layer_class`) -> norm -> hidden [T, hidden]
    hidden [N, hidden] (only the rows sampled or scored) -> lm_head -> logits [N, vocab] float32
                                                 (/ logits_scaling, then soft-capped, where the family says)

Parameter names are HF's without the "model." prefix, except the fused projections (FUSED_SHARDS).

Under tensor parallelism (engine/parallel) embed_tokens and lm_head hold this rank's rows of the
vocabulary: an embedding is looked up where its row lives and summed over the ranks; logits are
gathered from all ranks' rows.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from jobrunner.engine.config.model_config import ModelConfig
from jobrunner.engine.models.layers import RMSNorm, Rotary
from jobrunner.engine.parallel.group import current as current_group
from jobrunner.engine.parallel.shards import ShardPlan
from jobrunner.kernels.ops import AttentionMetadata


class CausalLM(nn.Module):
    """A decoder-only LM. Subclasses (one per family) set `layer_class`: built as layer_class(cfg, layer_idx),
    called as layer(x, residual, cos, sin, kv_cache, meta) -> (x, residual)."""
    layer_class: type[nn.Module]
    # HF checkpoint name piece -> (our fused parameter, shard index); engine/quant/apply.py maps GGUF blocks by it
    FUSED_SHARDS = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.tp = current_group()
        self.shards = ShardPlan(cfg, self.tp)
        vocab = self.shards.vocab_part if self.tp.size > 1 else cfg.vocab_size
        self.embed_tokens = nn.Embedding(vocab, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(cfg)

    def init_buffers(self) -> None:
        """Recompute what no checkpoint holds (the rotary frequencies, float32), after a build on the
        meta device and materialization (engine.runtime)."""
        self.rotary.inv_freq = self.rotary.frequencies().to(self.rotary.inv_freq.device)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states before the final norm's output projection: [T, hidden]."""
        return self.run_layers(self.embed(input_ids), positions, kv_caches, meta)

    def run_layers(self, x: torch.Tensor, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        """The layer stack and the final norm over embeddings x [T, hidden]."""
        cos, sin = self.rotary(positions, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, kv_cache, meta)
        x, _ = self.norm(x, residual)
        return x

    def embed(self, input_ids) -> torch.Tensor:
        """[T] -> [T, hidden], times cfg.embedding_multiplier rounded to the model's dtype first (as HF's
        Gemma does: sqrt(3584) is 60 in bfloat16; Granite's multipliers are exact there)."""
        x = self._lookup(input_ids)
        m = self.config.embedding_multiplier
        return x if m == 1.0 else x * float(torch.tensor(m, dtype=x.dtype))

    def _lookup(self, input_ids) -> torch.Tensor:
        if self.tp.size == 1:
            return self.embed_tokens(input_ids)
        local = input_ids - self.shards.vocab_start
        mine = (local >= 0) & (local < self.shards.vocab_part)
        x = self.embed_tokens(torch.where(mine, local, 0))
        return self.tp.all_reduce(x * mine[:, None].to(x.dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Only for the rows that are sampled or scored: [N, hidden] -> [N, vocab] float32
        (divided by cfg.logits_scaling, then soft-capped by cfg.final_logit_softcapping, when set).
        Tensor-parallel: a collective, so every rank calls it for the same rows."""
        logits = self.lm_head(hidden).float()
        cfg = self.config
        if self.tp.size > 1:
            logits = self.tp.all_gather(logits)[:, :cfg.vocab_size]
        if cfg.logits_scaling != 1.0:
            logits = logits / cfg.logits_scaling
        if cfg.final_logit_softcapping:
            logits = torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
        return logits

    # --- weights -------------------------------------------------------------------------

    def _shard_sizes(self) -> dict[str, list[int]]:
        """Our fused parameter -> the rows of each HF tensor in it, in shard order. gate_up_proj's
        halves are read off the parameter itself (an MoE's shared expert has its own size)."""
        cfg, shards = self.config, self.shards
        q, kv = shards.heads * cfg.head_dim, shards.kv_heads * cfg.head_dim
        return {"qkv_proj": [q, kv, kv], "gate_up_proj": [shards.width(cfg.intermediate_size)] * 2}

    _VOCAB_ROWS = ("embed_tokens.weight", "lm_head.weight")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     layer_done: Callable[[int], None] | None = None) -> set[str]:
        """Copies HF-named tensors in, one at a time; returns the names of parameters filled
        (a fused parameter's shards as "<name>#<shard>"). layer_done(i), where given, runs as soon as decoder
        layer i has every weight (to quantize it before the next layers' float weights are read: the float
        copies of a quantized model then never exist all at once)."""
        params, shard_sizes = dict(self.named_parameters()), self._shard_sizes()
        waiting = self._layer_weight_names() if layer_done is not None else {}
        filled: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            done = self._fill_one(name, tensor, params, shard_sizes)
            filled |= done
            layer = _layer_of(name)
            if layer in waiting:
                waiting[layer] -= done
                if not waiting[layer]:
                    del waiting[layer]
                    for n in [n for n in params if _layer_of(n) == layer]:
                        del params[n]           # this dict holds no float weight the callback replaces
                    layer_done(layer)
        return filled

    def _fill_one(self, name: str, tensor: torch.Tensor, params: dict, shard_sizes: dict) -> set[str]:
        """One HF tensor copied into its parameter (or its shard of a fused one); the names it filled."""
        if "rotary_emb" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
            return set()
        if name in params and name.split(".")[-2] in shard_sizes:     # stored fused already (Phi-3)
            with torch.no_grad():
                params[name].data.copy_(tensor)
            return {f"{name}#{i}" for i in range(len(shard_sizes[name.split(".")[-2]]))}
        for piece, (fused, shard) in self.FUSED_SHARDS.items():
            if f".{piece}." in name:
                target = name.replace(piece, fused)
                param = params[target]
                sizes = [param.shape[0] // 2] * 2 if fused == "gate_up_proj" else shard_sizes[fused]
                offset = sum(sizes[:shard])
                with torch.no_grad():
                    param.data[offset:offset + sizes[shard]].copy_(tensor)
                return {f"{target}#{shard}"}
        if name not in params:
            raise KeyError(f"unexpected weight {name!r}")
        target = params[name].data
        with torch.no_grad():
            if name in self._VOCAB_ROWS and tensor.shape[0] < target.shape[0]:
                target[tensor.shape[0]:].zero_()       # the last rank's padding rows
                target = target[:tensor.shape[0]]
            target.copy_(tensor)
        return {name}

    def _layer_weight_names(self) -> dict[int, set[str]]:
        """Decoder layer -> what load_weights must fill in it."""
        out: dict[int, set[str]] = {}
        for name in self.expected_weight_names():
            if (layer := _layer_of(name)) is not None:
                out.setdefault(layer, set()).add(name)
        return out

    def expected_weight_names(self) -> set[str]:
        """What load_weights must fill for a complete model."""
        names = set()
        shard_sizes = self._shard_sizes()
        for name, _ in self.named_parameters():
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            fused = next((f for f in shard_sizes if f".{f}." in name), None)
            if fused:
                names.update(f"{name}#{i}" for i in range(len(shard_sizes[fused])))
            else:
                names.add(name)
        return names


def _layer_of(name: str) -> int | None:
    """The decoder layer a weight name ("layers.3.mlp.down_proj.weight") belongs to, None outside them."""
    if name.startswith("layers."):
        return int(name.split(".", 2)[1])
    return None
