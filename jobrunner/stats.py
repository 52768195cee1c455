"""The job summary: tokens, cache hits against their optimum, throughput, latency percentiles, cost."""
from __future__ import annotations

import time
from array import array


def percentile(values, q: float) -> float | None:
    if not len(values):
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


class JobStats:
    """Accumulates per-row figures in compact arrays (8 bytes a row per latency)."""

    def __init__(self):
        self.start = time.time()
        self.rows = self.rows_ok = self.rows_failed = self.rows_skipped = self.duplicate_ids = 0
        self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0
        self.queue, self.prefill, self.decode = array("d"), array("d"), array("d")

    def add_row(self, row: dict) -> None:
        self.rows += 1
        if row.get("error") is None:
            self.rows_ok += 1
        else:
            self.rows_failed += 1
        self.prompt_tokens += row.get("prompt_tokens") or 0
        self.cached_tokens += row.get("cached_tokens") or 0
        self.completion_tokens += row.get("completion_tokens") or 0
        if row.get("error") is None:
            self.queue.append(row.get("queue_s") or 0.0)
            self.prefill.append(row.get("prefill_s") or 0.0)
            self.decode.append(row.get("decode_s") or 0.0)

    def summary(self, *, device: str, devices: int = 1, model_weight_bytes: int = 0, quantization: str = "none",
                prefix=None, engine_counters=None, device_hourly_cost: float | None = None,
                job_metrics: dict | None = None, load_s: float = 0.0, interrupted: bool = False) -> dict:
        wall = max(time.time() - self.start, 1e-9)
        s = {
            "rows": self.rows, "rows_ok": self.rows_ok, "rows_failed": self.rows_failed,
            "rows_skipped_done": self.rows_skipped, "duplicate_ids": self.duplicate_ids,
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens, "wall_s": wall, "model_load_s": load_s,
            "prefill_tokens_per_s": self.prompt_tokens / wall, "decode_tokens_per_s": self.completion_tokens / wall,
            "rows_per_s": self.rows / wall,
            "cache_hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "device": device, "devices": devices, "device_hours": wall * devices / 3600,
            "model_weight_bytes": model_weight_bytes, "quantization": quantization, "interrupted": interrupted,
        }
        for name, values in (("queue", self.queue), ("prefill", self.prefill), ("decode", self.decode)):
            for q in (50, 95, 99):
                s[f"{name}_s_p{q}"] = percentile(values, q / 100)
        if prefix is not None and prefix.total_tokens:
            s["optimum_cached_tokens"] = prefix.optimum_cached_tokens
            s["optimum_cache_hit_rate"] = prefix.optimum_hit_rate
            s["block_optimum_cached_tokens"] = prefix.block_optimum_tokens
            s["cache_hit_of_block_optimum"] = (self.cached_tokens / prefix.block_optimum_tokens
                                               if prefix.block_optimum_tokens else None)
            # the engine also copies partial last blocks, so it can pass the full-block optimum
            s["partial_block_optimum_cached_tokens"] = prefix.partial_optimum_tokens
            s["optimum_exact"] = prefix.exact
        if engine_counters is not None:
            s["engine"] = dict(engine_counters)
        if device_hourly_cost is not None:
            cost = s["device_hours"] * device_hourly_cost
            s["cost_usd"] = cost
            # One device-hour price over all tokens: a token costs the same whichever side it is on.
            total = self.prompt_tokens + self.completion_tokens
            per_million = cost / total * 1e6 if total else None
            s["cost_per_million_input_tokens"] = per_million
            s["cost_per_million_output_tokens"] = per_million
        if job_metrics:
            s["metrics"] = job_metrics
        return s
