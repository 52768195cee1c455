"""The CPU prefill attention (kernels/attention/cpu_prefill.py: context and own parts through the fused flash kernel,
merged by logsumexp) against the padded-SDPA reference, on random paged layouts."""
from __future__ import annotations

import pytest
import torch

from tests.attention_helpers import TOL, paged_tensors
from jobrunner.kernels.attention.attention import paged_attention, paged_attention_ref
from jobrunner.kernels.attention import cpu_prefill
from jobrunner.kernels.attention.cpu_prefill import PrefillPlan


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def paged_step(seqs, num_decodes, Hq, Hk, D, BS, gen, dtype=torch.float32, prefix=0, consecutive=False,
               window=None):
    """seqs: [(query_len, seq_len)], decodes first. prefix: that many leading positions of every sequence
    whose context covers them sit in the same physical blocks (whole blocks: a shared prefix); consecutive:
    the prefix's blocks are consecutive in the pool (else shuffled). The rest of the pool is shuffled."""
    shared_blocks = prefix // BS
    need = [(L + BS - 1) // BS for _, L in seqs]
    nb = shared_blocks + sum(need) + 3
    free = torch.randperm(nb, generator=gen).tolist()
    shared = list(range(shared_blocks)) if consecutive else [free.pop() for _ in range(shared_blocks)]
    free = [b for b in free if b not in shared]
    tables = []
    for (ql, L), n in zip(seqs, need):
        own_from = min(shared_blocks, (L - ql) // BS)           # the chunk's own tokens are never shared
        tables.append(shared[:own_from] + [free.pop() for _ in range(n - own_from)])
    return paged_tensors(seqs, num_decodes, tables, nb, Hq, Hk, D, BS, gen, dtype, window)


CASES = {
    # (query_len, seq_len) per sequence, decodes first; Hq, Hk, D, BS; shared prefix; consecutive
    "one-chunk-no-context": ([(37, 37)], 0, (4, 4, 16, 8), 0, False),
    "decodes-then-chunks-gqa": ([(1, 21), (1, 90), (7, 7), (12, 35), (5, 16), (30, 64)], 2, (6, 2, 32, 16), 0, False),
    "shared-prefix-consecutive": ([(1, 70), (9, 57), (3, 51), (17, 65), (9, 57)], 1, (9, 3, 64, 16), 48, True),
    "shared-prefix-shuffled": ([(9, 57), (3, 51), (17, 65), (40, 88)], 0, (8, 2, 32, 16), 48, False),
    "partial-block-contexts": ([(5, 13), (1, 2), (8, 9), (16, 33), (2, 40)], 0, (4, 1, 8, 4), 8, False),
    "long-and-short-chunks": ([(130, 200), (3, 11), (64, 64), (4, 4)], 0, (4, 2, 16, 16), 0, False),
    "chunks-inside-one-block": ([(1, 9), (20, 20), (3, 25), (24, 30), (40, 70)], 1, (4, 2, 16, 32), 0, False),
}


@pytest.mark.parametrize("single_min", [1, 16, 10**9], ids=["all-alone", "16-alone", "all-batched"])
@pytest.mark.parametrize("case", list(CASES))
def test_prefill_matches_reference(case, single_min, gen, monkeypatch):
    monkeypatch.setattr(cpu_prefill, "SINGLE_MIN", single_min)
    seqs, nd, (Hq, Hk, D, BS), prefix, consecutive = CASES[case]
    q, k, v, meta = paged_step(seqs, nd, Hq, Hk, D, BS, gen, prefix=prefix, consecutive=consecutive)
    torch.testing.assert_close(paged_attention(q, k, v, meta, 0.3), paged_attention_ref(q, k, v, meta, 0.3),
                               **TOL[torch.float32])


def test_bfloat16_cache(gen):
    seqs = [(1, 30), (9, 57), (17, 65)]
    q, k, v, meta = paged_step(seqs, 1, 6, 2, 32, 16, gen, dtype=torch.bfloat16, prefix=32, consecutive=True)
    ref = paged_attention_ref(q.float(), k.float(), v.float(), meta, 0.3)
    torch.testing.assert_close(paged_attention(q, k, v, meta, 0.3).float(), ref, **TOL[torch.bfloat16])


@pytest.mark.parametrize("window", [8, 200], ids=["cutting-window", "window-past-every-length"])
def test_sliding_window_and_softcap(window, gen):
    """A window that cuts, and soft-capping, go to the reference; a window no row reaches is no window."""
    q, k, v, meta = paged_step([(1, 40), (9, 57), (12, 35)], 1, 4, 2, 16, 8, gen, prefix=16, window=window)
    for softcap in (None, 5.0):
        torch.testing.assert_close(paged_attention(q, k, v, meta, 0.3, softcap=softcap),
                                   paged_attention_ref(q, k, v, meta, 0.3, softcap=softcap), **TOL[torch.float32])
        torch.testing.assert_close(paged_attention(q, k, v, meta, 0.3, sliding=False, softcap=softcap),
                                   paged_attention_ref(q, k, v, meta, 0.3, sliding=False, softcap=softcap),
                                   **TOL[torch.float32])


def test_plan_shares_a_prefix_and_reads_consecutive_blocks_in_place(gen, monkeypatch):
    """Chunks over the same cached prefix make one context group; consecutive blocks are a slice, not a gather;
    long chunks run alone, short ones of similar lengths share a padded batch."""
    monkeypatch.setattr(cpu_prefill, "SINGLE_MIN", 16)
    seqs = [(9, 57), (3, 51), (17, 65), (9, 57), (100, 148)]
    _, _, _, meta = paged_step(seqs, 0, 2, 1, 8, 16, gen, prefix=48, consecutive=True)
    plan = meta.prefill_plan()
    assert isinstance(plan, PrefillPlan) and plan.num_rows == sum(q for q, _ in seqs)
    assert len(plan.groups) == 1 and plan.groups[0].length == 48 and plan.groups[0].blocks == 0
    assert plan.groups[0].rows == slice(0, plan.num_rows)
    assert [(c.start, c.end) for c in plan.singles] == [(12, 29), (38, 138)]   # 16 tokens or more: alone
    assert sorted(b.shape for b in plan.own) == [(3, 9)]                      # 9, 9, 3: one padded batch


def test_a_chunk_in_consecutive_slots_reads_its_keys_in_place(gen, monkeypatch):
    monkeypatch.setattr(cpu_prefill, "SINGLE_MIN", 16)
    _, _, _, meta = paged_step(CASES["chunks-inside-one-block"][0], 1, 4, 2, 16, 32, gen)
    in_place = [c.first_slot is not None for c in meta.prefill_plan().singles]
    assert in_place[:2] == [True, True]         # 20 and 24 new tokens inside one block each (40 span two)
