"""Cut each sorted window into work units (prefix groups) and plan a whole dataset.

Cutting rule, on a window in sorted (depth-first) order with lcp = LCP(previous row, row):

1. Hard boundary: a new unit starts where lcp < join_threshold(previous, row), i.e. the
   two rows share less than one full block (block_size tokens) AND less than
   `min_share` of the shorter prompt (the second clause keeps short prompts that share
   most of their tokens, e.g. 12 of 20, together; `min_share=0` turns it off). Across a
   hard boundary no full block is shared, so splitting there costs nothing in a block
   cache. Window boundaries are hard boundaries too.
2. Cap: a unit holds at most unit_max_rows rows. When a full unit would grow, it is cut
   at the shallowest trie branch in its second half: the position j with the smallest
   lcp among the last ceil(cap/2)+1 candidate cut points (ties: the latest, so units
   stay big). The cut unit keeps >= ceil(cap/2) rows and the rows after j move on to
   the next unit, which, if it shares a prefix with this one, finds it cached unless
   it was evicted in between.

Invariants: units are contiguous in sorted order; every row of a window is in exactly
one unit; in a unit of >= 2 rows every adjacent lcp passes the join threshold, so its
shared prefix (min of the lcps inside) is >= 1 token, and >= block_size tokens when no
row is short enough for the share clause. A unit is never split across workers.

Spreading (`spread_units`, data-parallel workers only): a window of fewer units than workers
leaves workers idle, so its largest unit of 2+ rows is halved until every worker can get one.
Each half keeps the shared prefix, which each worker then computes once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from jobrunner.engine import common_prefix

from .stats import PrefixStats
from .window import iter_windows


@dataclass(slots=True)
class PlanItem:
    key: Hashable  # caller's index of the request (opaque)
    tokens: Sequence[int]  # prompt token ids, each in [0, 2**32)


@dataclass(slots=True)
class WorkUnit:
    items: list[Hashable]  # keys, in run order
    shared_prefix_len: int  # LCP of all the unit's prompts (a lone row: its length)
    prompt_tokens: int  # sum of the prompts' lengths
    window_end: bool = False  # the last unit of its planning window


def join_threshold(len_a: int, len_b: int, block_size: int, min_share: float) -> int:
    """Smallest LCP at which two neighbouring rows go in the same unit (rule 1)."""
    if min_share <= 0:
        return block_size
    return max(1, min(block_size, math.ceil(min_share * min(len_a, len_b))))


def _shallowest_cut(lcps: Sequence[int], lo: int, hi: int) -> int:
    """Index j in [lo, hi] with the smallest lcps[j]; ties go to the largest j."""
    best, low = hi, lcps[hi]
    for j in range(hi - 1, lo - 1, -1):
        if lcps[j] < low:
            best, low = j, lcps[j]
    return best


def cut_window(
    lens: Sequence[int],
    lcps: Sequence[int],
    unit_max_rows: int = 256,
    block_size: int = 16,
    min_share: float = 0.5,
) -> Iterator[tuple[int, int]]:
    """Yield [start, end) row ranges of the units of one sorted window (module rules)."""
    n = len(lens)
    if n == 0:
        return
    cap = unit_max_rows
    half = (cap + 1) // 2  # a capped unit keeps at least this many rows
    start, i = 0, 1
    while i < n:
        p = lcps[i]
        # join_threshold is in [1, block_size]: skip the call when the answer is plain.
        if p < block_size and (
            p == 0 or p < join_threshold(lens[i - 1], lens[i], block_size, min_share)
        ):
            yield start, i
            start = i
        elif i - start >= cap:
            j = _shallowest_cut(lcps, start + half, i)
            yield start, j
            start = j
            continue  # re-check row i against the new, shorter unit
        i += 1
    yield start, n


def plan(
    items: Iterable[PlanItem],
    window_rows: int = 50_000,
    unit_max_rows: int = 256,
    block_size: int = 16,
    *,
    min_share: float = 0.5,
    stats: PrefixStats | None = None,
    window_tokens: int | None = None,
) -> Iterator[WorkUnit]:
    """Plan `items` into work units, window by window, in bounded memory.

    Each window of `window_rows` items (fewer when they reach `window_tokens` tokens) is
    sorted depth-first over its token trie and cut into units by the module's rules. Units
    come out in run order, a window's last one marked `window_end`; every key appears in
    exactly one unit. If `stats` is given, each window's prefix figures are added to it
    (the same figures `prefix_stats` gives for the same windows), so one pass over the
    data yields both the plan and the job's optimum.
    """
    if unit_max_rows < 1:
        raise ValueError("unit_max_rows must be >= 1")
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    if stats is not None and stats.block_size != block_size:
        raise ValueError("stats.block_size must equal block_size")
    pairs = ((it.key, it.tokens) for it in items)
    for w in iter_windows(pairs, window_rows, window_tokens):
        if stats is not None:
            stats.add_window(w.lens, w.lcps)
        keys, lens, lcps = w.keys, w.lens, w.lcps
        for s, e in cut_window(lens, lcps, unit_max_rows, block_size, min_share):
            shared = min(lcps[s + 1 : e]) if e - s > 1 else lens[s]
            yield WorkUnit(keys[s:e], shared, sum(lens[s:e]), window_end=e == len(keys))


def spread_units(
    units: Sequence[WorkUnit],
    workers: int,
    tokens_of: Callable[[Hashable], Sequence[int]],
    size: Callable[[WorkUnit], float] = lambda u: u.prompt_tokens,
) -> list[WorkUnit]:
    """One window's units, split until there are `workers` of them or none has 2+ rows.

    Each step halves the largest unit of 2+ rows (by `size`; ties: the earliest) into two
    contiguous halves, the first taking the odd row; they take its place, the second keeping
    its `window_end`. Deterministic, so every worker computes the same units. `tokens_of(key)`
    gives a row's prompt tokens, to recompute each half's figures.
    """
    units = list(units)
    while len(units) < workers:
        splittable = [i for i, u in enumerate(units) if len(u.items) > 1]
        if not splittable:
            break
        i = max(splittable, key=lambda j: size(units[j]))  # max keeps the first of equals
        unit = units[i]
        mid = (len(unit.items) + 1) // 2
        units[i : i + 1] = [
            _unit_of(unit.items[:mid], tokens_of, False),
            _unit_of(unit.items[mid:], tokens_of, unit.window_end),
        ]
    return units


def _unit_of(
    keys: list[Hashable], tokens_of: Callable[[Hashable], Sequence[int]], window_end: bool
) -> WorkUnit:
    """A unit of `keys` with its figures computed from the tokens (the same as plan's)."""
    tokens = [tokens_of(k) for k in keys]
    shared = len(tokens[0])
    for t in tokens[1:]:  # LCP of all = min of LCP(first, each)
        shared = min(shared, common_prefix(tokens[0], t))
    return WorkUnit(list(keys), shared, sum(map(len, tokens)), window_end=window_end)
