"""Micro-benchmarks of each Triton kernel against its torch reference.

    python -m benchmarks.kernel_bench            # CUDA: time every kernel, print a table
    python -m benchmarks.kernel_bench --quick    # fewer, smaller cases
    python -m benchmarks.kernel_bench --compile-only [--check]
                                                 # any machine: compile every kernel for
                                                 # sm_90 (H100/H200) with ptxas, print
                                                 # registers / spills / shared memory

Shapes are Llama-3.1-8B's in bfloat16 (hidden 4096, 32 query heads, 8 KV heads,
head_dim 128, intermediate 14336, block_size 16). "GB/s" counts the bytes a kernel must
move at least (inputs read once, outputs written once): against the H200's ~4.8 TB/s
it says how close a memory-bound kernel is to the roofline.

On a machine without CUDA the timing part prints a message and exits 0. The
compile-only mode needs triton's bundled NVIDIA toolchain (ptxas, cuobjdump), no GPU;
run it without TRITON_INTERPRET (the interpreter replaces the compiler).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch

# ----------------------------------------------------------------------------- compile report

def _sm90_cases():
    """(name, kernel, pointer/float arg types, constexprs, launch options); other args are i32."""
    from jobrunner.kernels.activation import activation_triton as tact
    from jobrunner.kernels.attention import attention_triton as tatt
    from jobrunner.kernels.attention import kv_cache_triton as tkv
    from jobrunner.kernels.norm import norm_triton as tnorm
    from jobrunner.kernels.moe import moe_triton as tmoe
    from jobrunner.kernels.rotary import rotary_triton as trot
    bf = "*bf16"
    cases = [
        ("rms_norm+residual", tnorm._rms_norm_kernel,
         dict(x_ptr=bf, r_ptr=bf, w_ptr=bf, out_ptr=bf, res_out_ptr=bf, eps="fp32"),
         dict(HAS_RESIDUAL=True, BLOCK=4096), dict(num_warps=16)),
        ("silu_and_mul", tact._act_and_mul_kernel, dict(x_ptr=bf, out_ptr=bf), dict(BLOCK=1024, ACT="silu"),
         dict(num_warps=4)),
        ("gelu_tanh_and_mul", tact._act_and_mul_kernel, dict(x_ptr=bf, out_ptr=bf), dict(BLOCK=1024, ACT="gelu_tanh"),
         dict(num_warps=4)),
        ("rotary", trot._rotary_kernel, dict(q_ptr=bf, k_ptr=bf, qo_ptr=bf, ko_ptr=bf, cos_ptr=bf, sin_ptr=bf),
         dict(BLOCK_H=32, BLOCK_D=64), dict(num_warps=4)),
        ("decode_reduce", tatt._decode_reduce_kernel, dict(po_ptr="*fp32", plse_ptr="*fp32", out_ptr=bf),
         dict(BLOCK_S=8, BLOCK_D=128), dict(num_warps=4)),
    ]
    for int8 in (False, True):
        cp = "*i8" if int8 else bf
        tag = "int8" if int8 else "bf16"
        cases.append((f"store_kv {tag}", tkv._store_kv_kernel,
                      dict(k_ptr=bf, v_ptr=bf, kc_ptr=cp, vc_ptr=cp, ks_ptr="*fp32", vs_ptr="*fp32", slot_ptr="*i64"),
                      dict(BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128, INT8=int8), dict(num_warps=4)))
        attn = dict(q_ptr=bf, k_ptr=cp, v_ptr=cp, ks_ptr="*fp32", vs_ptr="*fp32", out_ptr=bf, po_ptr="*fp32",
                    plse_ptr="*fp32", bt_ptr="*i32", seq_lens_ptr="*i32", qsl_ptr="*i32", sm_scale_log2="fp32",
                    softcap_log2="fp32")
        # gemma2-9b: head_dim 256, group 2, soft-capped scores
        for model, D, group in (("llama8b", 128, 4), ("smollm", 64, 3), ("gemma2-9b", 256, 2)):
            if int8 and model != "llama8b":
                continue
            softcap = model.startswith("gemma2")
            for split in (False, True):
                cfg = tatt.decode_config(D, group, torch.bfloat16, int8)
                cases.append((f"decode {model} {tag}{' split-K' if split else ''}", tatt._decode_kernel, attn,
                              *_split_opts(dict(cfg, BLOCK_SIZE=16, SPLIT=split, KV_INT8=int8, SOFTCAP=softcap))))
            cfg = tatt.prefill_config(D, group, torch.bfloat16, 4096)
            cases.append((f"prefill {model} {tag}", tatt._prefill_kernel, attn,
                          *_split_opts(dict(cfg, BLOCK_SIZE=16, KV_INT8=int8, SOFTCAP=softcap))))
    moe = dict(a_ptr=bf, b_ptr=bf, scale_ptr="*fp32", w_ptr="*fp32", c_ptr=bf, sorted_ptr="*i32",
               block_expert_ptr="*i32")
    for weights, b in (("bf16", bf), ("fp8", "*fp8e4nv")):
        for block_m in (16, 64):
            for gated in (True, False):
                cases.append((f"fused_moe {'gate_up+silu' if gated else 'down'} {weights} M{block_m}",
                              tmoe._moe_gemm_kernel, dict(moe, b_ptr=b),
                              dict(stride_bn=1, A_DIV=8 if gated else 1, GATED=gated, HAS_SCALE=weights == "fp8",
                                   MUL_WEIGHT=not gated, IEEE=False, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64),
                              dict(num_warps=4)))
    return cases


def _split_opts(cfg: dict) -> tuple[dict, dict]:
    opts = {k: cfg.pop(k) for k in ("num_warps", "num_stages") if k in cfg}
    return cfg, opts


def cubin_resources(cubin: bytes) -> tuple[int, int] | None:
    """(registers, stack bytes: spills) of a compiled kernel, read with triton's bundled cuobjdump;
    None where that tool is missing."""
    import triton
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        res = subprocess.run([cuobjdump, "-res-usage", fh.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", res)
    return (int(m.group(1)), int(m.group(2))) if m else None


def compile_report(arch: int = 90) -> list[dict]:
    """Compile every kernel for sm_<arch> (no GPU needed) and read its resource usage."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_report needs TRITON_INTERPRET unset (the interpreter replaces the compiler)")
    target = GPUTarget("cuda", arch, 32)
    rows = []
    for name, kernel, types, constexprs, opts in _sm90_cases():
        fn = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)
        sig = {n: ("constexpr" if n in constexprs else types.get(n, "i32")) for n in fn.arg_names}
        # What a real launch of these shapes specializes on (triton marks every pointer and
        # int argument that is a multiple of 16): aligned pointers, strides and sizes;
        # not block-table rows, per-token scale strides, head counts or the window.
        odd = {"stride_bt", "stride_ss", "stride_sh", "stride_lh", "n_heads", "n_k_heads", "n_inner",
               "q_head_blocks", "window", "num_splits"}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if sig[n].startswith("*") or (sig[n] == "i32" and n not in odd)}
        k = triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs), target=target, options=opts)
        row = dict(kernel=name, regs=None, spill_bytes=None, smem=k.metadata.shared,
                   wgmma="wgmma" in k.asm["ptx"], cp_async="cp.async" in k.asm["ptx"])
        row["regs"], row["spill_bytes"] = cubin_resources(k.asm["cubin"]) or (None, None)
        rows.append(row)
    return rows


def _print_compile_report(rows) -> None:
    print(f"{'kernel (sm_90, bf16)':40s} {'regs':>5s} {'spill B':>8s} {'smem KB':>8s} "
          f"{'wgmma':>6s} {'cp.async':>8s}")
    for r in rows:
        print(f"{r['kernel']:40s} {r['regs'] or '?':>5} {r['spill_bytes'] if r['spill_bytes'] is not None else '?':>8} "
              f"{r['smem'] / 1024:8.1f} {str(r['wgmma']):>6s} {str(r['cp_async']):>8s}")


# ----------------------------------------------------------------------------- timing

def _bench(fn, quick: bool) -> float:
    """Milliseconds per call (CUDA: triton's do_bench; elsewhere one timed call, for smoke tests)."""
    if not torch.cuda.is_available():
        import time
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=30 if quick else 100)


def _attention_case(seqs, num_decodes, Hq, Hk, D, BS, dtype, device, int8=False):
    from jobrunner.kernels.attention.attention import AttentionMetadata
    from jobrunner.kernels.attention.kv_int8 import quantize_int8_ref
    nb = sum((L + BS - 1) // BS for _, L in seqs) + 1
    perm = torch.randperm(nb).tolist()
    tables, slots = [], []
    for ql, L in seqs:
        t = [perm.pop() for _ in range((L + BS - 1) // BS)]
        tables.append(t)
        slots += [t[p // BS] * BS + p % BS for p in range(L - ql, L)]
    meta = AttentionMetadata.build(BS, num_decodes, [q for q, _ in seqs], [L for _, L in seqs], slots, tables, device)
    q = torch.randn(sum(q for q, _ in seqs), Hq, D, device=device, dtype=dtype)
    k = torch.randn(nb, BS, Hk, D, device=device, dtype=dtype)
    v = torch.randn(nb, BS, Hk, D, device=device, dtype=dtype)
    if int8:
        (k, ks), (v, vs) = quantize_int8_ref(k), quantize_int8_ref(v)
        return q, (k, v, ks, vs), meta
    return q, (k, v), meta


@dataclass(frozen=True)
class _Shapes:
    """The timing cases' sizes: hidden H, intermediate I, query/KV heads, head_dim D, block size BS,
    tokens T; dtype dt and device dev."""
    H: int
    I: int
    Hq: int
    Hk: int
    D: int
    BS: int
    T: int
    dt: torch.dtype
    dev: str


def _timing_shapes(quick: bool, device: str, tiny: bool) -> _Shapes:
    dt = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float16
    H, I, Hq, Hk, D, BS = (64, 96, 4, 2, 32, 16) if tiny else (4096, 14336, 32, 8, 128, 16)
    T = 32 if tiny else 1024 if quick else 4096
    return _Shapes(H, I, Hq, Hk, D, BS, T, dt, device)


def _row_adder(rows: list, quick: bool):
    """add(op, shape, triton fn, reference fn or None, bytes moved): time both, append a row, print it."""
    def add(op, shape, tri, ref, nbytes):
        t_ms, r_ms = _bench(tri, quick), _bench(ref, quick) if ref is not None else float("nan")
        rows.append((op, shape, t_ms, r_ms, nbytes / t_ms / 1e6 if nbytes else float("nan")))
        print(f"  {op:28s} {shape:34s} {t_ms * 1e3:9.1f} us", flush=True)
    return add


def _time_pointwise(add, s: _Shapes) -> None:
    """rms_norm + residual, silu_and_mul and rotary."""
    from jobrunner.kernels.activation.activation import gelu_tanh_and_mul_ref, silu_and_mul_ref
    from jobrunner.kernels.norm.norm import rms_norm_ref
    from jobrunner.kernels.rotary.rotary import apply_rotary_ref, inverse_frequencies, rotary_cos_sin
    from jobrunner.kernels.activation.activation_triton import gelu_tanh_and_mul_triton, silu_and_mul_triton
    from jobrunner.kernels.norm.norm_triton import rms_norm_triton
    from jobrunner.kernels.rotary.rotary_triton import apply_rotary_triton
    T, H, I, Hq, Hk, D, dev, dt = s.T, s.H, s.I, s.Hq, s.Hk, s.D, s.dev, s.dt
    e = 2  # bytes per bf16 element
    x, r = torch.randn(T, H, device=dev, dtype=dt), torch.randn(T, H, device=dev, dtype=dt)
    w = torch.randn(H, device=dev, dtype=dt)
    add("rms_norm + residual", f"[{T}, {H}]", lambda: rms_norm_triton(x, w, 1e-5, r),
        lambda: rms_norm_ref(x, w, 1e-5, r), 4 * T * H * e)
    gu = torch.randn(T, 2 * I, device=dev, dtype=dt)
    add("silu_and_mul", f"[{T}, 2x{I}]", lambda: silu_and_mul_triton(gu), lambda: silu_and_mul_ref(gu), 3 * T * I * e)
    add("gelu_tanh_and_mul", f"[{T}, 2x{I}]", lambda: gelu_tanh_and_mul_triton(gu), lambda: gelu_tanh_and_mul_ref(gu),
        3 * T * I * e)
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, device=dev, dtype=dt)
    q, k = qkv[:, :Hq * D].view(T, Hq, D), qkv[:, Hq * D:(Hq + Hk) * D].view(T, Hk, D)
    cos, sin = rotary_cos_sin(torch.arange(T, device=dev), inverse_frequencies(D, 5e5, None).to(dev), dt)
    add("rotary (q and k)", f"T={T} Hq={Hq} Hk={Hk} D={D}", lambda: apply_rotary_triton(q, k, cos, sin),
        lambda: apply_rotary_ref(q, k, cos, sin), 2 * T * (Hq + Hk) * D * e + 2 * T * D * e)


def _time_store_kv(add, s: _Shapes) -> None:
    """store_kv into a bf16 and an int8 cache."""
    from jobrunner.kernels.attention.attention import store_kv_ref
    from jobrunner.kernels.attention.kv_int8 import store_kv_int8_ref
    from jobrunner.kernels.attention.kv_cache_triton import store_kv_triton
    T, Hk, D, BS, dev, dt = s.T, s.Hk, s.D, s.BS, s.dev, s.dt
    e = 2  # bytes per bf16 element
    nb = T // BS + 8
    kc, vc = torch.zeros(nb, BS, Hk, D, device=dev, dtype=dt), torch.zeros(nb, BS, Hk, D, device=dev, dtype=dt)
    kn, vn = torch.randn(T, Hk, D, device=dev, dtype=dt), torch.randn(T, Hk, D, device=dev, dtype=dt)
    slots = torch.randperm(nb * BS, device=dev)[:T]
    add("store_kv", f"T={T} Hk={Hk} D={D}", lambda: store_kv_triton(kn, vn, kc, vc, slots),
        lambda: store_kv_ref(kn, vn, kc, vc, slots), 4 * T * Hk * D * e)
    kq, vq = torch.zeros_like(kc, dtype=torch.int8), torch.zeros_like(vc, dtype=torch.int8)
    ks, vs = torch.zeros(nb, BS, Hk, device=dev), torch.zeros(nb, BS, Hk, device=dev)
    add("store_kv int8", f"T={T} Hk={Hk} D={D}", lambda: store_kv_triton(kn, vn, kq, vq, slots, ks, vs),
        lambda: store_kv_int8_ref(kn, vn, kq, vq, ks, vs, slots), 2 * T * Hk * D * (e + 1))


def _time_decode(add, s: _Shapes, quick: bool, tiny: bool) -> None:
    """Paged decode attention (split-K and not; int8 cache on the first batch size)."""
    from jobrunner.kernels.attention.attention import paged_attention_ref
    from jobrunner.kernels.attention.kv_int8 import paged_attention_int8_ref
    from jobrunner.kernels.attention.attention_triton import paged_attention_triton
    Hq, Hk, D, BS, dev, dt = s.Hq, s.Hk, s.D, s.BS, s.dev, s.dt
    e = 2  # bytes per bf16 element
    scale = D ** -0.5
    decode_cases = [(3, 40)] if tiny else [(64, 1024), (4, 16384)] if quick else [(64, 1024), (256, 1024), (8, 32768)]
    for B, ctx in decode_cases:
        qd, cache, meta = _attention_case([(1, ctx)] * B, B, Hq, Hk, D, BS, dt, dev)
        kv_bytes = 2 * B * ctx * Hk * D * e
        ref = (lambda qd=qd, cache=cache, meta=meta: paged_attention_ref(qd, *cache, meta, scale)) \
            if B * ctx <= 256 * 1024 else None
        add("decode", f"B={B} ctx={ctx}", lambda qd=qd, cache=cache, meta=meta:
            paged_attention_triton(qd, *cache, meta, scale), ref, kv_bytes)
        add("decode, no split", f"B={B} ctx={ctx}", lambda qd=qd, cache=cache, meta=meta:
            paged_attention_triton(qd, *cache, meta, scale, num_splits=1), None, kv_bytes)
        add("decode, softcap 50", f"B={B} ctx={ctx}", lambda qd=qd, cache=cache, meta=meta:
            paged_attention_triton(qd, *cache, meta, scale, softcap=50.0), None, kv_bytes)
        if B == decode_cases[0][0]:
            qi, ci, mi = _attention_case([(1, ctx)] * B, B, Hq, Hk, D, BS, dt, dev, int8=True)
            add("decode int8 cache", f"B={B} ctx={ctx}", lambda: paged_attention_triton(
                qi, ci[0], ci[1], mi, scale, k_scale=ci[2], v_scale=ci[3]),
                lambda: paged_attention_int8_ref(qi, *ci, mi, scale), B * ctx * Hk * D * (2 + 8 / D))


def _time_prefill(rows: list, s: _Shapes, quick: bool, tiny: bool) -> None:
    """Paged prefill attention (reported in TFLOP/s, no GB/s)."""
    from jobrunner.kernels.attention.attention import paged_attention_ref
    from jobrunner.kernels.attention.attention_triton import paged_attention_triton
    Hq, Hk, D, BS, dev, dt = s.Hq, s.Hk, s.D, s.BS, s.dev, s.dt
    scale = D ** -0.5
    prefill_cases = ([[(20, 30)]] if tiny else [[(512, 512)] * 2] if quick
                     else [[(1024, 1024)] * 4, [(512, 4096)] * 2])
    for seqs in prefill_cases:
        qp, cache, meta = _attention_case(seqs, 0, Hq, Hk, D, BS, dt, dev)
        flops = sum(4 * ql * (L - ql / 2) * Hq * D for ql, L in seqs)
        t_ms = _bench(lambda: paged_attention_triton(qp, *cache, meta, scale), quick)
        r_ms = _bench(lambda: paged_attention_ref(qp, *cache, meta, scale), quick)
        shape = f"{len(seqs)}x chunk {seqs[0][0]} / ctx {seqs[0][1]}"
        rows.append(("prefill", shape, t_ms, r_ms, float("nan")))
        print(f"  {'prefill':28s} {shape:34s} {t_ms * 1e3:9.1f} us  {flops / t_ms / 1e9:.1f} TFLOP/s", flush=True)


GROUPS = ("pointwise", "store_kv", "decode", "prefill", "fused_moe", "lora")


def run_timings(quick: bool = False, device: str = "cuda", tiny: bool = False, only: str | None = None) -> list[tuple]:
    """Time each kernel and its reference. tiny=True: toy shapes (a smoke test of this
    script; on CPU tensors the kernels run in the interpreter). only: one of GROUPS."""
    s = _timing_shapes(quick, device, tiny)
    rows = []
    add = _row_adder(rows, quick)
    groups = {"pointwise": lambda: _time_pointwise(add, s), "store_kv": lambda: _time_store_kv(add, s),
              "decode": lambda: _time_decode(add, s, quick, tiny),
              "prefill": lambda: _time_prefill(rows, s, quick, tiny), "fused_moe": lambda: _time_moe(add, s, tiny),
              "lora": lambda: _time_lora(add, s)}
    for name in GROUPS:
        if only in (None, name):
            groups[name]()
    return rows


def _time_lora(add, s: _Shapes) -> None:
    """The segmented gather matmul of batched LoRA: shrink (H -> rank 16) and expand (16 -> H) over
    four adapters' segments of the step's tokens."""
    from jobrunner.kernels.lora.sgmv import Segments, sgmv_ref
    from jobrunner.kernels.lora.sgmv_triton import sgmv_triton
    T, H, dev, dt, r = s.T, s.H, s.dev, s.dt, 16
    seg = Segments([(i * (T // 4), T // 4, i) for i in range(4)], torch.device(dev))
    x, a = torch.randn(T, H, device=dev, dtype=dt), torch.randn(4, r, H, device=dev, dtype=dt)
    h, b = torch.zeros(T, r, device=dev, dtype=dt), torch.randn(4, H, r, device=dev, dtype=dt)
    y = torch.zeros(T, H, device=dev, dtype=dt)
    add("sgmv shrink (4 adapters)", f"[{T}, {H}] -> r {r}", lambda: sgmv_triton(x, a, seg, h),
        lambda: sgmv_ref(x, a, seg, h), (T * H + 4 * r * H + T * r) * 2)
    add("sgmv expand (4 adapters)", f"[{T}, {r}] -> {H}", lambda: sgmv_triton(h, b, seg, y),
        lambda: sgmv_ref(h, b, seg, y), (T * r + 4 * r * H + 2 * T * H) * 2)


def _time_moe(add, s: _Shapes, tiny: bool) -> None:
    """fused_moe at Qwen3-30B-A3B's layer shapes (hidden 2048, 128 experts of 768, top 8): decode
    batches and a prefill step, bfloat16 and fp8 weights. GB/s counts the experts the batch touches."""
    from jobrunner.kernels.moe.moe import fused_moe_ref, route_topk
    from jobrunner.kernels.moe.moe_triton import fused_moe_triton
    dev, dt = s.dev, s.dt
    H, I, E, k = (64, 32, 8, 2) if tiny else (2048, 768, 128, 8)
    w13 = torch.randn(E, H, 2 * I, device=dev, dtype=dt) * H ** -0.5         # input-major (kernels/moe/moe.py)
    w2 = torch.randn(E, I, H, device=dev, dtype=dt) * I ** -0.5
    variants = [("bf16", (w13, w2, None, None), 2)]            # (name, weights and scales, bytes per weight)
    if torch.device(dev).type == "cuda":
        s13, s2 = w13.float().abs().amax(1) / 448, w2.float().abs().amax(1) / 448     # [E, N]
        q13 = (w13.float() / s13[:, None]).to(torch.float8_e4m3fn)
        q2 = (w2.float() / s2[:, None]).to(torch.float8_e4m3fn)
        variants.append(("fp8", (q13, q2, s13, s2), 1))
    for T in ((3, 40) if tiny else (64, 512, 4096)):
        x = torch.randn(T, H, device=dev, dtype=dt)
        weights, ids = route_topk(torch.randn(T, E, device=dev), k, True)
        touched = ids.unique().numel() * 3 * H * I               # weights of the experts this batch uses
        for name, (a, b, sa, sb), nbytes in variants:
            args = (x, a, b, weights, ids, sa, sb)
            ref = (lambda args=args: fused_moe_ref(*args)) if T <= 512 else None
            add(f"fused_moe {name}", f"T={T} E={E} k={k} H={H} I={I}", lambda args=args: fused_moe_triton(*args),
                ref, touched * nbytes + 2 * T * H * 2)


def _print_timings(rows) -> None:
    print(f"\n{'op':28s} {'shape':34s} {'triton us':>10s} {'torch us':>10s} {'speedup':>8s} {'GB/s':>8s}")
    for op, shape, t, r, gbs in rows:
        sp = r / t if r == r else float("nan")
        print(f"{op:28s} {shape:34s} {t * 1e3:10.1f} {r * 1e3:10.1f} {sp:8.2f} {gbs:8.0f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer, smaller cases")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90 and report resources (no GPU)")
    ap.add_argument("--check", action="store_true", help="with --compile-only: exit 1 if a 16-bit kernel spills")
    ap.add_argument("--only", choices=GROUPS, help="time one group of kernels")
    ap.add_argument("--tiny", action="store_true", help="toy shapes (a smoke run)")
    args = ap.parse_args(argv)
    try:
        import triton  # noqa: F401
    except ImportError:
        print("kernel_bench: triton is not installed; nothing to do")
        return 0
    if args.compile_only:
        rows = compile_report()
        _print_compile_report(rows)
        if args.check:
            bad = [r["kernel"] for r in rows if r["spill_bytes"]]
            if bad:
                print(f"register spills in: {', '.join(bad)}")
                return 1
        return 0
    if not torch.cuda.is_available():
        print("kernel_bench: no CUDA device; the timings need a GPU (try --compile-only for the sm_90 report)")
        return 0
    print(f"kernel_bench on {torch.cuda.get_device_name()} (bfloat16, Llama-3.1-8B shapes; MoE: Qwen3-30B-A3B's)")
    _print_timings(run_timings(args.quick, tiny=args.tiny, only=args.only))
    return 0


if __name__ == "__main__":
    sys.exit(main())
