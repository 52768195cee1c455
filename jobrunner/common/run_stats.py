"""A run's figures: tokens, cache hits against their optimum, throughput, latency percentiles, cost.

JobStats accumulates one run (one process) and gives its record; `rates` derives throughput, cache
hit rates and cost from sums, the same way for a run, for a data-parallel run over its workers
(parallel/stats.py) and for a job over its recorded runs (summary).

Rows whose result was reused (the `reused` column: served by the result cache or a copy of another
row, jobrunner/cache/reuse.py) count in rows, rows_ok/rows_failed and the prompt and completion tokens (they
are the output's), but are no work done: throughput, the prefix-cache hit rate, the cost per million
tokens and the latency percentiles are over the computed rows alone (rows_computed, computed_prompt_tokens,
computed_completion_tokens). A failed row whose prompt never reached a step of the engine (a duplicate id,
an unreadable record: no prompt tokens; a prompt over the context, refused by the engine's checks: its
prompt_tokens column keeps the count, its timings are null) is not computed, and its prompt tokens count
in no job figure. A row of n > 1 samples is one row: its prompt counts once.

Each run also has a time record (`time_record`): its wall and device time so far, which the writer stores
in every part it flushes (output/parts.py), so a run killed with SIGKILL still counts in the summary.
"""
from __future__ import annotations

import os
import random
import time
import uuid
from array import array

LATENCY_SAMPLE = 100_000    # rows whose latencies are kept: percentiles exact up to here, estimated past it
# The prefix plan's figures a run records: sums over the rows it planned, so they add up over runs.
PREFIX_SUMS = ("planned_prompt_tokens", "optimum_cached_tokens", "block_optimum_cached_tokens",
               "partial_block_optimum_cached_tokens")
PREFIX_KEYS = PREFIX_SUMS + ("optimum_exact",)
ROW_SUMS = ("rows", "rows_ok", "rows_failed", "prompt_tokens", "cached_tokens", "completion_tokens",
            "rows_computed", "computed_prompt_tokens", "computed_completion_tokens")
# A record written before reused rows were told apart counted every row as computed.
COMPUTED_BEFORE = {"rows_computed": "rows", "computed_prompt_tokens": "prompt_tokens",
                   "computed_completion_tokens": "completion_tokens"}
RUN_ID_ENV = "JOBRUNNER_RUN_ID"     # a data-parallel launcher's workers share their run's id


def reached_engine(error, prompt_tokens, prefill_s) -> bool:
    """Whether a row's prompt reached the engine's steps (a reused row: its leader's): ok, or failed there
    (with its prompt's tokens and its timings; a prompt the engine's checks refused has null timings)."""
    return error is None or (bool(prompt_tokens) and prefill_s is not None)


# Rows whose result was reused (jobrunner/cache/reuse.py): a copy's, the cache's, and the tokens not computed.

REUSE_SUMS = ("rows_reused", "rows_from_cache", "tokens_saved", "cache_lookups", "cache_lookup_s", "cache_lookup_cpu_s")
# A run's images (jobrunner/images), in the rows the intake made requests of (computed, reused or from the
# cache: a row's prompt_tokens already hold its image tokens), and the rows an image failed. Recorded only
# by a run that read an image, so a text job's record is as it was.
IMAGE_SUMS = ("images", "image_tokens", "image_errors")


def percentile(values, q: float) -> float | None:
    if not len(values):
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def utc_iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


class JobStats:
    """Accumulates a run's figures in bounded memory.

    Latencies: queue, prefill and decode hold the three latencies of a uniform random sample of at
    most LATENCY_SAMPLE of the `latency_rows` ok rows (reservoir sampling, one draw a row, so a
    row's three values stay together; seeded, so a rerun picks the same sample). A sample of 100k
    puts a percentile's rank within about sqrt(q(1 - q) / 100k) of the truth: +-0.03 points at p99.
    """

    def __init__(self):
        self.start = time.time()
        self.run_id = os.environ.get(RUN_ID_ENV) or uuid.uuid4().hex[:16]
        self.rows = self.rows_ok = self.rows_failed = self.rows_skipped = self.duplicate_ids = 0
        self.rows_skipped_failed = 0        # of rows_skipped, those an earlier run wrote as error rows (progress)
        self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0
        self.rows_computed = self.computed_prompt_tokens = self.computed_completion_tokens = 0
        self.latency_rows = 0
        self.rows_reused = self.rows_from_cache = self.tokens_saved = self.cache_lookups = 0
        self.cache_lookup_s = self.cache_lookup_cpu_s = 0.0     # wall and this process's CPU seconds
        self.images = self.image_tokens = self.image_errors = 0     # IMAGE_SUMS
        self.queue, self.prefill, self.decode = array("d"), array("d"), array("d")
        self._rng = random.Random(0)

    def add_row(self, row: dict) -> None:
        """An input row (with n > 1 samples: its first; add_sample for the others)."""
        self.rows += 1
        if row.get("error") is None:
            self.rows_ok += 1
        else:
            self.rows_failed += 1
        reached = reached_engine(row.get("error"), row.get("prompt_tokens"), row.get("prefill_s"))
        prompt = (row.get("prompt_tokens") or 0) if reached else 0
        self.prompt_tokens += prompt
        self.add_sample(row)
        if not row.get("reused"):
            self.rows_computed += reached
            self.cached_tokens += row.get("cached_tokens") or 0
            self.computed_prompt_tokens += prompt
            if row.get("error") is None:
                self.add_latencies(row.get("queue_s") or 0.0, row.get("prefill_s") or 0.0, row.get("decode_s") or 0.0)

    def add_sample(self, row: dict) -> None:
        """A sample's completion tokens (every sample of a row: add_row adds its first)."""
        self.completion_tokens += row.get("completion_tokens") or 0
        if not row.get("reused"):
            self.computed_completion_tokens += row.get("completion_tokens") or 0

    def add_latencies(self, queue: float, prefill: float, decode: float) -> None:
        """One ok computed row's latencies."""
        self.latency_rows += 1
        if len(self.queue) < LATENCY_SAMPLE:
            self.queue.append(queue)
            self.prefill.append(prefill)
            self.decode.append(decode)
            return
        j = self._rng.randrange(self.latency_rows)      # Algorithm R: keep this row with prob. sample / rows
        if j < LATENCY_SAMPLE:
            self.queue[j], self.prefill[j], self.decode[j] = queue, prefill, decode

    def row_figures(self) -> dict:
        """What the rows alone say: counts, tokens, cache hit rate, latency percentiles."""
        s = {k: getattr(self, k) for k in ROW_SUMS}
        s["cache_hit_rate"] = self.cached_tokens / self.computed_prompt_tokens if self.computed_prompt_tokens else 0.0
        for name, values in (("queue", self.queue), ("prefill", self.prefill), ("decode", self.decode)):
            for q in (50, 95, 99):
                s[f"{name}_s_p{q}"] = percentile(values, q / 100)
        return s

    def summary(self, *, device: str, devices: int = 1, model_weight_bytes: int = 0, quantization: str = "none",
                prefix=None, engine_counters=None, device_hourly_cost: float | None = None, load_s: float = 0.0,
                interrupted: bool = False) -> dict:
        """This run's record: its rows' figures, its time, throughput, prefix optimum and cost."""
        s = {**self.time_record(device=device, devices=devices, load_s=load_s, quantization=quantization),
             **self.row_figures(), "rows_skipped_done": self.rows_skipped, "duplicate_ids": self.duplicate_ids,
             "model_weight_bytes": model_weight_bytes, "interrupted": interrupted,
             **{k: getattr(self, k) for k in REUSE_SUMS}}
        if self.images or self.image_errors:
            s.update({k: getattr(self, k) for k in IMAGE_SUMS})
        s.update(prefix_figures(prefix))
        if engine_counters is not None:
            s["engine"] = dict(engine_counters)
        s.update(rates(s, device_hourly_cost))
        return s


    def time_record(self, *, device: str, devices: int, load_s: float, quantization: str,
                    device_hourly_cost: float | None = None) -> dict:
        """The run's time so far (and the rows it wrote; with a price, its cost): what each part it
        flushes records, so the run counts in the summary however it ends."""
        wall = max(time.time() - self.start, 1e-9)
        s = {"run_id": self.run_id, "started_at": utc_iso(self.start), "wall_s": wall, "model_load_s": load_s,
             "device": device, "devices": devices, "device_hours": wall * devices / 3600,
             "quantization": quantization, **{k: getattr(self, k) for k in ROW_SUMS}}
        if device_hourly_cost is not None:
            s["cost_usd"] = s["device_hours"] * device_hourly_cost
        return s


def summed(records, keys) -> dict:
    """Each key's sum over run records (a record from before COMPUTED_BEFORE's keys: all its rows computed)."""
    return {k: sum(r.get(k, r.get(COMPUTED_BEFORE.get(k))) or 0 for r in records) for k in keys}


def prefix_figures(prefix) -> dict:
    """A PrefixStats' figures under PREFIX_KEYS; none when nothing was planned."""
    if prefix is None or not prefix.total_tokens:
        return {}
    return {"planned_prompt_tokens": prefix.total_tokens, "optimum_cached_tokens": prefix.optimum_cached_tokens,
            "block_optimum_cached_tokens": prefix.block_optimum_tokens,
            # the engine also copies partial last blocks, so it can pass the full-block optimum
            "partial_block_optimum_cached_tokens": prefix.partial_optimum_tokens, "optimum_exact": prefix.exact}


def rates(s: dict, device_hourly_cost: float | None) -> dict:
    """Figures derived from sums (ROW_SUMS, wall_s, device_hours, PREFIX_SUMS when planned):
    throughput over wall_s and cache hits (of the computed rows), cache hits against the prefix
    optimum, and with a price the cost."""
    wall = max(s["wall_s"], 1e-9)
    computed = {k: s.get(k, s[before]) for k, before in COMPUTED_BEFORE.items()}
    prompt = computed["computed_prompt_tokens"]
    tokens = prompt + computed["computed_completion_tokens"]
    out = {"prefill_tokens_per_s": prompt / wall, "decode_tokens_per_s": computed["computed_completion_tokens"] / wall,
           "rows_per_s": computed["rows_computed"] / wall,
           "cache_hit_rate": s["cached_tokens"] / prompt if prompt else 0.0}
    if s.get("planned_prompt_tokens"):
        out["optimum_cache_hit_rate"] = s["optimum_cached_tokens"] / s["planned_prompt_tokens"]
        block = s["block_optimum_cached_tokens"]
        out["cache_hit_of_block_optimum"] = s["cached_tokens"] / block if block else None
    if device_hourly_cost is not None:
        cost = s["device_hours"] * device_hourly_cost
        out["cost_usd"] = cost
        # one device-hour price over the computed tokens: a token costs the same whichever side it is on
        out["cost_per_million_tokens"] = cost / tokens * 1e6 if tokens else None
        out["cost_saved_usd"] = cost_saved(cost, tokens, s.get("tokens_saved") or 0)
    return out


def cost_saved(cost: float, computed: int, saved: int) -> float | None:
    """What the reused rows' tokens would have cost at the price of those computed (None: none computed)."""
    return cost * saved / computed if computed > 0 else None
