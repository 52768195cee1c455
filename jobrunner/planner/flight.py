"""How many rows to keep submitted to the engine so shared prefix blocks stay cached.

The caller submits units in plan order and keeps about `rows_in_flight(...)` rows in the
engine. Rows of a unit run back to back, so while a unit runs some of its rows always
reference its prefix blocks, and referenced blocks are never evicted. The only risk is
oversubscription: more in-flight KV than the cache holds forces preemption and
eviction. So the in-flight count is what fits at once:

    shared  = full blocks of the shared prefix, held once for all rows of a unit
    private = prompt + output tokens past the shared blocks, rounded up to whole blocks
    rows    = (capacity - 2 * shared) // private           (at least 1)

Two shared prefixes are reserved because at a unit boundary the tail of one unit and
the head of the next run together. Averages make this an estimate: pass a capacity a
little under the real one for headroom.
"""

from __future__ import annotations

import math

from .stats import block_level_reuse


def rows_in_flight(
    kv_tokens_capacity: int,
    avg_prompt_tokens: float,
    avg_output_tokens: float,
    *,
    shared_prefix_tokens: int = 0,
    block_size: int = 16,
) -> int:
    """Rows to keep in the engine at once (>= 1); see the module docstring."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    shared = block_level_reuse(min(shared_prefix_tokens, int(avg_prompt_tokens)), block_size)
    private_tokens = max(1.0, avg_prompt_tokens + avg_output_tokens - shared)
    private = math.ceil(private_tokens / block_size) * block_size
    return max(1, int((kv_tokens_capacity - 2 * shared) // private))
