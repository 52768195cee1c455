"""The CPU weight-only int8 matmul (kernels/matmul/cpu_int8.c) against float32 and the old int8 path, side by side
in one run: per layer shape of the default model (the lm_head included), then whole decode jobs in int8 and int4
mode (whose lm_head is int8) against float32.

    python -m benchmarks.cpu_int8_bench                      # both parts, 2 threads
    python -m benchmarks.cpu_int8_bench --part kernel --m 1,16,64
    python -m benchmarks.cpu_int8_bench --part job --rows 16 --new 32 --repeats 2

kernel: per (K, N) shape and M rows, the median of interleaved rounds of F.linear over float32 weights, oneDNN
    over a packed float32 weight (what the engine's float32 runs), the old int8 path (the weight converted to
    float at each call, then F.linear) and the kernel; per channel (our `--quantization int8`), or --group.
    Distinct weights of the shape are cycled so they come from memory as in a decode step (the lm_head's
    28 MB int8 / 113 MB float32 come from memory anyway); GFLOP/s = 2 M N K / time.
job: `-m dummy:smollm2-135m` (the default model's shape, random weights), --rows prompts of --prompt tokens,
    --new tokens each (EOS ignored): float32, `--quantization int8` with the kernel (JOBRUNNER_CPU_INT8=auto)
    and with the old path (off), `--quantization int4` (its int4 kernel on) with the int8 kernel for its
    lm_head and without; the job's wall, its generated tokens/s and its speed over float32.
The CPU's name and whether it has avx512_vnni / avx512_bf16 head the output.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.cpu_int4_bench import SHAPES as LAYER_SHAPES, _median_s, cpu_line

SHAPES = LAYER_SHAPES + ((576, 49152),)       # (K, N): the decoder's linears, then the lm_head
JOB_CASES = (("float32", "none", "off", "off"), ("int8 kernel", "int8", "auto", "off"),
             ("int8 old path", "int8", "off", "off"), ("int4, int8 kernel", "int4", "auto", "auto"),
             ("int4, old int8", "int4", "off", "auto"))     # (name, quantization, JOBRUNNER_CPU_INT8, _INT4)


def kernel_case(k: int, n: int, m: int, group: int | None, repeats: int, lib) -> dict:
    """Seconds a call of each path, cycling through as many distinct weights as make ~64 MB of float32."""
    from jobrunner.engine.quant.formats import quantize_int8
    from jobrunner.kernels.ops import dequantize_int8, int8_matmul, int8_matmul_cpu, pack_linear
    layers = max(1, min(30, (64 << 20) // (4 * n * k)))
    g = torch.Generator().manual_seed(0)
    int8 = [quantize_int8(torch.randn(n, k, generator=g) * 0.05, group) for _ in range(layers)]
    dense = [dequantize_int8(q, s) for q, s in int8]
    packed = []
    for w in dense:
        lin = torch.nn.Linear(k, n, bias=False)
        lin.weight.data = w
        packed.append(pack_linear(lin, 64))
    x = torch.randn(m, k)
    cycle = lambda f: lambda: [f(i) for i in range(layers)]  # noqa: E731
    fns = {"F.linear f32": cycle(lambda i: F.linear(x, dense[i])),
           "oneDNN f32": cycle(lambda i: packed[i](x)),
           "int8 old": cycle(lambda i: int8_matmul(x, *int8[i])),
           "int8 kernel": cycle(lambda i: int8_matmul_cpu(x, *int8[i], None, None, lib))}
    calls = max(1, int(2e8 / (2 * m * n * k * layers)))
    with torch.inference_mode():
        secs = _median_s(fns, calls, repeats)
    return {name: t / layers for name, t in secs.items()}


def kernel_part(ms: list[int], group: int | None, repeats: int) -> None:
    from jobrunner.engine.run.cpu_kernel_build import INT8, kernel_library
    lib = kernel_library(INT8)
    if lib is None:
        print("the int8 kernel did not build (see the warning); nothing to compare")
        return
    print(f"\nkernel ({lib.isa} loop), {'per channel' if group is None else f'group {group}'}; us a call | "
          "GFLOP/s; speed ratios of the kernel over each peer")
    for m in ms:
        for k, n in SHAPES:
            r = kernel_case(k, n, m, group, repeats, lib)
            flop = 2 * m * n * k
            cells = [f"{name} {t * 1e6:8.1f} | {flop / t / 1e9:6.1f}" for name, t in r.items()]
            kt = r["int8 kernel"]
            print(f"M {m:3d}  K {k:4d} N {n:5d}   " + "   ".join(cells) +
                  f"   x{r['F.linear f32'] / kt:.2f} F.linear, x{r['oneDNN f32'] / kt:.2f} oneDNN, "
                  f"x{r['int8 old'] / kt:.2f} old", flush=True)


def job_once(rows: int, prompt: int, new: int, quantization: str, int8: str, int4: str) -> tuple[float, int]:
    from jobrunner.engine import Engine
    from jobrunner.engine.api.request import Request, SamplingParams
    from jobrunner.engine.config.engine_config import EngineConfig
    os.environ["JOBRUNNER_CPU_INT8"], os.environ["JOBRUNNER_CPU_INT4"] = int8, int4
    eng = Engine(EngineConfig(model="dummy:smollm2-135m", quantization=quantization, dtype="float32",
                              kv_cache_memory=512 * 2**20))
    g = torch.Generator().manual_seed(0)
    reqs = [Request(str(i), torch.randint(10, 40000, (prompt,), generator=g).tolist(),
                    SamplingParams(max_tokens=new, ignore_eos=True, temperature=0.0)) for i in range(rows)]
    eng.generate(reqs[:2])                                   # warm: first calls, the kernels' builds
    t = time.perf_counter()
    outs = eng.generate(reqs)
    wall = time.perf_counter() - t
    return wall, sum(len(o.token_ids) for o in outs)


def job_part(rows_list: list[int], prompt: int, new: int, repeats: int, only: list[str] | None) -> None:
    cases = [c for c in JOB_CASES if only is None or c[0] in only or c[0] == "float32"]
    print(f"\njob: -m dummy:smollm2-135m, {prompt}-token prompts, {new} new tokens each, EOS ignored; "
          f"median wall of {repeats} rounds, interleaved; generated tok/s; speed over float32")
    for rows in rows_list:
        walls = {c[0]: [] for c in cases}
        toks = {}
        for _ in range(repeats):
            for name, q, int8, int4 in cases:
                w, toks[name] = job_once(rows, prompt, new, q, int8, int4)
                walls[name].append(w)
        base = statistics.median(walls["float32"])
        for name, *_ in cases:
            w = statistics.median(walls[name])
            print(f"rows {rows:3d}  {name:18s} {w:7.2f} s  {toks[name] / w:7.1f} tok/s  x{base / w:.2f}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("kernel", "job", "both"), default="both")
    ap.add_argument("--m", default="1,16,64", help="kernel rows, comma-separated")
    ap.add_argument("--group", type=int, default=None, help="kernel: scales per group of G columns (default per channel)")
    ap.add_argument("--rows", default="16", help="job rows, comma-separated")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--cases", default=None, help="job cases besides float32, comma-separated (default all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(cpu_line())
    if args.part in ("kernel", "both"):
        kernel_part([int(v) for v in args.m.split(",")], args.group, args.repeats)
    if args.part in ("job", "both"):
        job_part([int(v) for v in args.rows.split(",")], args.prompt, args.new, max(1, args.repeats // 2),
                 None if args.cases is None else args.cases.split(","))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
