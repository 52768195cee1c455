"""What --deterministic (batch-invariant results, engine/run/batch_invariance.py) costs on CPU: the same
workloads in the default mode and in the invariant mode, side by side in one run, as a ratio.

    python -m benchmarks.determinism_cost                                  # default model, both workloads
    python -m benchmarks.determinism_cost --rows 8 --max-tokens 8 --repeats 1      # a quick look
    python -m benchmarks.determinism_cost --model /path/to/tiny-checkpoint

Workloads (benchmarks/workloads.py): shared-prefix classification (rows sharing a ~290-token few-shot
prefix, 3 labels) and free generation (64..256-token prompts, --max-tokens greedy tokens each). Each run
opens a fresh engine (load not timed, and no prefix cached from an earlier run) and times one
jobrunner.generate call over the rows; the modes alternate run by run so the machine's other load hits
both alike, and the median of --repeats runs is reported. ratio = invariant seconds / default seconds.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

MODES = {"default": False, "invariant": True}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                        platform.processor())
    except OSError:
        return platform.processor() or "unknown CPU"


def workloads(model: str, rows: int, max_tokens: int) -> dict[str, tuple[list[dict], dict]]:
    """name -> (rows, the job's options)."""
    from benchmarks.workloads import free_generation, our_tokenizer, shared_prefix
    tok = our_tokenizer(model)
    cls = shared_prefix(tok, n=rows)
    gen = free_generation(tok, n=max(1, rows // 2))
    return {"shared-prefix classify": (cls.rows, {"kind": "classify", "labels": ",".join(cls.labels)}),
            "free generation": (gen.rows, {"max_tokens": max_tokens, "ignore_eos": True})}


def timed_run(model: str, rows: list[dict], options: dict, deterministic: bool, threads: int | None) -> float:
    import jobrunner
    engine = dict(model=model, device="cpu", deterministic=deterministic, **({"threads": threads} if threads else {}))
    with jobrunner.open_engine(**engine) as session:
        session.generate(rows[:1], **options)           # warm: the kernels' first calls, the tokenizer
        t = time.perf_counter()
        df = session.generate(rows, **options)
        seconds = time.perf_counter() - t
    if df["error"].null_count() != len(df):
        raise RuntimeError(f"rows failed: {df['error'].drop_nulls().to_list()[:3]}")
    return seconds


def measure(model: str, rows: int, max_tokens: int, repeats: int, threads: int | None) -> list[dict]:
    out = []
    for name, (data, options) in workloads(model, rows, max_tokens).items():
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(repeats):
            for mode, deterministic in MODES.items():
                times[mode].append(timed_run(model, data, options, deterministic, threads))
        med = {m: statistics.median(v) for m, v in times.items()}
        out.append({"workload": name, "rows": len(data), "default_s": med["default"],
                    "invariant_s": med["invariant"], "ratio": med["invariant"] / med["default"],
                    "runs": times})
        print(f"{name:24s} {len(data):4d} rows  default {med['default']:7.2f} s  invariant {med['invariant']:7.2f} s"
              f"  ratio {med['invariant'] / med['default']:.2f}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, default=32, help="classification rows (generation: half as many)")
    ap.add_argument("--max-tokens", type=int, default=64, help="generated tokens a row (free generation)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: the engine's choice)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    print(f"CPU: {cpu_name()}; model {args.model}; median of {args.repeats} runs a mode, modes alternating")
    results = measure(args.model, args.rows, args.max_tokens, args.repeats, args.threads)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_name(), "model": args.model, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
