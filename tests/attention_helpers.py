"""A paged attention step for the CPU kernels' tests: the metadata and random q and pools of given tables."""
from __future__ import annotations

import torch

from jobrunner.kernels.attention.attention import AttentionMetadata

# Output against the float32 reference computed from the same inputs
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def paged_tensors(seqs, num_decodes, tables, nb, Hq, Hk, D, BS, gen, dtype, window):
    """seqs: [(query_len, seq_len)], decodes first; tables: each sequence's blocks in a pool of nb blocks.
    Returns (q, k_pool, v_pool, metadata); each query token's slot is its position's in its table."""
    slots = [table[p // BS] * BS + p % BS for (ql, L), table in zip(seqs, tables) for p in range(L - ql, L)]
    meta = AttentionMetadata.build(BS, num_decodes, [q for q, _ in seqs], [L for _, L in seqs], slots, tables,
                                   "cpu", window)
    T = sum(q for q, _ in seqs)
    q = torch.randn(T, Hq, D, generator=gen).to(dtype)
    k = torch.randn(nb, BS, Hk, D, generator=gen).to(dtype)
    v = torch.randn(nb, BS, Hk, D, generator=gen).to(dtype)
    return q, k, v, meta
