"""The CPU w4a8 kernel (int4 weights x int8 activations, kernels/matmul/cpu_w4a8.c) against the float32 int4 kernel
(cpu_int4.c) and F.linear over float32 weights, side by side in one run, the kernels alone.

    python -m benchmarks.cpu_w4a8_bench                       # default model's and a 1B model's shapes, M 1,16,64
    python -m benchmarks.cpu_w4a8_bench --m 16 --shapes 2048x2048 --group 128

Per (N, K) shape and M rows: the median of interleaved rounds of each path, cycling through distinct weights of
the shape until --mb megabytes of int4 weights (a decode step reads each layer's weight once, from memory, not
cache). ms a call, GFLOP/s (2 M N K / time), and the w4a8 kernel's speed over each peer (x > 1: w4a8 faster).
The CPU's name and whether it has avx512_vnni / avx512_bf16 head the output.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.cpu_int4_bench import _median_s, cpu_line

# (N, K): the default model's q/o, k/v, gate/up, down, lm_head; then a 1B model's q/o, gate/up, down
SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576), (2048, 2048), (8192, 2048), (2048, 8192))


def _library(name, command, load):
    """A kernel's native build under the cache (built first if absent), loaded."""
    from jobrunner.engine.run.cpu_decode import build_library, library_path
    path = library_path().parent / name("native")
    if not path.exists():
        build_library(path, lambda cc, out: command(cc, out, "native"))
    return load(path)


def _weights(n: int, k: int, group: int, seed: int):
    from jobrunner.kernels.ops import dequantize_int4, pack_int4, w4a8_pack
    g = torch.Generator().manual_seed(seed)
    kp = -(-k // group) * group                  # K rounded up to the group
    q = torch.randint(0, 16, (n, kp), dtype=torch.uint8, generator=g)
    s = (torch.rand(n, kp // group, generator=g) * 0.02).half()
    z = (torch.randn(n, kp // group, generator=g) * 0.02).half()
    packed = pack_int4(q, group)
    return (packed, s, z), w4a8_pack(packed, s, z, group, k), dequantize_int4(packed, s, z, group, k)


def case(n: int, k: int, m: int, group: int, mb: float, repeats: int, libs) -> dict:
    """Seconds a call of each path, cycling through distinct weights."""
    from jobrunner.kernels.ops import int4_matmul_cpu, w4a8_matmul_cpu
    int4_lib, w4a8_lib = libs
    layers = max(2, min(128, int(mb * 2**20 / (n * k // 2))))
    ws = [_weights(n, k, group, i) for i in range(layers)]
    x = torch.randn(m, k)
    cycle = lambda f: lambda: [f(w) for w in ws]  # noqa: E731
    fns = {"F.linear f32": cycle(lambda w: F.linear(x, w[2])),
           "int4 kernel": cycle(lambda w: int4_matmul_cpu(x, *w[0], group, None, int4_lib)),
           "w4a8 kernel": cycle(lambda w: w4a8_matmul_cpu(x, w[1], None, w4a8_lib))}
    calls = max(1, int(1e8 / (2 * m * n * k * layers)))
    with torch.inference_mode():
        secs = _median_s(fns, calls, repeats)
    return {name: t / layers for name, t in secs.items()}


def main(argv=None) -> int:
    from jobrunner.kernels import ops
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default="1,16,64", help="activation rows, comma-separated")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="NxK, comma-separated")
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--mb", type=float, default=48.0, help="int4 weight megabytes cycled per shape")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(cpu_line())
    libs = (_library(ops.int4_library_name, ops.int4_compile_command, ops.Int4Library),
            _library(ops.w4a8_library_name, ops.w4a8_compile_command, ops.W4A8Library))
    print(f"int4 kernel: {libs[0].isa} loop; w4a8 kernel: {libs[1].isa} loop; group {args.group}; "
          "ms a call | GFLOP/s; w4a8's speed over each peer")
    for m in (int(v) for v in args.m.split(",")):
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            r = case(n, k, m, args.group, args.mb, args.repeats, libs)
            flop = 2 * m * n * k
            cells = "   ".join(f"{name} {t * 1e3:8.3f} | {flop / t / 1e9:6.1f}" for name, t in r.items())
            w = r["w4a8 kernel"]
            print(f"M {m:3d}  N {n:5d} K {k:4d}   {cells}   x{r['F.linear f32'] / w:.2f} F.linear, "
                  f"x{r['int4 kernel'] / w:.2f} int4", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
