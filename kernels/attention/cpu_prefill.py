"""Prefill attention on CPU without a padded mask: every chunk's attention in two unmasked or causal parts
through torch's fused CPU flash kernel, merged exactly by their logsumexps. Where the in-place kernel's prefill
entry serves (kernels/attention/cpu_attention.py: AVX-512 builds, head_dim a multiple of 16) it runs instead;
this is the path for other CPUs and head sizes.

A chunk of L new tokens after c cached ones (kernels/attention/attention.py has the layout) sees, per query row i,
the c context keys (all of them) and its own keys 0..i. So:

    context part   queries over the keys [0, c)            no mask: every query sees every key
    own part       queries over the chunk's keys [c, c+L)  causal, top-left aligned (is_causal, Lq == Lk)
    out            (o_ctx * e^lse_ctx + o_own * e^lse_own) / (e^lse_ctx + e^lse_own)

Chunks whose contexts are the same physical blocks (a shared prefix) run their context parts as one query
batch over one copy of those keys; a context in consecutive blocks is a view of the pool, not a gather.
Own parts: a chunk of at least SINGLE_MIN tokens runs alone over views (its queries' rows, its keys' slots
when consecutive: no padding, no gather of q); shorter chunks are padded into batches of similar lengths
(under is_causal a padded key sits past every real query of its row, so no real query sees it): a few
large calls, since on a shared machine every call's parallel region waits for descheduled threads. GQA is the kernel's own (fewer key heads than query
heads). The padded boolean mask of the reference (kernels/attention/reference.py) makes SDPA take its math path;
here no mask is evaluated at all.

Not covered (the reference serves): sliding windows that cut a chunk's keys, soft-capping, int8 caches.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
# Measured on 64 chunks of 16-48 tokens: alone 4.8 ms a layer and padded into two batches 8.5 ms on a
# quiet machine, but 307 ms against 176 ms at load average 4 on 2 cores: alone only where a call is long.
SINGLE_MIN = 256


@dataclass
class ContextGroup:
    """Chunks whose contexts are the same c keys in the same blocks: their query rows as one batch."""
    rows: torch.Tensor | slice       # rows of the prefill queries (a slice when they are consecutive)
    blocks: torch.Tensor | int       # the context's blocks; an int: the first of consecutive blocks
    num_blocks: int
    length: int                      # c: keys of the context


@dataclass
class OwnBatch:
    """Chunks padded to one length for their own (causal) part."""
    shape: tuple[int, int]           # (B, Lmax)
    q_index: torch.Tensor            # [B * Lmax] rows of the prefill queries (padding repeats a real row)
    slots: torch.Tensor              # [B * Lmax] cache slots of the chunks' own keys (padding likewise)
    real: torch.Tensor               # the real rows' places in [B * Lmax], chunk by chunk
    rows: torch.Tensor | slice       # where the real rows go in the prefill output, in `real`'s order


@dataclass
class Single:
    """A chunk whose own part runs alone: rows [start, end) of the prefill queries."""
    start: int
    end: int
    first_slot: int | None           # its keys' slots are [first_slot, first_slot + end - start); None: not consecutive


@dataclass
class PrefillPlan:
    """A step's prefill chunks as context groups and own parts: built once a step, shared by all layers."""
    num_rows: int
    groups: list[ContextGroup]
    singles: list[Single]
    own: list[OwnBatch]
    slots: torch.Tensor              # [T] the chunks' new slots (the singles' keys when not consecutive)

    @classmethod
    def build(cls, block_size: int, query_lens: list[int], seq_lens: list[int], tables: list[list[int]],
              slots: torch.Tensor) -> "PrefillPlan":
        """The prefill chunks only: query_lens, seq_lens, block tables (lists) and the chunks' new slots [T]."""
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        alone = [i for i, n in enumerate(query_lens) if n >= SINGLE_MIN]
        short = [i for i, n in enumerate(query_lens) if n < SINGLE_MIN]
        return cls(starts[-1], _context_groups(block_size, query_lens, seq_lens, tables, starts),
                   [_single(starts[i], starts[i + 1], slots) for i in alone],
                   _own_batches(short, query_lens, starts, slots) if short else [], slots)


def _context_groups(bs, query_lens, seq_lens, tables, starts) -> list[ContextGroup]:
    by_context: dict[tuple, list[int]] = {}
    for i, (ql, sl) in enumerate(zip(query_lens, seq_lens)):
        c = sl - ql
        if c:
            by_context.setdefault((c, tuple(tables[i][:-(-c // bs)])), []).append(i)
    groups = []
    for (c, blocks), members in by_context.items():
        rows = [r for i in members for r in range(starts[i], starts[i] + query_lens[i])]
        first = blocks[0]
        consecutive = list(blocks) == list(range(first, first + len(blocks)))
        groups.append(ContextGroup(_rows(rows), first if consecutive else torch.tensor(blocks), len(blocks), c))
    return groups


def _single(start: int, end: int, slots: torch.Tensor) -> Single:
    first = int(slots[start])
    consecutive = bool(torch.equal(slots[start:end], torch.arange(first, first + end - start)))
    return Single(start, end, first if consecutive else None)


def _own_batches(chunks, query_lens, starts, slots, waste: float = 4.0) -> list[OwnBatch]:
    """Longest first; a chunk joins the open batch while the batch's length is within `waste` of its own."""
    order = sorted(chunks, key=lambda i: -query_lens[i])
    batches, open_ = [], []
    for i in order:
        if open_ and query_lens[open_[0]] > waste * query_lens[i]:
            batches.append(open_)
            open_ = []
        open_.append(i)
    batches.append(open_)
    return [_own_batch(members, query_lens, starts, slots) for members in batches]


def _own_batch(members, query_lens, starts, slots) -> OwnBatch:
    lmax = query_lens[members[0]]
    j = torch.arange(lmax)
    lens = torch.tensor([query_lens[i] for i in members])
    first = torch.tensor([starts[i] for i in members])
    q_index = first[:, None] + torch.minimum(j[None, :], lens[:, None] - 1)
    rows = [r for i in members for r in range(starts[i], starts[i] + query_lens[i])]
    real = torch.nonzero((j[None, :] < lens[:, None]).reshape(-1))[:, 0]             # row-major: chunk by chunk
    q_index = q_index.reshape(-1)
    return OwnBatch((len(members), lmax), q_index, slots[q_index], real, _rows(rows))


def _rows(rows: list[int]) -> torch.Tensor | slice:
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows)


def prefill_attention_cpu(q, k_cache, v_cache, plan: PrefillPlan, scale: float, out=None) -> torch.Tensor:
    """q: the prefill rows [T, Hq, D] -> [T, Hq, D] (into `out` when given), over float caches [NB, BS, Hk, D]."""
    out = q.new_empty(q.shape) if out is None else out
    lse = torch.empty(q.shape[:2], dtype=torch.float32)
    k_slots, v_slots = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    q_heads = q.transpose(0, 1)
    _singles(out, lse, q_heads, k_slots, v_slots, plan, scale)
    for b in plan.own:
        o, l = _flash(_gather(q, b.q_index, b.shape), _gather(k_slots, b.slots, b.shape),
                      _gather(v_slots, b.slots, b.shape), is_causal=True, scale=scale)
        _put(out, b.rows, o.transpose(1, 2).reshape(-1, *q.shape[1:]), b.real)
        _put(lse, b.rows, l.transpose(1, 2).reshape(-1, q.shape[1]), b.real)
    for g in plan.groups:
        k, v = _context(k_cache, g), _context(v_cache, g)
        o, l = _flash(q_heads[:, g.rows][None], k, v, scale=scale)
        _merge(out, lse, g.rows, o[0].transpose(0, 1), l[0].transpose(0, 1))
    return out


def _singles(out, lse, q_heads, k_slots, v_slots, plan: PrefillPlan, scale: float) -> None:
    """The chunks that run alone: views of q, of the pool where their slots are consecutive, else of the
    new slots' keys gathered once."""
    k_new = v_new = None
    if any(c.first_slot is None for c in plan.singles):
        k_new, v_new = k_slots.index_select(0, plan.slots), v_slots.index_select(0, plan.slots)
    for c in plan.singles:
        if c.first_slot is None:
            k, v = k_new[c.start:c.end], v_new[c.start:c.end]
        else:
            keys = slice(c.first_slot, c.first_slot + c.end - c.start)
            k, v = k_slots[keys], v_slots[keys]
        o, l = _flash(q_heads[None, :, c.start:c.end], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                      is_causal=True, scale=scale)
        out[c.start:c.end] = o[0].transpose(0, 1)
        lse[c.start:c.end] = l[0].transpose(0, 1)


def _gather(x: torch.Tensor, index: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """x[index] as [B, H, L, D] (index_select: whole rows copied, several times faster than x[index_2d])."""
    return x.index_select(0, index).view(*shape, *x.shape[1:]).transpose(1, 2)


def _put(dst: torch.Tensor, rows, src: torch.Tensor, real: torch.Tensor) -> None:
    """dst[rows] = src[real], in one pass when rows are consecutive."""
    if isinstance(rows, slice):
        torch.index_select(src, 0, real, out=dst[rows])
    else:
        dst.index_copy_(0, rows, src.index_select(0, real))


def _context(cache: torch.Tensor, g: ContextGroup) -> torch.Tensor:
    """The group's context keys (or values) as [1, Hk, c, D]: a view of the pool when the blocks are consecutive."""
    if isinstance(g.blocks, int):
        x = cache[g.blocks:g.blocks + g.num_blocks]
    else:
        x = cache.index_select(0, g.blocks)
    return x.reshape(-1, *cache.shape[2:])[:g.length].transpose(0, 1)[None]


def _merge(out, lse, rows, o_ctx, lse_ctx) -> None:
    """out[rows] (the own part, its logsumexp in lse[rows]) joined with the context part, exactly: the
    context's weight e^lse_ctx / (e^lse_ctx + e^lse_own) = sigmoid(lse_ctx - lse_own), and
    own * (1 - w) + ctx * w = lerp(own, ctx, w). A row is in one group only: its total lse is not needed."""
    w = torch.sigmoid(lse_ctx - lse[rows])[..., None].to(out.dtype)
    if isinstance(rows, slice):
        out[rows].lerp_(o_ctx, w)
    else:
        out.index_copy_(0, rows, out[rows].lerp_(o_ctx, w))
