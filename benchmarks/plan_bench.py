"""Planner benchmark: plan N short shuffled prompts that share a few prefixes.

    python -m benchmarks.plan_bench --rows 100000
    python -m benchmarks.plan_bench --rows 1000000

Rows are generated lazily (never all in memory): a `--shared-frac` share of them start
with one of `--prefixes` random prefixes (8 to 24 tokens, so some span a full block and
some don't), the rest of each prompt is random, prompt lengths are prompt-tokens +- 5,
and prefixes are picked at random per row (shuffled order). Prints the generator's own
time, plan() throughput (with and without the stats side output) and peak RSS.
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Iterator

import numpy as np

from jobrunner.planner import PlanItem, PrefixStats, plan

VOCAB = 49152
CHUNK = 10_000


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def gen_items(args: argparse.Namespace) -> Iterator[PlanItem]:
    rng = np.random.default_rng(args.seed)
    plens = [8 + (7 * i) % 17 for i in range(args.prefixes)]  # 8..24 tokens
    prefixes = [rng.integers(0, VOCAB, n).tolist() for n in plens]
    max_len = args.prompt_tokens + 5
    key = 0
    while key < args.rows:
        n = min(CHUNK, args.rows - key)
        body = rng.integers(0, VOCAB, (n, max_len)).tolist()
        lens = rng.integers(args.prompt_tokens - 5, max_len + 1, n).tolist()
        which = rng.integers(0, args.prefixes, n).tolist()
        shared = (rng.random(n) < args.shared_frac).tolist()
        for i in range(n):
            if shared[i]:
                p = prefixes[which[i]]
                toks = p + body[i][: max(1, lens[i] - len(p))]
            else:
                toks = body[i][: lens[i]]
            yield PlanItem(key, toks)
            key += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--prompt-tokens", type=int, default=30)
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--shared-frac", type=float, default=0.8)
    ap.add_argument("--window-rows", type=int, default=50_000)
    ap.add_argument("--unit-max-rows", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"rows={args.rows} prompt_tokens~{args.prompt_tokens} prefixes={args.prefixes} "
          f"shared_frac={args.shared_frac} window_rows={args.window_rows} "
          f"unit_max_rows={args.unit_max_rows} block_size={args.block_size}")
    print(f"rss at start: {rss_mb():.0f} MB")

    t0 = time.perf_counter()
    n = sum(1 for _ in gen_items(args))
    t_gen = time.perf_counter() - t0
    print(f"generator alone: {t_gen:.2f} s ({n / t_gen:,.0f} rows/s); peak rss {rss_mb():.0f} MB")

    for with_stats in (False, True):
        stats = PrefixStats(block_size=args.block_size) if with_stats else None
        t0 = time.perf_counter()
        units = rows = big = 0
        for u in plan(gen_items(args), args.window_rows, args.unit_max_rows,
                      args.block_size, stats=stats):
            units += 1
            rows += len(u.items)
            big += len(u.items) > 1
        t = time.perf_counter() - t0
        tp = t - t_gen
        label = "plan+stats" if with_stats else "plan"
        print(f"{label}: {t:.2f} s incl. generator, {tp:.2f} s planning -> "
              f"{rows / tp:,.0f} rows/s ({rows / t:,.0f} incl. generator); "
              f"{units:,} units, {big:,} with >1 row; peak rss {rss_mb():.0f} MB")
        if stats is not None:
            print(f"  total {stats.total_tokens:,} tok, unique {stats.unique_tokens:,}, "
                  f"optimum cached {stats.optimum_cached_tokens:,} "
                  f"({stats.optimum_hit_rate:.1%}), block optimum "
                  f"{stats.block_optimum_tokens:,} ({stats.block_optimum_hit_rate:.1%}), "
                  f"partial-block optimum {stats.partial_optimum_tokens:,}; "
                  f"windows {stats.windows} (exact={stats.exact})")


if __name__ == "__main__":
    main()
