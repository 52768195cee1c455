"""Which part of the model a rank holds: local shapes, and the slice of each checkpoint tensor it reads.

    column-parallel (output rows split)   q/k/v, gate/up (dense, shared and routed experts),
                                          embed_tokens and lm_head (vocabulary rows)
    row-parallel (input columns split)    o_proj, down_proj (and the experts' down): one all-reduce after
    replicated                            norms, routers, Qwen2-MoE's shared-expert gate

KV heads split like the query heads when there are at least as many as ranks; with fewer, each
rank holds the one KV head its query heads read (rank r: head r // (size / num_kv_heads)), so a
KV head is kept by size / num_kv_heads ranks. The vocabulary is cut into equal parts of
ceil(vocab / size) rows; the last part's padding rows stay zero and their logits are dropped.

Routed experts split one of two ways (`moe_split`, auto by the layer's shape):
  columns   each expert like a dense MLP: every rank holds every expert's share of its intermediate
            columns; the work stays even however the router picks. Auto's choice while each share
            keeps at least EXPERT_MIN_COLUMNS columns (a GEMM narrower than that wastes its tiles).
  experts   rank r holds experts [r * E / size, (r + 1) * E / size) whole; a token's slots routed
            elsewhere cost nothing here (kernels.fused_moe's foreign ids). Auto's choice for narrow
            experts (Qwen3-30B-A3B's 768 columns over 8 ranks would be 96 each), when E divides.
Either way the block's partial sums meet in one all-reduce.

A rank reads only its slices: `select(name, shape)` tells the loader what to read of an HF tensor
(SKIP: none of it, another rank's expert).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from jobrunner.engine.config.engine_config import ConfigError
from jobrunner.engine.config.model_config import ModelConfig
from jobrunner.engine.parallel.group import TensorParallel

# select(): the whole tensor, nothing of it, or (dim, [(start, length), ...]) joined along dim in order
WHOLE = None
SKIP = (0, [])
Ranges = tuple[int, list[tuple[int, int]]]
MOE_SPLITS = ("auto", "experts", "columns")
EXPERT_MIN_COLUMNS = 128
_EXPERT = re.compile(r".*\.experts\.(\d+)\.\w+\.weight")

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3")
_ROW = ("o_proj", "down_proj", "w2")


def experts_whole(cfg: ModelConfig, size: int, moe_split: str = "auto") -> bool:
    """Whether routed experts are split by experts (else by columns) over `size` ranks."""
    if moe_split not in MOE_SPLITS:
        raise ConfigError(f"moe_split {moe_split!r}: choose one of {', '.join(MOE_SPLITS)}")
    if cfg.moe is None or size == 1 or moe_split == "columns":
        return False
    if moe_split == "experts":
        return True
    inter = cfg.moe.intermediate_size
    return cfg.moe.num_experts % size == 0 and (inter % size != 0 or inter // size < EXPERT_MIN_COLUMNS)


def check_split(cfg: ModelConfig, size: int, moe_split: str = "auto") -> None:
    """ConfigError unless the model's heads and MLP widths split evenly over `size` ranks."""
    whole = experts_whole(cfg, size, moe_split)
    if size == 1:
        return
    problems = []
    if cfg.num_heads % size:
        problems.append(f"{cfg.num_heads} attention heads")
    kv = cfg.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        problems.append(f"{kv} KV heads")
    dense = cfg.moe is None or any(not cfg.moe.is_sparse(i) for i in range(cfg.num_layers))
    widths = {"intermediate size": cfg.intermediate_size} if dense else {}
    if cfg.moe is not None:
        widths["shared expert intermediate size"] = cfg.moe.shared_intermediate_size
        widths["experts" if whole else "expert intermediate size"] = \
            cfg.moe.num_experts if whole else cfg.moe.intermediate_size
    problems += [f"{name} {w}" for name, w in widths.items() if w % size]
    if problems:
        raise ConfigError(f"--tensor-parallel {size}: {cfg.architecture} has {', '.join(problems)}, which do not "
                          f"split evenly over {size} ranks; choose a tensor-parallel size that divides them")


def rank_plan(cfg: ModelConfig, size: int) -> ShardPlan:
    """What one of `size` ranks holds of a model (every rank holds as much): rank 0's plan."""
    return ShardPlan(cfg, TensorParallel(rank=0, size=size))


@dataclass(frozen=True)
class ShardPlan:
    cfg: ModelConfig
    tp: TensorParallel

    @property
    def heads(self) -> int:
        return self.cfg.num_heads // self.tp.size

    @property
    def kv_heads(self) -> int:
        return max(1, self.cfg.num_kv_heads // self.tp.size)

    @property
    def first_kv_head(self) -> int:
        kv, size = self.cfg.num_kv_heads, self.tp.size
        return self.tp.rank * kv // size if kv >= size else self.tp.rank // (size // kv)

    @property
    def vocab_part(self) -> int:
        """Rows of embed_tokens and lm_head on each rank (the last rank's tail is padding)."""
        return -(-self.cfg.vocab_size // self.tp.size)

    @property
    def vocab_start(self) -> int:
        return self.tp.rank * self.vocab_part

    def width(self, n: int) -> int:
        """A column- or row-parallel width n on this rank."""
        return n // self.tp.size

    @property
    def experts_whole(self) -> bool:
        return experts_whole(self.cfg, self.tp.size, self.tp.moe_split)

    @property
    def experts(self) -> tuple[int, int]:
        """(first, count) of the routed experts this rank holds (all, when split by columns)."""
        e = self.cfg.moe.num_experts
        return self.tp.part(e) if self.experts_whole else (0, e)

    def expert_width(self) -> int:
        """Intermediate columns of each routed expert this rank holds."""
        inter = self.cfg.moe.intermediate_size
        return inter if self.experts_whole else self.width(inter)

    # --- the checkpoint's tensors ---------------------------------------------------------

    def select(self, name: str, shape: tuple[int, ...]) -> Ranges | None:
        """What this rank reads of the HF tensor `name` of `shape`: WHOLE, or (dim, ranges)."""
        if self.tp.size == 1:
            return WHOLE
        cfg, d = self.cfg, self.cfg.head_dim
        if self.experts_whole and (m := _EXPERT.fullmatch(name)):
            first, count = self.experts
            return WHOLE if first <= int(m[1]) < first + count else SKIP
        parts = name.split(".")
        piece = parts[-2] if len(parts) > 1 else name
        q_rows = (self.tp.rank * self.heads * d, self.heads * d)
        kv_rows = (self.first_kv_head * d, self.kv_heads * d)
        if piece in ("embed_tokens", "lm_head"):
            return 0, [(self.vocab_start, max(0, min(self.vocab_part, cfg.vocab_size - self.vocab_start)))]
        if piece == "q_proj" or (piece == "q_norm" and shape[0] == cfg.num_heads * d != d):   # OLMo 2: norm over all heads
            return 0, [q_rows]
        if piece in ("k_proj", "v_proj") or (piece == "k_norm" and shape[0] == cfg.num_kv_heads * d != d):
            return 0, [kv_rows]
        if piece == "qkv_proj":                                  # stored fused (Phi-3): [q | k | v] rows
            q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
            return 0, [q_rows, (q + kv_rows[0], kv_rows[1]), (q + kv + kv_rows[0], kv_rows[1])]
        if piece == "gate_up_proj":                              # stored fused (Phi-3): [gate | up] rows
            inter = shape[0] // 2
            start, n = self.tp.part(inter)
            return 0, [(start, n), (inter + start, n)]
        if piece in _COLUMN:
            return 0, [self.tp.part(shape[0])]
        if piece in _ROW and len(shape) == 2:
            return 1, [self.tp.part(shape[1])]
        return WHOLE
