"""The float32 panel kernel (kernels/matmul/cpu_f32.c, PackedLinear's panel form) against oneDNN over its packed
weight (the form it replaces), side by side in one run: per layer shape, then whole float32 jobs.

    python -m benchmarks.cpu_f32_bench                           # both parts, 2 threads
    python -m benchmarks.cpu_f32_bench --part kernel --m 1,16,64,512
    python -m benchmarks.cpu_f32_bench --part job --model <a 1B model's folder> --rows 16

kernel: per (K, N) shape (the default model's and a Llama-3.2-1B's) and M rows, the median of interleaved
    rounds over --layers distinct weights of the shape cycled (a decode step reads each layer's weight once,
    from memory). GFLOP/s = 2 M N K / time; GB/s = the float32 weight's bytes / time.
job: --model (default `dummy:smollm2-135m`, the default model's shape with random weights) in float32, the panel
    form (JOBRUNNER_CPU_F32=auto) against oneDNN's (off), rounds interleaved: "decode" --rows prompts of 32
    tokens, --new tokens each (EOS ignored); "prefill" --rows prompts of --prompt tokens, 1 new token each.
The CPU's name and features head the output.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from benchmarks.cpu_int4_bench import _median_s, cpu_line

SHAPES = {"qkv": (576, 960), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152),  # (K, N)
          "1B qkv": (2048, 3072), "1B gate_up": (2048, 16384), "1B down": (8192, 2048)}


def kernel_part(ms: list[int], shapes: list[str], layers: int, repeats: int) -> None:
    from jobrunner.engine.run.cpu_kernel_build import panel_kernel
    from jobrunner.kernels.ops import pack_linear
    lib = panel_kernel()
    if lib is None:
        print("the panel kernel is not available here (no AVX-512, or JOBRUNNER_CPU_F32=off)")
        return
    print(f"kernel: {layers} weights a shape cycled; GFLOP/s (GB/s of float32 weight), median of {repeats} rounds")
    for name in shapes:
        k, n = SHAPES[name]
        count = max(1, min(layers, int(2e9 // (4 * k * n))))      # at most ~2 GB of each form
        linears = [torch.nn.Linear(k, n, bias=False) for _ in range(count)]
        onednn = [pack_linear(lin, check=False) for lin in linears]
        panels = [pack_linear(lin, check=False, panel_kernel=lib) for lin in linears]
        del linears
        for m in ms:
            x = torch.randn(m, k)
            calls = max(1, int(2e8 / (2 * m * n * k + 4 * n * k)))
            with torch.inference_mode():
                t = _median_s({"oneDNN": lambda: [p(x) for p in onednn],
                               "panels": lambda: [p(x) for p in panels]}, calls, repeats)
            rate = {f: (2 * m * n * k * count / s / 1e9, 4 * n * k * count / s / 1e9) for f, s in t.items()}
            print(f"{name:10s} K {k:5d} N {n:6d} M {m:5d}   oneDNN {rate['oneDNN'][0]:6.1f} ({rate['oneDNN'][1]:5.1f})"
                  f"   panels {rate['panels'][0]:6.1f} ({rate['panels'][1]:5.1f})   x{t['oneDNN'] / t['panels']:.2f}",
                  flush=True)


def job_once(model: str, rows: int, prompt: int, new: int, mode: str) -> float:
    from jobrunner.engine import Engine
    from jobrunner.engine.api.request import Request, SamplingParams
    from jobrunner.engine.config.engine_config import EngineConfig
    os.environ["JOBRUNNER_CPU_F32"] = mode
    eng = Engine(EngineConfig(model=model, dtype="float32", kv_cache_memory=1024 * 2**20))
    g = torch.Generator().manual_seed(0)
    reqs = [Request(str(i), torch.randint(10, 40000, (prompt,), generator=g).tolist(),
                    SamplingParams(max_tokens=new, ignore_eos=True, temperature=0.0)) for i in range(rows)]
    eng.generate(reqs[:2])                                   # warm: first calls, the kernel's build
    t = time.perf_counter()
    eng.generate(reqs)
    wall = time.perf_counter() - t
    eng.close() if hasattr(eng, "close") else None
    return wall


def job_part(model: str, rows_list: list[int], prompt: int, new: int, repeats: int) -> None:
    print(f"\njob: -m {model}, float32; median wall of {repeats} rounds, interleaved; panel form's speed over oneDNN's")
    for rows in rows_list:
        for kind, p, nw in (("decode", 32, new), ("prefill", prompt, 1)):
            walls = {"auto": [], "off": []}
            for _ in range(repeats):
                for mode in walls:
                    walls[mode].append(job_once(model, rows, p, nw, mode))
            on, off = statistics.median(walls["auto"]), statistics.median(walls["off"])
            print(f"rows {rows:3d} {kind:8s} ({p} prompt, {nw} new)  oneDNN {off:7.2f} s  panels {on:7.2f} s  "
                  f"x{off / on:.2f}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("kernel", "job", "both"), default="both")
    ap.add_argument("--m", default="1,4,16,64,256,2048", help="kernel rows, comma-separated")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--layers", type=int, default=8, help="distinct weights a shape cycled per call")
    ap.add_argument("--model", default="dummy:smollm2-135m")
    ap.add_argument("--rows", default="16,64", help="job rows, comma-separated")
    ap.add_argument("--prompt", type=int, default=512, help="prefill job: tokens a prompt")
    ap.add_argument("--new", type=int, default=64, help="decode job: new tokens a row")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(cpu_line())
    if args.part in ("kernel", "both"):
        kernel_part([int(v) for v in args.m.split(",")], args.shapes.split(","), args.layers, args.repeats)
    if args.part in ("job", "both"):
        job_part(args.model, [int(v) for v in args.rows.split(",")], args.prompt, args.new,
                 max(1, args.repeats // 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
