"""Decode speed and weight memory of quantized checkpoints as shipped, side by side in one run.

    python -m benchmarks.shipped_quant DIR [DIR ...] [--rows 16] [--new 64]

Each DIR is an HF checkpoint (float, or compressed-tensors / GPTQ / AWQ). For each: our engine's
decode tokens/s (greedy, ignore_eos, float32 activations) and resident weight bytes, and
transformers' generate on the same directory (which decompresses a compressed-tensors checkpoint
to float on its first forward), with the ratio. One process, one thread count for all.
"""
from __future__ import annotations

import argparse
import time

import torch


def ours(path: str, rows: int, new: int) -> tuple[float, int]:
    from jobrunner.engine.config.engine_config import EngineConfig
    from jobrunner.engine.core.engine import Engine
    from jobrunner.engine.api.request import Request, SamplingParams
    eng = Engine(EngineConfig(model=path, dtype="float32"))
    g = torch.Generator().manual_seed(0)
    reqs = [Request(str(i), torch.randint(3, 1000, (32,), generator=g).tolist(),
                    SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)) for i in range(rows)]
    eng.generate(reqs[:2])                                  # warm-up
    t0 = time.perf_counter()
    outs = eng.generate(reqs)
    dt = time.perf_counter() - t0
    decode = sum(o.decode_s for o in outs) / len(outs)
    tokens = sum(len(o.completions[0].token_ids) for o in outs)
    return tokens / max(dt, 1e-9), eng.info.weight_bytes


def transformers_speed(path: str, rows: int, new: int) -> float:
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (rows, 32), generator=g)
    hf.generate(ids[:2], max_new_tokens=2, do_sample=False, pad_token_id=0)      # warm-up, decompression
    t0 = time.perf_counter()
    out = hf.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    return (out.shape[1] - 32) * rows / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--new", type=int, default=64)
    a = ap.parse_args()
    print(f"threads {torch.get_num_threads()}, {a.rows} rows x {a.new} new tokens (32-token prompts)")
    print(f"{'checkpoint':<40} {'ours tok/s':>11} {'weights MB':>11} {'HF tok/s':>9} {'ours/HF':>8}")
    for d in a.dirs:
        tps, wb = ours(d, a.rows, a.new)
        hf = transformers_speed(d, a.rows, a.new)
        print(f"{d[-40:]:<40} {tps:>11.1f} {wb / 2**20:>11.1f} {hf:>9.1f} {tps / hf:>8.2f}")


if __name__ == "__main__":
    main()
