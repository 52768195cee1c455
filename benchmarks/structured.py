"""Structured output's cost: constrained against unconstrained generation of the same length.

    python -m benchmarks.structured                                 # default model, 64 rows, 128 tokens, CPU
    python -m benchmarks.structured -m dummy:llama-3.1-8b --num-prompts 256   # the GPU line (gpu_check.sh)

64 chat prompts ask for an extraction (the `person` schema of benchmarks/grammar_schemas.py). The
constrained run generates under the JSON schema (up to --max-tokens); the unconstrained run then
generates exactly as many tokens for each row (ignore_eos), so both runs have the same batch
composition step by step and the per-token times compare like for like (prefix caching off, so
both runs compute every prompt; a warm-up at the same shape first). Reports seconds per
generated token of each, their ratio (the target: at most 1.10 on CPU, 1.05 on a GPU), the host's
mask time per constrained step and the compile time of each schema (first and cached).
"""
from __future__ import annotations

import argparse
import json
import time

from benchmarks.grammar_schemas import EXTRACTION_SCHEMAS

PEOPLE = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Katherine Johnson", "Edsger Dijkstra", "Barbara Liskov",
          "Donald Knuth", "Margaret Hamilton"]
CITIES = ["London", "Manchester", "New York", "Houston", "Amsterdam", "Boston", "Stanford", "Paoli"]


def prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = (f"Extract the person as JSON (name, age, email, employed, address, skills, role): "
                f"{PEOPLE[i % 8]}, aged {30 + i}, lives at {i + 1} Main Street, {CITIES[(i * 3) % 8]}; "
                f"works as an engineer; skills: maths, writing. Contact: person{i}@example.com.")
        if getattr(tokenizer, "has_chat_template", False):
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        out.append(tokenizer.encode(text))
    return out


def timed(engine, requests, sync) -> float:
    sync()
    t0 = time.perf_counter()
    engine.generate(requests)
    sync()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    import torch

    from jobrunner.engine.config.engine_config import EngineConfig
    from jobrunner.engine.core.engine import Engine
    from jobrunner.engine.api.request import Constraint, Request, SamplingParams
    from jobrunner.models.known import resolve_model

    ap = argparse.ArgumentParser(prog="python -m benchmarks.structured", description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--kv-cache-memory", type=int, help="bytes (default: the engine's)")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON line too")
    args = ap.parse_args(argv)

    # no prefix cache: the second run would find the first's prompts cached
    engine = Engine(EngineConfig(model=resolve_model(args.model), device=args.device,
                                 kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=False))
    sync = torch.cuda.synchronize if engine.rt.device.type == "cuda" else (lambda: None)
    schema = Constraint("json_schema", json.dumps(EXTRACTION_SCHEMAS["person"]))
    ids = prompts(engine.tokenizer, args.num_prompts)

    compile_ms = {}
    for name, s in EXTRACTION_SCHEMAS.items():
        t0 = time.perf_counter()
        engine.grammars.compile(Constraint("json_schema", json.dumps(s)))
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.grammars.compile(Constraint("json_schema", json.dumps(s)))
        compile_ms[name] = (round(first * 1000, 2), round((time.perf_counter() - t0) * 1000, 3))

    # warm-up at the timed runs' shape (the first batches after loading run slower)
    engine.generate([Request(f"w{i}", p, SamplingParams(max_tokens=16, ignore_eos=True)) for i, p in enumerate(ids)])
    engine.generate([Request(f"v{i}", p, SamplingParams(max_tokens=4), constraint=schema) for i, p in enumerate(ids)])
    engine.reset_counters()
    reqs = [Request(f"c{i}", p, SamplingParams(max_tokens=args.max_tokens), constraint=schema)
            for i, p in enumerate(ids)]
    t0 = time.perf_counter()
    outs = engine.generate(reqs)
    sync()
    constrained_s = time.perf_counter() - t0
    c = engine.counters()
    tokens, steps, mask_s = c.generated_tokens, c.steps, c.mask_s
    lengths = [o.completion_tokens for o in outs]
    valid = sum(o.finish_reason == "stop" for o in outs)

    engine.reset_counters()
    free = [Request(f"u{i}", p, SamplingParams(max_tokens=n, ignore_eos=True))
            for i, (p, n) in enumerate(zip(ids, lengths)) if n]
    free_s = timed(engine, free, sync)
    assert engine.counters().generated_tokens == tokens, (engine.counters().generated_tokens, tokens)

    r = {"model": args.model, "device": str(engine.rt.device), "rows": len(reqs), "generated_tokens": tokens,
         "rows_stopped_by_grammar": valid, "steps": steps,
         "constrained_ms_per_token": 1000 * constrained_s / tokens, "unconstrained_ms_per_token": 1000 * free_s / tokens,
         "ratio": constrained_s / free_s, "mask_ms_per_step": 1000 * mask_s / max(steps, 1),
         "compile_ms_first_and_cached": compile_ms}
    print(f"{r['model']} on {r['device']}: {len(reqs)} rows, {tokens} tokens ({valid} rows ended by the grammar), "
          f"{steps} steps")
    print(f"  per token: constrained {r['constrained_ms_per_token']:.3f} ms, unconstrained "
          f"{r['unconstrained_ms_per_token']:.3f} ms, ratio {r['ratio']:.3f}")
    print(f"  mask fill (host): {r['mask_ms_per_step']:.3f} ms per step")
    print("  compile per schema (first, cached) ms: " + ", ".join(f"{k} {v[0]}/{v[1]}" for k, v in compile_ms.items()))
    if args.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
