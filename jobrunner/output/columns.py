"""How a row's columns are named in the output: result columns never replace input columns.

An output row holds the runner's result columns (RESULT_COLUMNS, the kind's own, the writer's
extra_json) and the row's input columns. An input column whose name a result column takes is
kept as `input_<name>` (again prefixed while that name is taken too), so a gold `label` column
survives a classify job that writes its prediction into `label`.
"""
from __future__ import annotations

from collections.abc import Iterable

RESULT_COLUMNS = ("id", "output", "finish_reason", "prompt_tokens", "cached_tokens", "completion_tokens",
                  "queue_s", "prefill_s", "decode_s", "error", "reused")
SPECULATION_COLUMNS = ("draft_tokens", "accepted_tokens")   # a job run with --speculative: drafted tokens verified, kept
# How a row was computed here, not what it got: null for a row reused from the cache or another row
RUN_COLUMNS = ("cached_tokens", "queue_s", "prefill_s", "decode_s", *SPECULATION_COLUMNS)
EXTRA_JSON = "extra_json"       # the writer's column for values that don't fit the pinned schema


def reserved_columns(kind_columns: Iterable[str]) -> frozenset[str]:
    """Every name a result column can take in a job whose kind adds `kind_columns`."""
    return frozenset(RESULT_COLUMNS) | frozenset(SPECULATION_COLUMNS) | frozenset(kind_columns) | {EXTRA_JSON}


def input_names(columns: Iterable[str], reserved: frozenset[str]) -> dict[str, str]:
    """Input column -> its name in the output; distinct, and none of them reserved."""
    columns = list(columns)
    taken = set(reserved) | set(columns)
    names = {}
    for c in columns:
        if c not in reserved:
            names[c] = c
            continue
        new = f"input_{c}"
        while new in taken:
            new = f"input_{new}"
        taken.add(new)
        names[c] = new
    return names
