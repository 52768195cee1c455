"""The CPU weight-only int8 matmul (kernels/matmul/cpu_int8.c) against float32 and the old int8 path, side by side
in one run: per layer shape of the default model (the lm_head included), then whole decode jobs in int8 and int4
mode (whose lm_head is int8) against float32.

    python -m benchmarks.cpu_int8_bench                      # both parts, 2 threads
    python -m benchmarks.cpu_int8_bench --part kernel --m 1,16,64
    python -m benchmarks.cpu_int8_bench --part job --rows 16 --new 32 --repeats 2
    python -m benchmarks.cpu_int8_bench --part fp8 --m 1,16,64          # the fp8 form, per layer shape
    python -m benchmarks.cpu_int8_bench --part fp8-dot --m 1,16,64          # e4m3 activations: the bf16 form
    python -m benchmarks.cpu_int8_bench --part fp8-job --rows 16,64 --repeats 2

kernel: per (K, N) shape and M rows, the median of interleaved rounds of F.linear over float32 weights, oneDNN
    over a packed float32 weight (what the engine's float32 runs), the old int8 path (the weight converted to
    float at each call, then F.linear) and the kernel; per channel (our `--quantization int8`), or --group.
    Distinct weights of the shape are cycled so they come from memory as in a decode step (the lm_head's
    28 MB int8 / 113 MB float32 come from memory anyway); GFLOP/s = 2 M N K / time.
job: `-m dummy:smollm2-135m` (the default model's shape, random weights), --rows prompts of --prompt tokens,
    --new tokens each (EOS ignored): float32, `--quantization int8` with the kernel (JOBRUNNER_CPU_INT8=auto)
    and with the old path (off), `--quantization int4` (its int4 kernel on) with the int8 kernel for its
    lm_head and without; the job's wall, its generated tokens/s and its speed over float32.
fp8: the same shapes, fp8 (e4m3) weights per channel and in 128 x 128 blocks: oneDNN over the packed float32
    weight, the old fp8 path (fp8_weight_matmul without the kernel: a float slice dequantized at each call, then
    F.linear) and the kernel (cpu_int8.c's fp8 form).
fp8-dot: the same shapes, an FP8_DYNAMIC linear's whole matmul (activations quantized per token; 128 x 128 blocks
    with groups of 128 where they divide K): F.linear and oneDNN over the float32 weight, fp8_weight_matmul through
    the float32 fp8 form and through the bf16 form (cpu_fp8_dot.c: e4m3 x e4m3 in bfloat16 dot products).
fp8-job: llmcompressor FP8_DYNAMIC (or --schemes) checkpoints of the default model's shape, random weights (made
    once by tests/quantized_checkpoints.py under --fp8-dir), with the kernel (JOBRUNNER_CPU_FP8=auto) through the
    bf16 form (where the CPU has AVX512_BF16) and held to the float32 form, and the old path (off), against
    float32 on the first checkpoint's dequantized weights; then under --dtype bfloat16 those weights and each
    checkpoint (its bfloat16 rows through the bf16 form as they are).
The CPU's name and whether it has avx512_vnni / avx512_bf16 head the output.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.cpu_int4_bench import SHAPES as LAYER_SHAPES, _median_s, cpu_line

SHAPES = LAYER_SHAPES + ((576, 49152),)       # (K, N): the decoder's linears, then the lm_head
DEFAULT_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=2048,
                     tie_word_embeddings=True, rms_norm_eps=1e-5)      # smollm2-135m's (engine/load/dummy_configs.py)
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
    return _per_layer_s({"F.linear f32": lambda i: F.linear(x, dense[i]), "oneDNN f32": lambda i: packed[i](x),
                         "int8 old": lambda i: int8_matmul(x, *int8[i]),
                         "int8 kernel": lambda i: int8_matmul_cpu(x, *int8[i], None, None, lib)},
                        layers, 2 * m * n * k, repeats)


def _per_layer_s(calls_of: dict, layers: int, flop: int, repeats: int) -> dict:
    """Seconds a call of each path (name -> f(i) running it over weight i), median of interleaved rounds, each
    round cycling the layers' distinct weights."""
    fns = {name: (lambda f: lambda: [f(i) for i in range(layers)])(f) for name, f in calls_of.items()}
    with torch.inference_mode():
        secs = _median_s(fns, max(1, int(2e8 / (flop * layers))), repeats)
    return {name: t / layers for name, t in secs.items()}


def fp8_case(k: int, n: int, m: int, block: tuple[int, int] | None, repeats: int, lib) -> dict:
    """Seconds a call of float32 packed (oneDNN), the old fp8 path (a float slice of the weight dequantized
    at each call, then F.linear) and the fp8 kernel, cycling distinct weights as kernel_case does."""
    from jobrunner.kernels.ops import FP8_MAX, dequantize_fp8, fp8_matmul_cpu, fp8_weight_matmul, pack_linear
    layers = max(1, min(30, (64 << 20) // (4 * n * k)))
    g = torch.Generator().manual_seed(0)
    fp8 = []
    for _ in range(layers):
        w = torch.randn(n, k, generator=g) * 0.05
        rows = w.abs().amax(1, keepdim=True) if block is None else w.abs().amax()      # a simple grid
        s = rows / FP8_MAX if block is None else torch.full((-(-n // block[0]), -(-k // block[1])),
                                                             (rows / FP8_MAX).item())
        fp8.append(((w / (rows / FP8_MAX)).to(torch.float8_e4m3fn), s.contiguous()))
    packed = []
    for q, s in fp8:
        lin = torch.nn.Linear(k, n, bias=False)
        lin.weight.data = dequantize_fp8(q, s, block, torch.float32)
        packed.append(pack_linear(lin, 64))
    x = torch.randn(m, k)
    return _per_layer_s({"oneDNN f32": lambda i: packed[i](x), "fp8 old": lambda i: fp8_weight_matmul(x, *fp8[i], block),
                         "fp8 kernel": lambda i: fp8_matmul_cpu(x, *fp8[i], block, None, lib)},
                        layers, 2 * m * n * k, repeats)


def fp8_dot_case(k: int, n: int, m: int, block: tuple[int, int] | None, repeats: int, lib) -> dict:
    """Seconds a call of float32 (F.linear and packed oneDNN) and of an FP8_DYNAMIC linear's matmul on the CPU:
    fp8_weight_matmul with the activations quantized per token, through the float32 fp8 form (the library told
    fp8_dot=False) and through the bf16 form (cpu_fp8_dot.c); distinct weights cycled as kernel_case does."""
    from jobrunner.kernels.ops import FP8_MAX, Int8Library, dequantize_fp8, fp8_weight_matmul, pack_linear
    layers = max(1, min(30, (64 << 20) // (4 * n * k)))
    g = torch.Generator().manual_seed(0)
    fp8, dense, packed = [], [], []
    for _ in range(layers):
        w = torch.randn(n, k, generator=g) * 0.05
        amax = w.abs().amax(1, keepdim=True) if block is None else w.abs().amax()
        s = amax / FP8_MAX if block is None else torch.full((-(-n // block[0]), -(-k // block[1])), (amax / FP8_MAX).item())
        fp8.append(((w / (amax / FP8_MAX)).to(torch.float8_e4m3fn), s.contiguous()))
        dense.append(dequantize_fp8(*fp8[-1], block, torch.float32))
        lin = torch.nn.Linear(k, n, bias=False)
        lin.weight.data = dense[-1]
        packed.append(pack_linear(lin, 64))
    f32_form = Int8Library(lib.path, fp8_dot=False)
    x = torch.randn(m, k)
    group = None if block is None else block[1]
    return _per_layer_s({"F.linear f32": lambda i: F.linear(x, dense[i]), "oneDNN f32": lambda i: packed[i](x),
                         "fp8 f32 form": lambda i: fp8_weight_matmul(x, *fp8[i], block, None, "dynamic", None, group,
                                                                     f32_form),
                         "fp8 bf16 form": lambda i: fp8_weight_matmul(x, *fp8[i], block, None, "dynamic", None, group,
                                                                      lib)},
                        layers, 2 * m * n * k, repeats)


def fp8_dot_part(ms: list[int], repeats: int) -> None:
    from jobrunner.engine.run.cpu_kernel_build import FP8, kernel_library
    lib = kernel_library(FP8)
    if lib is None or not lib.fp8_dot:
        print("no bf16 fp8 form here (no kernel build, or no AVX512_BF16); nothing to compare")
        return
    print("\nfp8 with e4m3 activations (FP8_DYNAMIC: per token; blocks: per token and group of 128); us a call | "
          "GFLOP/s; speed ratios of the bf16 form over each peer")
    for block in (None, (128, 128)):
        for m in ms:
            for k, n in LAYER_SHAPES:
                if block is None or k % block[1] == 0:
                    _print_row(f"{'channel' if block is None else 'block128':8s} ", m, k, n,
                               fp8_dot_case(k, n, m, block, repeats, lib), "fp8 bf16 form")


def fp8_part(ms: list[int], repeats: int) -> None:
    from jobrunner.engine.run.cpu_kernel_build import FP8, kernel_library
    lib = kernel_library(FP8)
    if lib is None:
        print("the fp8 kernel did not build (see the warning); nothing to compare")
        return
    print(f"\nfp8 kernel ({lib.isa} loop); us a call | GFLOP/s; speed ratios of the kernel over each peer")
    for block in (None, (128, 128)):
        for m in ms:
            for k, n in LAYER_SHAPES:
                _print_row(f"{'channel' if block is None else 'block128':8s} ", m, k, n,
                           fp8_case(k, n, m, block, repeats, lib), "fp8 kernel")


def _print_row(label: str, m: int, k: int, n: int, r: dict, kernel: str) -> None:
    """One shape's line: each path's us a call | GFLOP/s, then the kernel's speed over each peer."""
    flop = 2 * m * n * k
    cells = [f"{name} {t * 1e6:8.1f} | {flop / t / 1e9:6.1f}" for name, t in r.items()]
    ratios = [f"x{t / r[kernel]:.2f} {name}" for name, t in r.items() if name != kernel]
    print(f"{label}M {m:3d}  K {k:4d} N {n:5d}   " + "   ".join(cells) + "   " + ", ".join(ratios), flush=True)


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
            _print_row("", m, k, n, kernel_case(k, n, m, group, repeats, lib), "int8 kernel")


def job_once(rows: int, prompt: int, new: int, quantization: str, int8: str, int4: str,
             model: str = "dummy:smollm2-135m", fp8: str = "auto", fp8_dot: bool = True,
             dtype: str = "float32") -> tuple[float, int]:
    from jobrunner.engine import Engine
    from jobrunner.engine.api.request import Request, SamplingParams
    from jobrunner.engine.config.engine_config import EngineConfig
    from jobrunner.kernels.matmul import shipped_quant
    os.environ["JOBRUNNER_CPU_INT8"], os.environ["JOBRUNNER_CPU_INT4"] = int8, int4
    os.environ["JOBRUNNER_CPU_FP8"] = fp8
    shipped_quant.FP8_DOT = fp8_dot              # False: the fp8 calls keep the float32 fp8 form
    eng = Engine(EngineConfig(model=model, quantization=quantization, dtype=dtype,
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


def fp8_checkpoints(root: Path, schemes: list[str]) -> dict[str, str]:
    """llmcompressor fp8 checkpoints of the default model's shape, random weights (tests/quantized_checkpoints.py,
    kept under root), and the float32 checkpoint of the first one's dequantized weights: name -> directory."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from quantized_checkpoints import make_compressed, save_reference
    out = {}
    for scheme in schemes:
        path = root / f"smollm2-135m-{scheme}"
        if not (path / "model.safetensors").exists():
            make_compressed(path, "llama", scheme, **DEFAULT_SHAPE)
        out[scheme] = str(path)
    out["float32"] = str(save_reference(out[schemes[0]]))
    return out


def fp8_job_part(rows_list: list[int], prompt: int, new: int, repeats: int, root: Path, schemes: list[str]) -> None:
    dirs = fp8_checkpoints(root, schemes)
    forms = (("bf16 form", "auto", True), ("f32 form", "auto", False), ("old path", "off", True))
    cases = [("float32", dirs["float32"], "auto", True, "float32")] + [
        (f"{s} {how}", dirs[s], mode, dot, "float32") for s in schemes for how, mode, dot in forms] + [
        ("bfloat16", dirs["float32"], "auto", True, "bfloat16")] + [
        (f"{s} bfloat16", dirs[s], "auto", True, "bfloat16") for s in schemes]   # bf16 rows: the form as they are
    print(f"\nfp8 job: llmcompressor checkpoints of the default model's shape ({root}), {prompt}-token prompts, "
          f"{new} new tokens each, EOS ignored; median wall of {repeats} rounds, interleaved; speed over float32 "
          "(the first checkpoint's dequantized weights, packed float32 linears)")
    for rows in rows_list:
        walls = {c[0]: [] for c in cases}
        toks = {}
        for _ in range(repeats):
            for name, model, fp8, dot, dtype in cases:
                w, toks[name] = job_once(rows, prompt, new, "none", "auto", "auto", model, fp8, dot, dtype)
                walls[name].append(w)
        base = statistics.median(walls["float32"])
        for name, *_ in cases:
            w = statistics.median(walls[name])
            print(f"rows {rows:3d}  {name:22s} {w:7.2f} s  {toks[name] / w:7.1f} tok/s  x{base / w:.2f}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("kernel", "job", "both", "fp8", "fp8-dot", "fp8-job"), default="both")
    ap.add_argument("--m", default="1,16,64", help="kernel rows, comma-separated")
    ap.add_argument("--group", type=int, default=None, help="kernel: scales per group of G columns (default per channel)")
    ap.add_argument("--rows", default="16", help="job rows, comma-separated")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--cases", default=None, help="job cases besides float32, comma-separated (default all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fp8-dir", default="/tmp/jobrunner-fp8-bench", help="fp8-job: where its checkpoints are kept")
    ap.add_argument("--schemes", default="FP8_DYNAMIC", help="fp8-job: llmcompressor schemes (FP8_BLOCK's "
                    "128-column activation groups do not divide the default model's 576)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(cpu_line())
    if args.part in ("kernel", "both"):
        kernel_part([int(v) for v in args.m.split(",")], args.group, args.repeats)
    if args.part == "fp8":
        fp8_part([int(v) for v in args.m.split(",")], args.repeats)
    if args.part == "fp8-dot":
        fp8_dot_part([int(v) for v in args.m.split(",")], args.repeats)
    if args.part == "fp8-job":
        fp8_job_part([int(v) for v in args.rows.split(",")], args.prompt, args.new, max(1, args.repeats // 2),
                     Path(args.fp8_dir), args.schemes.split(","))
    if args.part in ("job", "both"):
        job_part([int(v) for v in args.rows.split(",")], args.prompt, args.new, max(1, args.repeats // 2),
                 None if args.cases is None else args.cases.split(","))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
