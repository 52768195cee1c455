"""The CPU int4 matmul over packed nibbles (kernels/matmul/cpu_int4.c) against float32 and the old int4 path,
side by side in one run: per layer shape of the default model, then a whole decode job.

    python -m benchmarks.cpu_int4_bench                      # both parts, 2 threads
    python -m benchmarks.cpu_int4_bench --part kernel --m 1,16,64
    python -m benchmarks.cpu_int4_bench --part job --rows 16,64 --new 64

kernel: per (K, N) shape and M rows, the median of interleaved rounds of F.linear over float32 weights,
    oneDNN over a packed float32 weight (what the engine's float32 runs), the old int4 path (a slice
    dequantized, then F.linear) and the kernel. "step" cycles through --layers distinct weights of the
    shape (a decode step reads each layer's weight once, from memory, not cache); "hot" reuses one.
    GFLOP/s = 2 M N K / time; GB/s = the weight's bytes (float32, or int4 with its float16 scales and
    zeros) / time. Where the CPU has AVX512_BF16, also oneDNN over a packed bfloat16 weight (what
    `--dtype bfloat16` runs) and the kernel's bf16 form (bfloat16 activations times the nibbles,
    cpu_int4_bf16.c), with the form's speed over each.
job: `-m dummy:smollm2-135m` (the default model's shape, random weights), --rows prompts of --prompt
    tokens each, --new tokens each (EOS ignored), float32 against `--quantization int4` with the kernel
    (JOBRUNNER_CPU_INT4=auto) and with the old path (off), and `--quantization w4a8` (int4's weights times
    int8 activations, kernels/matmul/cpu_w4a8.c), and under `--dtype bfloat16` bfloat16 weights against
    `--quantization int4` (the bf16 form where the CPU has it); the job's wall and its generated tokens/s.
The CPU's name and whether it has avx512_vnni / avx512_bf16 head the output.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = ((576, 1536), (1536, 576), (576, 576), (576, 192))      # (K, N): gate/up, down, q/o, k/v


def cpu_line() -> str:
    name, flags = platform.processor() or "?", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and name in ("?", "", platform.processor()):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    has = lambda f: "yes" if f in flags else "no"  # noqa: E731
    return (f"CPU: {name}; avx512f {has('avx512f')}, avx512_vnni {has('avx512_vnni')}, "
            f"avx512_bf16 {has('avx512_bf16')}, amx_tile {has('amx_tile')}; torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads")


def _median_s(fns: dict, calls: int, repeats: int) -> dict:
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):                     # interleaved: load on the machine hits every path alike
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t) / calls)
    return {name: statistics.median(v) for name, v in times.items()}


def _int4_weights(k: int, n: int, group: int, seed: int):
    from jobrunner.kernels.ops import pack_int4
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    s = (torch.rand(n, k // group, generator=g) * 0.02).half()
    z = (torch.randn(n, k // group, generator=g) * 0.02).half()
    return pack_int4(q, group), s, z


def kernel_case(k: int, n: int, m: int, layers: int, repeats: int, lib, group: int = 32) -> dict:
    """Seconds a call of each path, cycling through `layers` distinct weights."""
    from jobrunner.kernels.ops import dequantize_int4, int4_bf16_matmul_cpu, int4_matmul, int4_matmul_cpu, pack_linear
    int4 = [_int4_weights(k, n, group, i) for i in range(layers)]
    dense = [dequantize_int4(p, s, z, group, k) for p, s, z in int4]
    packed = []
    for w in dense:
        lin = torch.nn.Linear(k, n, bias=False)
        lin.weight.data = w
        packed.append(pack_linear(lin, 64))
    x = torch.randn(m, k)
    cycle = lambda f: lambda: [f(i) for i in range(layers)]  # noqa: E731
    fns = {"F.linear f32": cycle(lambda i: F.linear(x, dense[i])),
           "oneDNN f32": cycle(lambda i: packed[i](x)),
           "int4 old": cycle(lambda i: int4_matmul(x, *int4[i], group)),
           "int4 kernel": cycle(lambda i: int4_matmul_cpu(x, *int4[i], group, None, lib))}
    if lib.bf16:
        xb = x.bfloat16()
        packed_bf16 = []
        for w in dense:
            lin = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
            lin.weight.data = w.bfloat16()
            packed_bf16.append(pack_linear(lin, 64))
        fns |= {"oneDNN bf16": cycle(lambda i: packed_bf16[i](xb)),
                "int4 bf16 form": cycle(lambda i: int4_bf16_matmul_cpu(xb, *int4[i], group, None, lib))}
    calls = max(1, int(2e8 / (2 * m * n * k * layers)))
    with torch.inference_mode():
        secs = _median_s(fns, calls, repeats)
    return {name: t / layers for name, t in secs.items()}


def kernel_part(ms: list[int], layers: int, repeats: int) -> None:
    from jobrunner.engine.run.cpu_kernel_build import INT4, kernel_library
    lib = kernel_library(INT4)
    if lib is None:
        print("the int4 kernel did not build (see the warning); nothing to compare")
        return
    print(f"\nkernel ({lib.isa} loop), group 32, {layers} distinct weights cycled per call ('step'); "
          "us a call | GFLOP/s | weight GB/s; speed ratios of the kernel over each peer")
    for m in ms:
        for k, n in SHAPES:
            r = kernel_case(k, n, m, layers, repeats, lib)
            flop = 2 * m * n * k
            wbytes = {"F.linear f32": 4 * n * k, "oneDNN f32": 4 * n * k, "oneDNN bf16": 2 * n * k}
            cells = []
            for name, t in r.items():
                b = wbytes.get(name, n * k // 2 + 4 * n * (k // 32))
                cells.append(f"{name} {t * 1e6:7.1f} | {flop / t / 1e9:6.1f} | {b / t / 1e9:6.2f}")
            kt = r["int4 kernel"]
            print(f"M {m:3d}  K {k:4d} N {n:4d}   " + "   ".join(cells) +
                  f"   x{r['F.linear f32'] / kt:.2f} F.linear, x{r['oneDNN f32'] / kt:.2f} oneDNN, "
                  f"x{r['int4 old'] / kt:.2f} old" + (f"; bf16 form x{r['oneDNN bf16'] / r['int4 bf16 form']:.2f} "
                  f"oneDNN bf16, x{kt / r['int4 bf16 form']:.2f} the kernel" if "int4 bf16 form" in r else ""),
                  flush=True)


def job_once(rows: int, prompt: int, new: int, quantization: str, mode: str, dtype: str = "float32"
             ) -> tuple[float, int]:
    from jobrunner.engine import Engine
    from jobrunner.engine.api.request import Request, SamplingParams
    from jobrunner.engine.config.engine_config import EngineConfig
    os.environ["JOBRUNNER_CPU_INT4"] = mode
    eng = Engine(EngineConfig(model="dummy:smollm2-135m", quantization=quantization, dtype=dtype,
                              kv_cache_memory=512 * 2**20))
    g = torch.Generator().manual_seed(0)
    reqs = [Request(str(i), torch.randint(10, 40000, (prompt,), generator=g).tolist(),
                    SamplingParams(max_tokens=new, ignore_eos=True, temperature=0.0)) for i in range(rows)]
    eng.generate(reqs[:2])                                   # warm: first calls, the kernel's build
    t = time.perf_counter()
    outs = eng.generate(reqs)
    wall = time.perf_counter() - t
    return wall, sum(len(o.token_ids) for o in outs)


def job_part(rows_list: list[int], prompt: int, new: int, repeats: int) -> None:
    print(f"\njob: -m dummy:smollm2-135m, {prompt}-token prompts, {new} new tokens each, EOS ignored; "
          f"median wall of {repeats} rounds, interleaved; generated tok/s; speed over float32")
    cases = (("float32", "none", "off", "float32"), ("int4 kernel", "int4", "auto", "float32"),
             ("int4 old path", "int4", "off", "float32"), ("w4a8 kernel", "w4a8", "auto", "float32"),
             ("bfloat16", "none", "off", "bfloat16"), ("int4 bfloat16", "int4", "auto", "bfloat16"))
    for rows in rows_list:
        walls = {case[0]: [] for case in cases}
        toks = {}
        for _ in range(repeats):
            for name, q, mode, dtype in cases:
                w, toks[name] = job_once(rows, prompt, new, q, mode, dtype)
                walls[name].append(w)
        base = statistics.median(walls["float32"])
        for name, *_ in cases:
            w = statistics.median(walls[name])
            print(f"rows {rows:3d}  {name:14s} {w:7.2f} s  {toks[name] / w:7.1f} tok/s  x{base / w:.2f}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("kernel", "job", "both"), default="both")
    ap.add_argument("--m", default="1,16,64", help="kernel rows, comma-separated")
    ap.add_argument("--layers", type=int, default=30, help="distinct weights cycled per call (1: hot cache)")
    ap.add_argument("--rows", default="16,64", help="job rows, comma-separated")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(cpu_line())
    if args.part in ("kernel", "both"):
        kernel_part([int(v) for v in args.m.split(",")], args.layers, args.repeats)
    if args.part in ("job", "both"):
        job_part([int(v) for v in args.rows.split(",")], args.prompt, args.new, max(1, args.repeats // 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
