"""Planner tests on hand-made token lists: order, units, windows, stats."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobrunner.planner import PlanItem, PrefixStats, WorkUnit, block_level_reuse, cacheable_prefix_tokens, cut_window, join_threshold, lcp, partial_block_tokens, plan, prefix_stats, spread_units
from jobrunner.planner.window import encode, iter_windows


def items_of(token_lists):
    return [PlanItem(i, list(t)) for i, t in enumerate(token_lists)]


def run(token_lists, **kw):
    return list(plan(items_of(token_lists), **kw))


def trie_nodes(token_lists) -> int:
    """Reference: distinct non-empty prefixes = trie nodes without the root."""
    return len({tuple(t[:k]) for t in token_lists for k in range(1, len(t) + 1)})


def simulate_block_cache(token_lists, block_size: int) -> int:
    """Reference: unbounded full-block prefix cache, last prompt token always recomputed."""
    cache: set[tuple[int, ...]] = set()
    hit = 0
    for t in token_lists:
        k = 0
        while (k + 1) * block_size <= len(t) - 1 and tuple(t[: (k + 1) * block_size]) in cache:
            k += 1
        hit += k * block_size
        for j in range(1, len(t) // block_size + 1):
            cache.add(tuple(t[: j * block_size]))
    return hit


# ---- ordering -----------------------------------------------------------------------


def test_encode_preserves_lexicographic_order():
    lists = [[], [0], [0, 0], [1], [255], [256], [1, 2**32 - 1], [65536, 0], [2, 1]]
    assert sorted(lists, key=encode) == sorted(lists)
    with pytest.raises(ValueError):
        encode([-1])
    with pytest.raises(ValueError):
        encode([2**32])


def test_order_is_depth_first_and_shared_prefixes_adjacent():
    A = [7, 7, 7, 7]
    B = [9, 9, 9]
    rows = [A + [1], B + [5], A + [2], [3], B + [4], A + [1, 0], A]
    order = [k for u in run(rows, block_size=2) for k in u.items]
    # Sorted: [3] < A < A+[1] < A+[1,0] < A+[2] < B+[4] < B+[5]; a prefix before its extension.
    assert order == [3, 6, 0, 5, 2, 4, 1]


def test_neighbour_lcps_in_sorted_order():
    rows = [[1, 2, 3], [1, 2], [1, 2, 3], [1, 4], [2], [], [1, 2, 3, 4]]
    (w,) = list(iter_windows(enumerate(rows), 100))
    srt = [rows[k] for k in w.keys]
    assert srt == sorted(rows)
    assert w.lens == [len(r) for r in srt]
    assert w.lcps == [0] + [lcp(a, b) for a, b in zip(srt, srt[1:])]


def test_duplicates_keep_input_order():
    rows = [[5, 5], [1], [5, 5], [5, 5]]
    units = run(rows, block_size=1)
    assert [u.items for u in units] == [[1], [0, 2, 3]]
    assert units[1].shared_prefix_len == 2  # identical prompts share all of themselves


def test_large_token_ids_lcp():
    # Differences in low and high bytes of a token id are both seen at token granularity.
    a, b = [2**32 - 1, 70000, 1], [2**32 - 1, 70000, 2]
    c = [2**32 - 1, 70001]
    (w,) = list(iter_windows(enumerate([c, b, a]), 10))
    assert w.keys == [2, 1, 0] and w.lcps == [0, 2, 1]


# ---- unit boundaries ----------------------------------------------------------------


def test_cut_where_lcp_drops_below_one_block():
    P = list(range(100, 116))  # one full block (16 tokens)
    rows = [P + [1, 2], [50] * 20, P + [3], P[:15] + [0, 0, 0, 0, 0]]
    units = run(rows, block_size=16, min_share=0)
    # Sorted: [50]*20, P[:15]+[0..], P+[1,2], P+[3]. P[:15]+0 shares 15 < 16 with P+[1,2].
    assert [u.items for u in units] == [[1], [3], [0, 2]]
    assert [u.shared_prefix_len for u in units] == [20, 20, 16]
    assert [u.prompt_tokens for u in units] == [20, 20, 35]


def test_short_prompts_join_on_share_of_length():
    # 10-token prompts sharing 6 tokens: no full 16-token block, but 6 >= ceil(0.5 * 10).
    rows = [[1] * 6 + [2, 3, 4, 5], [1] * 6 + [9, 9, 9, 9], [1, 1, 1, 1, 7, 7, 7, 7, 7, 7]]
    assert join_threshold(10, 10, 16, 0.5) == 5
    units = run(rows, block_size=16)
    assert [u.items for u in units] == [[0, 1], [2]]  # [1,1,1,1,7..] shares only 4 < 5
    assert units[0].shared_prefix_len == 6
    # min_share=0: the pure block rule, so no short prompts join.
    assert [u.items for u in run(rows, block_size=16, min_share=0)] == [[0], [1], [2]]


def test_join_threshold():
    assert join_threshold(100, 200, 16, 0.5) == 16  # one block
    assert join_threshold(20, 200, 16, 0.5) == 10  # half the shorter prompt
    assert join_threshold(1, 1, 16, 0.5) == 1
    assert join_threshold(0, 5, 16, 0.5) == 1  # an empty prompt joins nothing
    assert join_threshold(3, 3, 16, 0) == 16


def test_empty_prompts_are_lone_units():
    units = run([[], [], [4]], block_size=4)
    assert [u.items for u in units] == [[0], [1], [2]]
    assert [u.shared_prefix_len for u in units] == [0, 0, 1]


def test_prompt_that_is_prefix_of_another():
    P = [3] * 8
    rows = [P + [1, 1], P, P + [1]]
    units = run(rows, block_size=4)
    assert [u.items for u in units] == [[1, 2, 0]]
    assert units[0].shared_prefix_len == 8


def test_unit_max_rows_cap_plain():
    rows = [[1] * 16 + [i] for i in range(10)]  # one deep group, no branch to prefer
    units = run(rows, unit_max_rows=4, block_size=16)
    assert [u.items for u in units] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert all(u.shared_prefix_len == 16 for u in units)


def test_cap_cuts_at_shallowest_branch_in_second_half():
    S = [1] * 16  # shared system prompt: one block
    g1 = [S + [2] * 16 + [i] for i in range(3)]  # three rows with a deeper 32-token prefix
    g2 = [S + [3] * 16 + [i] for i in range(3)]
    units = run(g1 + g2, unit_max_rows=4, block_size=16)
    # A plain cap would split g2 as [g1, g2[0]], [g2[1:]]; the cut moves back to the branch.
    assert [u.items for u in units] == [[0, 1, 2], [3, 4, 5]]
    assert [u.shared_prefix_len for u in units] == [32, 32]


def test_cap_keeps_at_least_half_a_unit():
    S = [1] * 16
    rows = [S + [2] * 16] + [S + [3] * 16 + [i] for i in range(7)]
    units = run(rows, unit_max_rows=4, block_size=16)
    # The branch after row 0 is in the first half: cutting there would leave a unit of 1.
    assert [len(u.items) for u in units] == [4, 4]
    assert units[0].shared_prefix_len == 16 and units[1].shared_prefix_len == 32


def test_cap_of_one():
    units = run([[1] * 20] * 3, unit_max_rows=1)
    assert [u.items for u in units] == [[0], [1], [2]]


def test_cut_window_ranges_cover_window():
    lens = [20] * 9
    lcps = [0, 20, 20, 3, 17, 17, 17, 17, 0]
    assert list(cut_window(lens, lcps, unit_max_rows=3, block_size=16, min_share=0)) == [
        (0, 3),
        (3, 6),
        (6, 8),
        (8, 9),
    ]
    assert list(cut_window([], [], 3)) == []


# ---- windows ------------------------------------------------------------------------


def test_windows_plan_separately_and_cover_all_keys():
    P = [4] * 16
    rows = [P + [i] for i in range(5)] + [[9] * 20 for _ in range(5)]
    rows = [rows[i] for i in (5, 0, 6, 1, 7, 2, 8, 3, 9, 4)]  # interleaved
    units = run(rows, window_rows=4, block_size=16)
    keys = [k for u in units for k in u.items]
    assert sorted(keys) == list(range(10))
    # Window 1 = keys 0..3, window 2 = 4..7, window 3 = 8..9; no unit spans two windows.
    windows = [set(range(0, 4)), set(range(4, 8)), set(range(8, 10))]
    for u in units:
        assert any(set(u.items) <= w for w in windows)
    assert [u.items for u in units] == [[1, 3], [0, 2], [5, 7], [4, 6], [9], [8]]


def test_window_reads_lazily():
    pulled = []

    def gen():
        for i in range(10):
            pulled.append(i)
            yield PlanItem(i, [i % 2] * 20)

    it = plan(gen(), window_rows=3)
    next(it)
    assert len(pulled) == 3  # only one window read before the first unit is produced


def test_empty_input():
    assert run([]) == []
    s = prefix_stats([])
    assert (s.rows, s.total_tokens, s.unique_tokens, s.optimum_cached_tokens) == (0, 0, 0, 0)
    assert s.optimum_hit_rate == 0.0 and s.exact


def test_bad_arguments():
    with pytest.raises(ValueError):
        run([[1]], window_rows=0)
    with pytest.raises(ValueError):
        run([[1]], unit_max_rows=0)
    with pytest.raises(ValueError):
        run([[1]], block_size=0)
    with pytest.raises(ValueError):
        run([[1]], block_size=4, stats=PrefixStats(block_size=16))
    with pytest.raises(ValueError):
        run([[-3]])


# ---- stats --------------------------------------------------------------------------


def test_prefix_stats_by_hand():
    # Trie of {abc, abd, ab, x}: a, ab, abc, abd, x = 5 nodes; total 3+3+2+1 = 9.
    a, b, c, d, x = 1, 2, 3, 4, 9
    s = prefix_stats([[a, b, c], [x], [a, b, d], [a, b]], block_size=2)
    assert (s.rows, s.total_tokens, s.unique_tokens) == (4, 9, 5)
    assert s.optimum_cached_tokens == 4
    # Sorted: ab, abc, abd, x; lcps 0, 2, 2, 0. Block 2, last token recomputed:
    # ab -> 0; abc -> min(2, 2) = 2; abd -> 2; x -> 0.
    assert s.block_optimum_tokens == 4 and s.partial_optimum_tokens == 4
    s3 = prefix_stats([[a, b, c], [x], [a, b, d], [a, b]], block_size=3)
    assert s3.block_optimum_tokens == 0 and s3.partial_optimum_tokens == 4
    assert s3.block_granularity_loss == 4


def test_prefix_stats_duplicates_and_block_granularity():
    P = list(range(37))  # a 37-token prefix: 2 full blocks of 16 + 5 tokens
    rows = [P + [100 + i, 200 + i] for i in range(4)] + [P + [100, 200]]
    s = prefix_stats(rows, block_size=16)
    assert s.total_tokens == 5 * 39
    assert s.unique_tokens == 37 + 4 * 2 == trie_nodes(rows)
    # Rows 2..4 of the group reuse 32 tokens (2 blocks); the duplicate reuses up to
    # len-1 = 38 -> 32 as well. Partial copy: 37, 37, 37 and 38 for the duplicate.
    assert s.block_optimum_tokens == 4 * 32 == simulate_block_cache(sorted(rows), 16)
    assert s.partial_optimum_tokens == 3 * 37 + 38
    assert partial_block_tokens(37, 16) == 5 and block_level_reuse(37, 16) == 32


def test_cacheable_prefix_tokens():
    assert cacheable_prefix_tokens(32, 32, 16) == 16  # whole prompt shared: last token recomputed
    assert cacheable_prefix_tokens(32, 33, 16) == 32
    assert cacheable_prefix_tokens(37, 100, 16) == 32
    assert cacheable_prefix_tokens(5, 0, 16) == 0


def test_stats_across_windows_are_an_estimate():
    rows = [[1, 2, 3, 4]] * 4
    one = prefix_stats(rows, block_size=2)
    two = prefix_stats(rows, block_size=2, window_rows=2)
    assert one.exact and not two.exact and two.windows == 2
    assert one.unique_tokens == 4 and two.unique_tokens == 8  # each window is a fresh trie
    assert two.optimum_cached_tokens <= one.optimum_cached_tokens


def test_plan_stats_match_prefix_stats_and_merge():
    rows = [[i % 3, i % 5, 7, 7] for i in range(40)]
    s = PrefixStats(block_size=2)
    list(plan(items_of(rows), window_rows=16, block_size=2, stats=s))
    ref = prefix_stats(rows, block_size=2, window_rows=16)
    assert s == ref
    m = PrefixStats(block_size=2)
    m.merge(s)
    m.merge(ref)
    assert m.total_tokens == 2 * s.total_tokens and m.windows == 2 * s.windows
    with pytest.raises(ValueError):
        m.merge(PrefixStats(block_size=4))


# ---- properties ---------------------------------------------------------------------

token_lists = st.lists(st.lists(st.integers(0, 3), max_size=12), max_size=40)


@settings(max_examples=200, deadline=None)
@given(
    rows=token_lists,
    window_rows=st.integers(1, 50),
    cap=st.integers(1, 8),
    block_size=st.integers(1, 5),
    min_share=st.sampled_from([0, 0.5, 1.0]),
)
def test_plan_properties(rows, window_rows, cap, block_size, min_share):
    stats = PrefixStats(block_size=block_size)
    units = list(
        plan(items_of(rows), window_rows, cap, block_size, min_share=min_share, stats=stats)
    )
    keys = [k for u in units for k in u.items]
    assert sorted(keys) == list(range(len(rows)))  # every key exactly once
    for u in units:
        toks = [rows[k] for k in u.items]
        assert 1 <= len(u.items) <= cap
        assert u.items == sorted(u.items, key=lambda k: (rows[k], k))  # depth-first, stable
        assert u.prompt_tokens == sum(map(len, toks))
        shared = min(lcp(toks[0], t) for t in toks) if len(toks) > 1 else len(toks[0])
        assert u.shared_prefix_len == shared
        if len(toks) > 1:
            assert shared >= 1
        # no unit spans two windows
        assert len({k // window_rows for k in u.items}) == 1
    window_of = [u.items[0] // window_rows for u in units]
    assert [u.window_end for u in units] == [a != b for a, b in zip(window_of, [*window_of[1:], None])]
    for a, b in zip(units, units[1:]):
        last, first = a.items[-1], b.items[0]
        if last // window_rows != first // window_rows:
            continue  # window boundary
        ra, rb = rows[last], rows[first]
        if lcp(ra, rb) >= join_threshold(len(ra), len(rb), block_size, min_share):
            assert len(a.items) >= (cap + 1) // 2  # a cap cut keeps at least half a unit
    assert stats.unique_tokens <= stats.total_tokens
    assert 0 <= stats.block_optimum_tokens <= stats.partial_optimum_tokens
    assert stats.partial_optimum_tokens <= stats.optimum_cached_tokens
    if len(rows) <= window_rows:
        assert stats.unique_tokens == trie_nodes(rows)
        assert stats.block_optimum_tokens == simulate_block_cache(sorted(rows), block_size)


@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(0, 2), max_size=7), max_size=5),
    block_size=st.integers(1, 3),
)
def test_block_optimum_is_best_over_all_orders(rows, block_size):
    best = max(
        (simulate_block_cache(p, block_size) for p in itertools.permutations(rows)), default=0
    )
    assert prefix_stats(rows, block_size).block_optimum_tokens == best


def test_windows_end_at_a_token_budget_too():
    """A window closes at window_rows rows or at the row that brings it to window_tokens tokens;
    each window's last unit says so (data-parallel workers regroup units by window)."""
    rows = [[1] * n for n in (5, 5, 5, 20, 1, 1, 30)]
    windows = list(iter_windows(enumerate(rows), window_rows=100, window_tokens=12))
    assert [sorted(w.keys) for w in windows] == [[0, 1, 2], [3], [4, 5, 6]]
    units = run(rows, window_rows=100, window_tokens=12, block_size=4)
    assert sorted(k for u in units for k in u.items) == list(range(7))
    bounds = [i for i, u in enumerate(units) if u.window_end]
    assert len(bounds) == 3 and bounds[-1] == len(units) - 1
    seen = 0
    for b, keys in zip(bounds, ([0, 1, 2], [3], [4, 5, 6])):       # each window's units, then its end
        assert sorted(k for u in units[seen:b + 1] for k in u.items) == keys
        seen = b + 1
    by_rows = run(rows, window_rows=3, block_size=4)                 # rows alone: windows of 3, 3, 1
    assert sum(u.window_end for u in by_rows) == 3


# ---- spreading a window over workers ------------------------------------------------


def test_spread_halves_one_unit_for_two_workers():
    """A small job sharing one prefix is one unit; two workers get a contiguous half each,
    with its own shared prefix and prompt tokens."""
    P = [7] * 20
    rows = [P + [1, 1], P + [1, 2, 3], P + [1, 5], P + [2, 0, 0, 0], P + [2, 5]]
    (unit,) = run(rows, block_size=4)
    assert unit.items == [0, 1, 2, 3, 4] and unit.shared_prefix_len == 20 and unit.window_end
    a, b = spread_units([unit], 2, rows.__getitem__)
    figures = [(u.items, u.shared_prefix_len, u.prompt_tokens, u.window_end) for u in (a, b)]
    assert figures == [([0, 1, 2], 21, 22 + 23 + 22, False), ([3, 4], 21, 24 + 22, True)]


def test_spread_splits_the_largest_until_every_worker_has_a_unit():
    rows = [[1] * 4, [1] * 5, [2] * 9, [2] * 9, [2] * 9, [3]]
    units = [WorkUnit([0, 1], 4, 9), WorkUnit([2, 3, 4], 9, 27),
             WorkUnit([5], 1, 1, window_end=True)]
    # 4 workers: [2, 3, 4] (27 tokens) splits into [2, 3] + [4]; then [2, 3] (18) beats [0, 1] (9)
    got = spread_units(units, 4, rows.__getitem__)
    assert [u.items for u in got] == [[0, 1], [2, 3], [4], [5]]
    assert [(u.shared_prefix_len, u.prompt_tokens) for u in got] == [(4, 9), (9, 18), (9, 9), (1, 1)]
    five = spread_units(units, 5, rows.__getitem__)
    assert [u.items for u in five] == [[0, 1], [2], [3], [4], [5]]
    # ties go to the earliest unit, and `size` decides what "largest" means
    even = spread_units(units, 4, rows.__getitem__, size=lambda u: 1)
    assert [u.items for u in even] == [[0], [1], [2, 3, 4], [5]]


def test_spread_leaves_enough_units_and_single_rows_alone():
    rows = [[1, 2], [1, 3], [4]]
    units = [WorkUnit([0, 1], 1, 4), WorkUnit([2], 1, 1, window_end=True)]
    assert spread_units(units, 2, rows.__getitem__) == units
    assert spread_units(units, 1, rows.__getitem__) == units
    singles = [WorkUnit([0], 2, 2), WorkUnit([1], 2, 2)]
    assert spread_units(singles, 8, rows.__getitem__) == singles
    assert spread_units([], 4, rows.__getitem__) == []
    a, b, c = spread_units(units, 8, rows.__getitem__)  # no more than one row a unit
    assert [a.items, b.items, c.items] == [[0], [1], [2]]
    assert [a.shared_prefix_len, b.shared_prefix_len] == [2, 2]


@settings(max_examples=200, deadline=None)
@given(rows=token_lists, cap=st.integers(1, 8), workers=st.integers(1, 6))
def test_spread_properties(rows, cap, workers):
    units = run(rows, unit_max_rows=cap, block_size=2)
    got = spread_units(units, workers, rows.__getitem__)
    assert got == spread_units(units, workers, rows.__getitem__)  # deterministic
    keys = [k for u in units for k in u.items]
    assert [k for u in got for k in u.items] == keys  # the same rows in the same order
    assert len(got) == (len(units) if len(units) >= workers else min(workers, len(rows)))
    assert [u.window_end for u in got] == [i == len(got) - 1 for i in range(len(got))]
    for u in got:
        toks = [rows[k] for k in u.items]
        assert u.prompt_tokens == sum(map(len, toks))
        shared = min(lcp(toks[0], t) for t in toks) if len(toks) > 1 else len(toks[0])
        assert u.shared_prefix_len == shared
