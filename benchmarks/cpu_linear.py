"""Float32 linears on CPU: torch's F.linear (MKL sgemm) against oneDNN over a weight packed once
(kernels/matmul/cpu_linear.py, what the engine runs unless --no-packed-weights), per layer shape of the
default model and per batch of M rows, side by side in one run.

    python -m benchmarks.cpu_linear                       # M = 1, 16, 64, 256, 1024; 2 threads
    python -m benchmarks.cpu_linear --m 64 --threads 1 --hint 1,64,512

Prints GFLOP/s (2 M N K / time, median of --repeats interleaved rounds), the packed/plain speed ratio
and the largest difference from the exact product over kernels.packed_error's bound. --hint packs for several batch sizes
to show whether one layout serves every M (the engine keeps one).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from jobrunner.kernels.ops import pack_linear, packed_error

SHAPES = {  # name -> (N, K): the default model's fused layers (30 of each) and its tied lm_head
    "qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576),
}


def _seconds(fn, calls: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls


def measure(n: int, k: int, m: int, hint: int, repeats: int) -> dict:
    lin = torch.nn.Linear(k, n, bias=False)
    x = torch.randn(m, k)
    packed = pack_linear(lin, hint)
    calls = max(3, int(5e9 / (2 * m * n * k)))       # about 50 ms a round at 100 GFLOP/s
    plain_s, packed_s = [], []
    with torch.inference_mode():
        for _ in range(repeats):                     # interleaved: load on the machine hits both alike
            plain_s.append(_seconds(lambda: F.linear(x, lin.weight), calls))
            packed_s.append(_seconds(lambda: packed(x), calls))
        of_bound = packed_error(packed(x), x, lin.weight, None)
    flop = 2 * m * n * k / 1e9
    plain, fast = statistics.median(plain_s), statistics.median(packed_s)
    return {"plain_gflops": flop / plain, "packed_gflops": flop / fast, "ratio": plain / fast, "diff_of_bound": of_bound}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default="1,16,64,256,1024", help="batch rows, comma-separated")
    ap.add_argument("--hint", default="64", help="batch sizes the weight is packed for, comma-separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, torch {torch.__version__}; GFLOP/s plain (F.linear) | packed (oneDNN), "
          f"packed speed over plain, max |diff| / bound")
    for hint in (int(h) for h in args.hint.split(",")):
        for m in (int(v) for v in args.m.split(",")):
            for name in args.shapes.split(","):
                n, k = SHAPES[name]
                r = measure(n, k, m, hint, args.repeats)
                print(f"hint {hint:4d}  M {m:5d}  {name:8s} {r['plain_gflops']:7.1f} | {r['packed_gflops']:7.1f}"
                      f"   {r['ratio']:5.2f}x   {r['diff_of_bound']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
