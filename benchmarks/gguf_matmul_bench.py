"""GGUF Q4_1 blocks on CPU: every candidate matmul path for the default model's layers, side by side.

    python -m benchmarks.gguf_matmul_bench                       # M = 1, 16, 64, 256; 1 thread
    python -m benchmarks.gguf_matmul_bench --m 64 --threads 2 --inductor

Issue 20 item 3 asks whether the GGUF blocks as shipped (Q4_1: 32 nibbles, a float16 scale and a
float16 min per block) multiplied with int8 activations, as llama.cpp does, beat the float paths.
Per layer shape of SmolLM2-135M (random weights quantized to Q4_1; the speed does not depend on
the values) and per batch of M tokens, each path's GFLOP/s (2 M N K / time, best of 3) and its
relative error against float32 on the dequantized weight (the `none` mode):

    f32            F.linear on the dequantized weight                         (--quantization none)
    bf16           the same in bfloat16                                        (--dtype bfloat16)
    w8a8-int_mm    per-channel int8 requantized, per-token int8 x, torch._int_mm (w8a8, int_mm backend)
    w8a8-fbgemm    the same through fbgemm's dynamic linear (per-batch x)      (w8a8, fbgemm backend)
    int4           the Q4_1 bytes as stored, dequantized a slice at a time     (--quantization int4)
    int4pack       torch's _weight_int4pack_mm_for_cpu, Q4_1 mapped exactly (zero = m + 8 d)
    dyn4           torch's _dyn_quant_matmul_4bit (KleidiAI on Arm; int8 x int4), min term added apart
    q4xq8-int_mm   kernels.gguf_matmul: llama.cpp's Q4_1 x Q8_1 math, one torch._int_mm per block
    q4xq8-fbgemm   one fbgemm dynamic linear per block, each with the block's scales per channel
    q4xq8-inductor torch.compile of the block dot (--inductor; minutes of compiling)

Timing only what the engine would call per step (weights packed once, outside the timing).
"""
from __future__ import annotations

import argparse
import os
import time
import warnings

import torch
import torch.nn.functional as F

SHAPES = {  # name -> (N, K): the default model's fused layers (30 of each) and its tied lm_head
    "qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576),
}


class Q4xQ8Linear(torch.nn.Module):
    """Benchmark-only (no --quantization scheme: slower than every existing mode on the CPUs measured):
    a linear whose GGUF blocks, as stored, multiply int8 activations per block of 32
    (kernels.gguf_matmul.gguf_int8_matmul, exact; llama.cpp's Q4_1 x Q8_1 / Q8_0 x Q8_0 numerics).
    q is the nibbles unpacked to int8 (twice the packed bytes), which torch._int_mm needs."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.register_buffer("q", q)        # [N, K] int8
        self.register_buffer("d", d)        # [N, K // 32] float32
        self.register_buffer("m", m)        # [N, K // 32] float32
        self.bias = bias

    def forward(self, x):
        from jobrunner.kernels.matmul.gguf_matmul import gguf_int8_matmul
        return gguf_int8_matmul(x, self.q, self.d, self.m, self.bias)


def swap_to_q4xq8(model: torch.nn.Module) -> int:
    """Replaces every group-32 Int4Linear / Int8Linear of a model quantized with `int4` from a GGUF file
    (Q4_0/Q4_1 layers and the Q8_0 lm_head, as stored) by a Q4xQ8Linear; returns how many."""
    from jobrunner.engine.quant.linear import Int4Linear, Int8Linear
    from jobrunner.kernels.matmul.gguf_matmul import gguf_weight_from_int4, gguf_weight_from_int8
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Int4Linear) and child.group_size == 32:
                qdm = gguf_weight_from_int4(child.packed, child.scales, child.zeros, child.in_features)
            elif isinstance(child, Int8Linear) and child.group_size == 32:
                qdm = gguf_weight_from_int8(child.qweight, child.scales)
            else:
                continue
            setattr(parent, name, Q4xQ8Linear(*qdm, child.bias))
            swapped += 1
    return swapped


def _bench(fn, budget_s: float = 0.3) -> float:
    fn()
    t = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t, 1e-6)
    reps = max(1, min(50, int(budget_s / once)))
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best


def candidates(n: int, k: int, gen: torch.Generator, inductor: bool = False) -> dict:
    """label -> (prepared callable x -> y) for one Q4_1 weight [n, k]."""
    from jobrunner.engine.quant import formats
    from jobrunner.kernels.ops import w8a8_matmul_fbgemm, w8a8_matmul_int_mm
    from jobrunner.kernels.matmul.gguf_matmul import gguf_dequantize, gguf_int8_matmul, gguf_weight_from_int4, quantize_blocks_ref
    from jobrunner.kernels.matmul.quant_matmul import _int4_matmul_cpu

    packed, s16, z16 = formats.quantize_int4(torch.randn(n, k, generator=gen) * 0.05, 32)   # Q4_1 blocks
    q, d, m = gguf_weight_from_int4(packed, s16, z16, k)
    w = gguf_dequantize(q, d, m)
    nb = k // 32
    out = {"f32": lambda x: F.linear(x, w)}
    wb = w.bfloat16()
    out["bf16"] = lambda x: F.linear(x.bfloat16(), wb).float()
    q8, s8 = formats.quantize_int8(w)
    out["w8a8-int_mm"] = lambda x: w8a8_matmul_int_mm(x, q8, s8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qw = torch._make_per_channel_quantized_tensor(q8, s8[:, 0].double(), torch.zeros(n, dtype=torch.long), 0)
        pk = torch.ops.quantized.linear_prepack(qw, None)
    out["w8a8-fbgemm"] = lambda x: w8a8_matmul_fbgemm(x, pk, n)
    out["int4"] = lambda x: _int4_matmul_cpu(x, packed, s16, z16, 32, None)
    try:   # tinygemm's convention: W = (q - 8) * scale + zero, scales_and_zeros [K // G, N, 2]
        pack4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1)
        sz = torch.stack([d.t(), (m + 8 * d).t()], -1).contiguous()
        out["int4pack"] = lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, pack4, 32, sz)
    except (RuntimeError, AttributeError):
        pass
    try:   # symmetric int4 groups (q - 8) * d; Q4_1's min (m + 8 d) is a [M, B] @ [B, N] float product apart
        nib = (q[:, 1::2].to(torch.uint8) << 4 | q[:, ::2].to(torch.uint8)).contiguous()   # the op's nibble order
        pw = torch.ops.aten._dyn_quant_pack_4bit_weight(nib, d.contiguous(), None, 32, k, n)
        off = (m + 8 * d).t().contiguous()
        out["dyn4"] = lambda x: torch.ops.aten._dyn_quant_matmul_4bit(x, pw, 32, k, n) + x.view(
            x.shape[0], nb, 32).sum(-1) @ off
    except (RuntimeError, AttributeError):
        pass
    out["q4xq8-int_mm"] = lambda x: gguf_int8_matmul(x, q, d, m)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        packs = []
        for b in range(nb):    # block b: weights q - 8 in int8 with per-channel scale d[:, b]
            qwb = torch._make_per_channel_quantized_tensor((q[:, b * 32:(b + 1) * 32] - 8).contiguous(),
                                                           d[:, b].double(), torch.zeros(n, dtype=torch.long), 0)
            packs.append(torch.ops.quantized.linear_prepack(qwb, None))
    off_all = (m + 8 * d).t().contiguous()

    def per_block_fbgemm(x):
        xb = x.view(x.shape[0], nb, 32)
        y = xb.sum(-1) @ off_all
        for b in range(nb):
            y += torch.ops.quantized.linear_dynamic(xb[:, b].contiguous(), packs[b], True)
        return y
    out["q4xq8-fbgemm"] = per_block_fbgemm
    if inductor:
        def blockdot(x, q, d, m):
            qx, dx = quantize_blocks_ref(x)
            t = x.shape[0]
            acc = (qx.view(t, 1, nb, 32).int() * q.view(1, n, nb, 32).int()).sum(-1)       # [T, N, B]
            s = dx * qx.view(t, nb, 32).sum(-1)
            return (acc.float() * dx[:, None] * d[None]).sum(-1) + s @ m.t()
        compiled = torch.compile(blockdot, dynamic=False)
        out["q4xq8-inductor"] = lambda x: compiled(x, q, d, m)
    return out


def run(args) -> list[tuple]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name in args.shapes:
        n, k = SHAPES[name]
        cands = candidates(n, k, gen, args.inductor)
        for mtok in args.m:
            x = torch.randn(mtok, k, generator=gen)
            ref = cands["f32"](x)
            for label, fn in cands.items():
                if args.only and label not in args.only and label != "f32":
                    continue
                try:
                    y = fn(x)
                    err = ((y.float() - ref).norm() / ref.norm()).item()
                    sec = _bench(lambda: fn(x), args.budget)
                except (RuntimeError, NotImplementedError) as e:
                    rows.append((name, n, k, mtok, label, float("nan"), float("nan"), str(e).splitlines()[0][:60]))
                    continue
                rows.append((name, n, k, mtok, label, 2 * mtok * n * k / sec / 1e9, err, ""))
                print(f"{name:8s} M={mtok:<4d} {label:15s} {rows[-1][5]:7.2f} GFLOP/s  rel err {err:.1e}",
                      flush=True)
    return rows


def markdown(rows, args, load) -> str:
    labels = list(dict.fromkeys(r[4] for r in rows))
    lines = [f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
             f"{args.threads} thread(s), load average before/after {load[0]} / {load[1]}. GFLOP/s (x f32):", "",
             "| layer [N x K] | M | " + " | ".join(labels) + " |", "|---|---:|" + "---:|" * len(labels)]
    by = {}
    for name, n, k, mtok, label, gf, err, note in rows:
        by.setdefault((name, n, k, mtok), {})[label] = (gf, err, note)
    for (name, n, k, mtok), cells in by.items():
        f32 = cells["f32"][0]
        row = [f"{gf:.1f} ({gf / f32:.2f})" if gf == gf else "fails" for gf, _, _ in
               (cells.get(lb, (float("nan"), 0, "")) for lb in labels)]
        lines.append(f"| {name} [{n} x {k}] | {mtok} | " + " | ".join(row) + " |")
    errs = {lb: max(r[6] for r in rows if r[4] == lb and r[6] == r[6]) for lb in labels
            if any(r[4] == lb and r[6] == r[6] for r in rows)}
    lines += ["", "Largest relative error against f32: " + ", ".join(f"{lb} {e:.1e}" for lb, e in errs.items())]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qkv,o,gate_up,down,lm_head")
    p.add_argument("--m", default="1,16,64,256", help="tokens per matmul (a decode step of M sequences)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--only", default="", help="comma-separated labels to run (f32 always runs)")
    p.add_argument("--budget", type=float, default=0.3, help="seconds of timing per repeat")
    p.add_argument("--inductor", action="store_true")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    args.shapes = args.shapes.split(",")
    args.m = [int(v) for v in args.m.split(",")]
    args.only = [s for s in args.only.split(",") if s]
    torch.set_num_threads(args.threads)
    before = " ".join(f"{v:.1f}" for v in os.getloadavg())
    rows = run(args)
    text = markdown(rows, args, (before, " ".join(f"{v:.1f}" for v in os.getloadavg())))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
