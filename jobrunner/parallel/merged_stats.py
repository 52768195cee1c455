"""A data-parallel run's record from its workers' records: sums, rates recomputed (stats.rates),
percentiles merged from each worker's latency sketch, and per-worker figures. The job summary over
every row (metrics included) is then computed from the parts, as for one worker (summary.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from jobrunner.common.run_stats import PREFIX_KEYS, REUSE_SUMS, ROW_SUMS, percentile, rates, summed

if TYPE_CHECKING:
    from jobrunner.config.sections import EngineOptions, OutputOptions, ParallelOptions

SKETCH_POINTS = 1001            # latency quantiles each worker sends for the merged percentiles


def worker_sketch(stats) -> dict:
    """Each latency series as (count, evenly spaced quantiles): enough to merge percentiles across workers."""
    out = {}
    for name in ("queue", "prefill", "decode"):
        values = sorted(getattr(stats, name, ()) or ())
        n = len(values)
        k = min(n, SKETCH_POINTS)
        # the values are a sample of at most LATENCY_SAMPLE rows; each point weighs for all the worker's rows
        points = [values[round(i * (n - 1) / (k - 1))] for i in range(k)] if k > 1 else values[:k]
        out[name] = {"n": getattr(stats, "latency_rows", n), "q": points}
    return out


def merge_stats(results: list[dict], engine: EngineOptions, parallel: ParallelOptions, output: OutputOptions, *,
                wall_s: float, devices: int, rounds: int,
                lost: list[int], planner: dict | None = None, lost_rows: int | None = None) -> dict:
    """One run's record from its workers' records (JobStats.summary keys, over the run's wall time), plus
    `workers`: each rank's own figures, and `data_parallel`: rounds, lost workers, units, balance.
    `planner`: the record of a plan made apart (a Ray job's driver: the rows it wrote, its plan's figures);
    `lost_rows`: the rows lost workers wrote, where the caller counted them. Of the job's options it reads
    the engine's ranks (`parallel`), its --quantization (`engine`) and --device-hourly-cost (`output`)."""
    summaries = [(v, v["summary"]) for v in results if v.get("summary")]
    first = min(summaries, key=lambda vs: (vs[0]["round"], vs[0]["slot"]))[1] if summaries else {}
    first = planner or first
    s = summed([x for _, x in summaries] + ([planner] if planner else []), ROW_SUMS + REUSE_SUMS)
    s["started_at"] = min((x["started_at"] for _, x in summaries if x.get("started_at")), default=None)
    # whose parts this run wrote (output/summary.killed_runs: not counted again)
    s["run_ids"] = sorted({x["run_id"] for x in [x for _, x in summaries] + [planner or {}] if x.get("run_id")})
    s["rows_skipped_done"] = first.get("rows_skipped_done", 0)      # every worker of round 0 saw the same
    s["duplicate_ids"] = first.get("duplicate_ids", 0)
    for name in ("images", "image_tokens", "image_errors"):    # counted by each worker's intake, over every row
        if name in first:
            s[name] = first[name]
    s.update(wall_s=max(wall_s, 1e-9), model_load_s=max((x.get("model_load_s") or 0 for _, x in summaries),
                                                        default=0.0),
             device=",".join(sorted({v["device"] for v in results})) or None,
             devices=devices * parallel.tensor_parallel,         # each worker's engine spans tensor_parallel devices
             device_hours=sum(x.get("device_hours") or 0 for _, x in summaries),
             model_weight_bytes=first.get("model_weight_bytes", 0),
             quantization=first.get("quantization", engine.quantization),      # as the workers resolved it (auto)
             interrupted=any(x.get("interrupted") for _, x in summaries))
    for name in ("queue", "prefill", "decode"):
        points = [(q, v["sketch"][name]["n"] / len(v["sketch"][name]["q"]))
                  for v in results if v.get("sketch") for q in v["sketch"][name]["q"]]
        for q in (50, 95, 99):
            s[f"{name}_s_p{q}"] = _weighted_percentile(points, q / 100)
    # the plan of round 0 covers every row of this run; its optimum is the run's
    s.update({k: first[k] for k in PREFIX_KEYS if k in first})
    engines = [x["engine"] for _, x in summaries if isinstance(x.get("engine"), dict)]
    if engines:
        s["engine"] = {k: sum(e.get(k) or 0 for e in engines) for k in engines[0]}
    s.update(rates(s, output.device_hourly_cost))
    workers = _per_worker(results)
    s["workers"] = workers
    runs = [w["run_s"] for w in workers.values()]
    s["data_parallel"] = {"workers": devices, "rounds": rounds, "lost_workers": sorted(lost),
                          "rows_by_lost_workers": _rows_by_lost_workers(summaries) if lost_rows is None else lost_rows,
                          "units": sum(w["units"] for w in workers.values()),
                          "balance": min(runs) / max(runs) if runs and max(runs) > 0 else None}
    return s


def _per_worker(results: list[dict]) -> dict:
    """Each rank's figures over its rounds: units, rows, tokens, run time, device-hours, its last exit code."""
    workers = {}
    for v in sorted(results, key=lambda v: (v["rank"], v["round"])):
        x = v.get("summary") or {}
        w = workers.setdefault(f"rank{v['rank']}", {"device": v["device"], "rounds": 0, "units": 0, "rows": 0,
                                                    "prompt_tokens": 0, "completion_tokens": 0, "run_s": 0.0,
                                                    "device_hours": 0.0, "exit_code": 0})
        w["rounds"] += 1
        w["units"] += v.get("units") or 0
        for k in ("rows", "prompt_tokens", "completion_tokens", "device_hours"):
            w[k] += x.get(k) or 0
        w["run_s"] += v.get("run_s") or 0.0
        w["exit_code"] = v["exit_code"]
        w["tokens_per_s"] = (w["prompt_tokens"] + w["completion_tokens"]) / max(w["run_s"], 1e-9)
    return workers


def _rows_by_lost_workers(summaries: list[tuple[dict, dict]]) -> int:
    """Rows a lost worker wrote before it died: the next round found them done, and nobody reported them."""
    by_round: dict[int, list[dict]] = {}
    for v, x in summaries:
        by_round.setdefault(v["round"], []).append(x)
    return sum(max(x.get("rows_skipped_done", 0) for x in by_round[r]) - max(
        x.get("rows_skipped_done", 0) for x in by_round[r - 1]) - sum(x["rows"] for x in by_round[r - 1])
        for r in by_round if r - 1 in by_round)


def _weighted_percentile(points: list[tuple[float, float]], q: float) -> float | None:
    if not points:
        return None
    if all(w == points[0][1] for _, w in points):
        return percentile([v for v, _ in points], q)
    points = sorted(points)
    total = sum(w for _, w in points)
    target, acc = q * total, 0.0
    for v, w in points:
        acc += w
        if acc >= target:
            return v
    return points[-1][0]
