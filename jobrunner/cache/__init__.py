"""The result cache across runs: a result stored under a key of everything that determines it
(key.py), in Parquet shards bucketed by key (shards.py, store.py), pruned by age or size
(maintenance.py). jobrunner/cache/reuse.py hooks it, with dedup, into a job. The package itself holds
only the environment variable's name, which the command line reads at start (no pyarrow or fsspec for
it; the --cache-mode values are the config's, config/sections.py): a job opens its store with store.open_store and keys its model with
key.job_model_key.

Modes: read-write (the default: serve hits, store what is computed), read-only (serve, never
store), write-only (store, never serve), refresh (recompute everything and store it; the newest
entry of a key wins from then on).
"""
from __future__ import annotations

ENV_URL = "JOBRUNNER_CACHE_URL"     # the cache URL when --cache is not given
__all__ = ["ENV_URL"]
