"""The job summary: tokens, cache hits against their optimum, throughput, latency percentiles, cost."""
from __future__ import annotations

import random
import time
from array import array

LATENCY_SAMPLE = 100_000    # rows whose latencies are kept: percentiles exact up to here, estimated past it


def percentile(values, q: float) -> float | None:
    if not len(values):
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


class JobStats:
    """Accumulates a job's figures in bounded memory.

    Latencies: queue, prefill and decode hold the three latencies of a uniform random sample of at
    most LATENCY_SAMPLE of the `latency_rows` ok rows (reservoir sampling, one draw a row, so a
    row's three values stay together; seeded, so a rerun picks the same sample). A sample of 100k
    puts a percentile's rank within about sqrt(q(1 - q) / 100k) of the truth: +-0.03 points at p99.
    """

    def __init__(self):
        self.start = time.time()
        self.rows = self.rows_ok = self.rows_failed = self.rows_skipped = self.duplicate_ids = 0
        self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0
        self.latency_rows = 0
        self.queue, self.prefill, self.decode = array("d"), array("d"), array("d")
        self._rng = random.Random(0)

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
            self._add_latencies(row.get("queue_s") or 0.0, row.get("prefill_s") or 0.0, row.get("decode_s") or 0.0)

    def _add_latencies(self, queue: float, prefill: float, decode: float) -> None:
        self.latency_rows += 1
        if len(self.queue) < LATENCY_SAMPLE:
            self.queue.append(queue)
            self.prefill.append(prefill)
            self.decode.append(decode)
            return
        j = self._rng.randrange(self.latency_rows)      # Algorithm R: keep this row with prob. sample / rows
        if j < LATENCY_SAMPLE:
            self.queue[j], self.prefill[j], self.decode[j] = queue, prefill, decode

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
