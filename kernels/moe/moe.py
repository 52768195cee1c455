"""Mixture-of-experts feed-forward: top-k routing, then each expert's gated MLP over its tokens.

    x            [T, H]          the step's tokens
    w13          [E, H, 2I]      each expert's gate columns (0..I) then up columns (I..2I), like silu_and_mul's
                                 [gate | up]; input-major (the transpose of nn.Linear's weight), so a CPU
                                 matmul is x @ w13[e] (on our CPUs ~25% faster than x @ W.T at 16-row runs)
    w2           [E, I, H]       each expert's down projection, input-major
    w13_scale    [E, 2I] | None  per output channel scales when w13 is int8 or float8 (weight-only quantization:
    w2_scale     [E, H]  | None  W[e, k, n] = w[e, k, n] * scale[e, n])
    topk_weights [T, k] float32, topk_ids [T, k] int: the router's choice for each token

    y[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),   e = topk_ids[t, j]

With `foreign` (expert parallelism: this rank holds experts 0..E-1 of its own range), an id E marks
a slot whose expert lives on another rank: it contributes nothing here and takes no matmul rows.

Execution is by expert, never by token: the T*k (token, choice) slots are sorted by expert
(`argsort`, stable), so each expert's tokens are one contiguous run of rows, and each run
is one matmul per projection. The reference (CPU path) gathers the rows once with
index_select and loops over the experts that have tokens; the Triton kernel
(kernels/moe/moe_triton.py) runs every run as a tile of one grouped GEMM per projection.
"""
from __future__ import annotations

import torch

from jobrunner.kernels.activation.activation import silu_and_mul_ref
from jobrunner.kernels.common.triton_utils import use_triton


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool, fixed_order: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax (float32) over experts, the top k, renormalized to sum 1 when asked (Mixtral always,
    Qwen MoE when norm_topk_prob). -> (weights [T, k] float32, ids [T, k] int64). fixed_order (the
    batch-invariant mode): the k weights summed left to right by elementwise adds, not by torch's sum."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        total = weights.sum(dim=-1, keepdim=True) if not fixed_order else sum(
            (weights[:, j:j + 1] for j in range(1, top_k)), weights[:, :1])
        weights = weights / total
    return weights, ids


def expert_weight(w: torch.Tensor, scale: torch.Tensor | None, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e's weight [K, N] in dtype (dequantized in float32 and rounded once when quantized)."""
    if scale is None:
        return w[e]
    return (w[e].float() * scale[e].float()[None, :]).to(dtype)


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None, foreign: bool = False) -> torch.Tensor:
    """The torch path (see the module doc): [T, H] -> [T, H] in x.dtype. Rounds and sums like HF's
    experts: each projection's output in x.dtype, the routing weight cast to x.dtype before the
    product, a token's k results added in ascending expert order (the sorted order)."""
    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        h = torch.mm(rows, expert_weight(w13, w13_scale, e, x.dtype))          # [n, 2I]
        return torch.mm(silu_and_mul_ref(h), expert_weight(w2, w2_scale, e, x.dtype))
    return moe_by_expert(x, topk_weights, topk_ids, w13.shape[0], expert, foreign)


def moe_by_expert(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                  expert, foreign: bool = False, fixed_order: bool = False) -> torch.Tensor:
    """The slots sorted by expert, each expert's run of rows through expert(e, rows [n, H]) -> [n, H],
    weighted and summed per token: [T, H] -> [T, H] in x.dtype (fused_moe_ref's order and rounding).
    fixed_order: the per-token sum as combine_in_expert_order (the batch-invariant mode; no foreign slots)."""
    if fixed_order and foreign:
        raise ValueError("a fixed-order combine takes no foreign slots (expert parallelism)")
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)                       # slots grouped by expert (foreign ones last)
    counts = torch.bincount(flat, minlength=num_experts + foreign).tolist()
    if foreign:
        order = order[:len(flat) - counts.pop(num_experts)]
    tokens = order // k
    xs = x.index_select(0, tokens)                                 # [T*k, H], expert runs in order
    out = torch.empty((len(order), x.shape[1]), dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            out[start:start + n] = expert(e, xs[start:start + n])
            start += n
    out.mul_(topk_weights.reshape(-1)[order].to(x.dtype)[:, None])
    if fixed_order:
        return combine_in_expert_order(out, order, topk_ids)
    return torch.zeros_like(x).index_add_(0, tokens, out)


def combine_in_expert_order(out: torch.Tensor, order: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """out [T*k, H]: the weighted results of the slots `order` (sorted by expert) -> y [T, H], each token's
    y = 0 + its k results added one at a time in ascending expert order: the order index_add_ over the
    sorted slots gives (so the same bits), made explicit as k elementwise adds, with no kernel left to
    choose a sum order by the batch's size."""
    t, k = topk_ids.shape
    row = torch.empty_like(order)
    row[order] = torch.arange(len(order), device=order.device)          # slot -> its row of out
    rows = row.view(t, k).gather(1, torch.argsort(topk_ids, dim=-1, stable=True))     # [T, k], experts ascending
    y = out.new_zeros((t, out.shape[1]))
    for j in range(k):
        y += out.index_select(0, rows[:, j])
    return y


def moe_over_linears(x: torch.Tensor, linears, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """fused_moe_ref with each expert's projections given as modules, linears[e] = (w13: H -> 2I, w2: I -> H)
    (the batch-invariant mode's packed, row-invariant linears), its per-token sum in a fixed order."""
    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        w13, w2 = linears[e]
        return w2(silu_and_mul_ref(w13(rows)))
    return moe_by_expert(x, topk_weights, topk_ids, len(linears), expert, fixed_order=True)


def fused_moe(x, w13, w2, topk_weights, topk_ids, w13_scale=None, w2_scale=None, foreign=False):
    """Dispatch: the Triton grouped GEMMs on CUDA (or with JOBRUNNER_TRITON=1), the reference elsewhere."""
    if use_triton(x):
        from jobrunner.kernels.moe.moe_triton import fused_moe_triton
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, foreign)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, foreign)
