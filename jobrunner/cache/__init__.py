"""The result cache across runs: a result stored under a key of everything that determines it
(key.py), in Parquet shards bucketed by key (shards.py, store.py), pruned by age or size
(maintenance.py). jobrunner/cache/reuse.py hooks it, with dedup, into a job.

Modes: read-write (the default: serve hits, store what is computed), read-only (serve, never
store), write-only (store, never serve), refresh (recompute everything and store it; the newest
entry of a key wins from then on).
"""
from __future__ import annotations

import logging

from engine import EngineInfo

log = logging.getLogger("jobrunner")

CACHE_MODES = ("read-write", "read-only", "write-only", "refresh")
ENV_URL = "JOBRUNNER_CACHE_URL"
__all__ = ["CACHE_MODES", "ENV_URL", "open_store", "job_model_key"]


def open_store(url: str | None):
    """The CacheStore at url, or None without one; ValueError when the URL cannot be opened (its message
    says what to install), before any work starts."""
    if not url:
        return None
    from jobrunner.cache.store import CacheStore
    from jobrunner.storage import missing_backend_message
    try:
        return CacheStore(url)
    except ImportError as e:
        raise ValueError(f"--cache: {missing_backend_message(url, e)}") from None
    except (ValueError, OSError) as e:
        raise ValueError(f"--cache {url}: cannot open it ({e})") from None


def job_model_key(model: str, info: EngineInfo, quantization: str, kv_cache_dtype: str) -> bytes | None:
    """The model's part of every cache key (checkpoint content and numeric mode); None, with a
    warning, when the checkpoint cannot be identified (then nothing is cached)."""
    import torch

    from jobrunner.cache.identity import checkpoint_identity
    from jobrunner.cache.key import model_key
    try:
        checkpoint = checkpoint_identity(model)
    except Exception as e:  # noqa: BLE001 - an unidentifiable model is never cached, never fatal
        log.warning("result cache off: cannot identify the model %s (%s)", model, e)
        return None
    numeric_mode = {"dtype": info.dtype, "kv_dtype": info.kv_dtype, "kv_cache_dtype": kv_cache_dtype,
                    "quantization": quantization, "device": info.device_type,
                    "torch": ".".join(torch.__version__.split(".")[:2])}
    return model_key(checkpoint, numeric_mode)
