"""What `jobrunner stats` and the end of `jobrunner submit` print: the ten-line summary a person reads
(`summary_lines`), and every figure one a line (`print_all`)."""
from __future__ import annotations

import json
import shlex

import click

from jobrunner.common.durations import duration


def print_summary(s: dict, output: str) -> None:
    """The summary a person reads at the end of a job: about ten lines. `jobrunner stats --all`
    prints every figure, `--json` the whole _stats.json."""
    click.echo("\n".join(summary_lines(s, output)))


def summary_lines(s: dict, output: str) -> list[str]:
    """Rows, tokens, cache hits, time, throughput, cost, metrics, device, and where the output and
    the full figures are; a line only when the summary has its figures (a partial one has no times)."""
    lines = [("output", output), *_row_lines(s), *_time_and_cost_lines(s)]
    metrics = s.get("metrics")
    if isinstance(metrics, dict):
        shown = [f"{k} {_number(v)}" for k, v in metrics.items() if not isinstance(v, (dict, list)) and v is not None]
        if shown:
            lines.append(("metrics", ", ".join(shown)))
    if s.get("device"):
        devices = s.get("devices") or 1
        device = str(s["device"]) + (f" x {devices}" if devices > 1 else "")
        if s.get("quantization") not in (None, "none"):
            device += f", {s['quantization']} weights"
        lines.append(("device", device))
    if s.get("interrupted"):
        lines.append(("interrupted", "run the same command again to resume"))
    lines.append(("report", f"jobrunner report {shlex.quote(output)} (one HTML page: plots, failed rows, config)"))
    lines.append(("all figures", f"jobrunner stats --all {shlex.quote(output)} (or _stats.json)"))
    return [f"{k:12s} {v}" for k, v in lines]


def _row_lines(s: dict) -> list[tuple[str, str]]:
    """Rows, constrained and schema outcomes, tokens and cache hits, images, reuse."""
    lines = []
    if "rows" in s:
        failed = s.get("rows_failed") or 0
        note = " (their errors are in the `error` column)" if failed else ""
        of = ""
        if s.get("dataset_rows") is not None:      # a partial summary: what is left of the dataset
            of = f" of the dataset's {s['dataset_rows']:,} ({max(s['dataset_rows'] - s['rows'], 0):,} left)"
        lines.append(("rows", f"{s['rows']:,}{of}: {s.get('rows_ok', 0):,} ok, {failed:,} failed{note}"))
    if isinstance(s.get("openai_output"), dict):   # one line per input line, in one of the two files
        lines.append(("openai", ", ".join(f"{n:,} lines in {name}" for name, n in s["openai_output"].items())))
    if s.get("constrained_incomplete"):
        lines.append(("incomplete", f"{s['constrained_incomplete']:,} constrained outputs cut by --max-tokens "
                                    f"before their grammar ended (finish_reason length)"))
    if s.get("schema_invalid"):
        lines.append(("schema", f"{s['schema_invalid']:,} of {s['schema_invalid'] + s.get('schema_valid', 0):,} "
                                f"outputs under a JSON schema do not validate (schema_valid false)"))
    if "prompt_tokens" in s:
        lines.append(("tokens", f"{s['prompt_tokens']:,} prompt, {s.get('completion_tokens', 0):,} completion"))
        hits = f"{s.get('cache_hit_rate') or 0:.1%} of prompt tokens from the prefix cache"
        if s.get("optimum_cache_hit_rate") is not None:
            hits += f" ({_optimum(s)})"
        lines.append(("cache hits", hits))
    engine = s.get("engine") or {}
    if engine.get("draft_tokens"):      # --speculative, this run's engine
        drafted, kept = engine["draft_tokens"], engine.get("accepted_tokens") or 0
        lines.append(("speculation", f"{kept:,} of {drafted:,} drafted tokens accepted ({kept / drafted:.1%}), "
                                     f"{engine.get('steps') or 0:,} steps"))
    if s.get("images") or s.get("image_errors"):
        bad = f", {s['image_errors']:,} failed their rows" if s.get("image_errors") else ""
        lines.append(("images", f"{s.get('images') or 0:,} ({s.get('image_tokens') or 0:,} of the prompt tokens){bad}"))
    if s.get("rows_reused") or s.get("rows_from_cache"):
        saved = f" (~{_usd(s['cost_saved_usd'])} saved)" if s.get("cost_saved_usd") is not None else ""
        lines.append(("reused", f"{s.get('rows_from_cache') or 0:,} rows from the cache, {s.get('rows_reused') or 0:,} "
                                f"copies of other rows; {s.get('tokens_saved') or 0:,} tokens not computed{saved}"))
    return lines


def _time_and_cost_lines(s: dict) -> list[tuple[str, str]]:
    lines = []
    if s.get("wall_s") is not None:
        runs = s.get("runs_recorded") or 1
        wall = duration(s["wall_s"]) + (f" over {runs} runs" if runs > 1 else "")
        if s.get("model_load_s"):
            wall += f", plus {duration(s['model_load_s'])} loading the model"
        lines.append(("wall time", wall))
    if s.get("decode_tokens_per_s") is not None:
        lines.append(("throughput", f"{_rate(s['decode_tokens_per_s'])} completion tokens/s, "
                                    f"{_rate(s.get('prefill_tokens_per_s') or 0)} prompt tokens/s, "
                                    f"{_rate(s.get('rows_per_s') or 0)} rows/s"))
    if s.get("cost_usd") is not None:
        per_m = s.get("cost_per_million_tokens")
        lines.append(("cost", _usd(s["cost_usd"]) + (f", {_usd(per_m)} per million tokens" if per_m else "")))
    elif "wall_s" in s:
        lines.append(("cost", "not priced: give --device-hourly-cost (USD per device-hour)"))
    return lines


def _optimum(s: dict) -> str:
    """The prefix plan's optimum: what a cache of full KV blocks could reach (what the engine's can), and a
    token-level cache; over the dataset only when it fit one planning window."""
    block = (s.get("block_optimum_cached_tokens") or 0) / s["planned_prompt_tokens"]
    over = "the dataset's" if s.get("optimum_exact") else "each planning window's"
    return f"{over} optimum: {block:.1%} in full KV blocks, {s['optimum_cache_hit_rate']:.1%} token by token"


def dataset_rows(manifest: dict) -> dict:
    """{"dataset_rows": the rows of the job's dataset} where it can be counted from here, else {}."""
    from jobrunner.dataset import count_rows
    dataset = (manifest.get("config") or {}).get("dataset")
    try:
        n = count_rows(dataset, manifest.get("dataset_format") or "auto") if dataset else None
    except Exception:  # noqa: BLE001 - informative only: a dataset moved or unreadable from here
        return {}
    return {} if n is None else {"dataset_rows": n}


def _number(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _usd(v: float) -> str:
    return f"${v:,.2f}" if v >= 1 else f"${v:.4f}" if v >= 0.01 else f"${v:.6f}"


def _rate(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


_RUN_LINE = ("started_at", "rows", "rows_skipped_done", "wall_s", "decode_tokens_per_s", "device", "interrupted")


def print_all(s: dict, output: str) -> None:
    """Every figure of the summary, one a line (`jobrunner stats --all`)."""
    def show(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return json.dumps(v) if isinstance(v, (dict, list)) else v

    lines = [f"output  {output}"]
    for k, v in s.items():
        if not isinstance(v, (dict, list)):
            lines.append(f"{k:32s} {show(v)}")
    for k in ("metrics", "engine"):
        if isinstance(s.get(k), dict):
            lines.append(f"{k}:")
            lines.extend(f"  {kk:30s} {show(vv)}" for kk, vv in s[k].items())
    if s.get("runs"):
        lines.append("runs:")
        lines.extend(f"  {i}  " + "  ".join(f"{k} {show(r[k])}" for k in _RUN_LINE if k in r)
                     for i, r in enumerate(s["runs"], 1))
    click.echo("\n".join(lines))
