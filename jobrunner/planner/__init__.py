"""Global prefix planner: order a dataset's prompts so shared prefixes run back to back.

    units = plan(PlanItem(key, token_ids) for ...)   # window by window, bounded memory
    stats = prefix_stats(token_lists)               # what a perfect / block cache could reuse

window.py orders a window (sort = depth-first trie walk), units.py cuts it into work
units (and spreads a window's units over data-parallel workers), stats.py holds the prefix
figures.
"""

from .stats import (
    PrefixStats,
    block_level_reuse,
    cacheable_prefix_tokens,
    partial_block_tokens,
    prefix_stats,
)
from .units import PlanItem, WorkUnit, cut_window, join_threshold, plan, spread_units
from jobrunner.engine import common_prefix as lcp  # the engine's prefix match and the planner agree by construction

__all__ = [
    "PlanItem",
    "PrefixStats",
    "WorkUnit",
    "block_level_reuse",
    "cacheable_prefix_tokens",
    "cut_window",
    "join_threshold",
    "lcp",
    "partial_block_tokens",
    "plan",
    "prefix_stats",
    "spread_units",
]
