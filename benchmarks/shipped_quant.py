"""Decode speed and weight memory of quantized checkpoints as shipped, side by side in one run.

    python -m benchmarks.shipped_quant DIR [DIR ...] [--rows 16] [--new 64] [--w4a8] [--bf16]

Each DIR is an HF checkpoint (float, or compressed-tensors / GPTQ / AWQ). For each: our engine's
decode tokens/s (greedy, ignore_eos, float32 activations) and resident weight bytes, and
transformers' generate on the same directory (which decompresses a compressed-tensors checkpoint
to float on its first forward), with the ratio; with --w4a8, also ours under `--quantization w4a8`
(an int4 checkpoint's own weights times int8 activations); with --bf16, also ours under `--dtype bfloat16`
(an int4 checkpoint's nibbles times bfloat16 activations: the int4 kernel's bf16 form where the CPU has
AVX512_BF16). One process, one thread count for all;
with --transformers-python PY, transformers runs in that interpreter instead (a venv of its own with
optimum and gptqmodel, which GPTQ and AWQ need and the test extra does not install), at the same
thread count.
"""
from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path

import torch


def ours(path: str, rows: int, new: int, quantization: str = "none", dtype: str = "float32") -> tuple[float, int]:
    from jobrunner.engine.config.engine_config import EngineConfig
    from jobrunner.engine.core.engine import Engine
    from jobrunner.engine.api.request import Request, SamplingParams
    eng = Engine(EngineConfig(model=path, dtype=dtype, quantization=quantization))
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


def transformers_elsewhere(python: str, path: str, rows: int, new: int) -> float:
    """transformers_speed run by another interpreter (this repository on its path), at this thread count."""
    code = ("import sys, torch; torch.set_num_threads(int(sys.argv[4])); "
            "from benchmarks.shipped_quant import transformers_speed; "
            "print('tok/s', transformers_speed(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))")
    done = subprocess.run([python, "-c", code, path, str(rows), str(new), str(torch.get_num_threads())],
                          capture_output=True, text=True, cwd=Path(__file__).parents[1])
    last = [line for line in done.stdout.splitlines() if line.startswith("tok/s ")]
    if done.returncode or not last:
        raise ImportError((done.stderr.strip().splitlines() or ["no output"])[-1])
    return float(last[-1].split()[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--w4a8", action="store_true", help="also ours under --quantization w4a8 (int4 checkpoints)")
    ap.add_argument("--bf16", action="store_true", help="also ours under --dtype bfloat16")
    ap.add_argument("--transformers-python", help="run transformers by this interpreter (one with optimum and "
                                                  "gptqmodel for GPTQ and AWQ)")
    a = ap.parse_args()
    print(f"threads {torch.get_num_threads()}, {a.rows} rows x {a.new} new tokens (32-token prompts)")
    print(f"{'checkpoint':<40} {'ours tok/s':>11} {'weights MB':>11} {'HF tok/s':>9} {'ours/HF':>8}")
    for d in a.dirs:
        try:
            hf = (transformers_elsewhere(a.transformers_python, d, a.rows, a.new) if a.transformers_python
                  else transformers_speed(d, a.rows, a.new))
        except ImportError as e:        # e.g. GPTQ needs optimum / gptqmodel, which the test extra does not install
            hf, why = None, str(e).splitlines()[0]
            print(f"transformers cannot load {d}: {why}")
        runs = [(d, "none", "float32")] + ([("w4a8 " + d, "w4a8", "float32")] if a.w4a8 else []) \
            + ([("bf16 " + d, "none", "bfloat16")] if a.bf16 else [])
        for label, q, dtype in runs:
            tps, wb = ours(d, a.rows, a.new, q, dtype)
            versus = f"{hf:>9.1f} {tps / hf:>8.2f}" if hf else f"{'-':>9} {'-':>8}"
            print(f"{label[-40:]:<40} {tps:>11.1f} {wb / 2**20:>11.1f} {versus}", flush=True)


if __name__ == "__main__":
    main()
