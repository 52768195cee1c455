"""CPU decode attention, the in-place kernel against the gather reference, on the default model's heads.

    python -m benchmarks.cpu_attention_bench                                  # float32, 64 sequences
    python -m benchmarks.cpu_attention_bench --dtype bfloat16 --layout job
    python -m benchmarks.cpu_attention_bench --batch 1 --lens 8000,8001       # one long row (split over threads)
    python -m benchmarks.cpu_attention_bench --layers 1                       # one layer's cache, warm in L3

One decode step of one layer: B sequences of --lens tokens (default 64..384, free generation's range),
9 query heads over 3 KV heads, head_dim 64, block size 16, each sequence's blocks scattered over the pool
(--layout shuffled: the worst case for the prefetchers) or consecutive, as a fresh job's pool hands out a
prompt's blocks (--layout job). A round runs each of --layers layers' caches in turn, as a step does (30, the
default model's: one layer's K and V, a few MB, would stay in the L3 cache between calls and show rates the
engine never sees). The candidates run in turn, round after round; each is reported as its median time a
layer, its ratio to the gather reference measured in the same rounds (the machine is shared: ratios, not
absolute times, are what compare), and the rate it reads the visible K and V at:

    gather+sdpa         kernels.attention's reference: index_select of the blocks, SDPA at one row
    in place            kernels.cpu_attention (the C library, built first if absent)

benchmarks/step_profile.py measures the same kernel inside the engine's real step (its "Decode attention
read ... GB/s" line).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lens", default="64,384", help="LO,HI: sequence lengths drawn from [LO, HI)")
    ap.add_argument("--pool", type=int, default=0, help="blocks in each layer's pool (default: 1.5x what the rows need)")
    ap.add_argument("--layers", type=int, default=30, help="layers, each with its own cache, run in turn")
    ap.add_argument("--layout", default="shuffled", choices=["shuffled", "job"],
                    help="blocks scattered over the pool, or each sequence's consecutive")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    from jobrunner.engine.run.cpu_decode import ensure_library
    from jobrunner.kernels.attention import cpu_attention as ca
    from jobrunner.kernels.attention.attention import AttentionMetadata, paged_attention_ref

    torch.manual_seed(a.seed)
    dtype = getattr(torch, a.dtype)
    B, Hq, Hk, D, BS = a.batch, 9, 3, 64, 16
    lo, hi = map(int, a.lens.split(","))
    lens = torch.randint(lo, hi, (B,)).tolist()
    need = sum(-(-L // BS) for L in lens) + 1
    NB = max(a.pool, need) if a.pool else need * 3 // 2
    caches = [(torch.randn(NB, BS, Hk, D).to(dtype), torch.randn(NB, BS, Hk, D).to(dtype)) for _ in range(a.layers)]
    k_cache, v_cache = caches[0]
    perm = torch.randperm(NB).tolist() if a.layout == "shuffled" else list(range(NB))[::-1]
    tables = [[perm.pop() for _ in range(-(-L // BS))] for L in lens]
    slots = [t[(L - 1) // BS] * BS + (L - 1) % BS for t, L in zip(tables, lens)]
    q = torch.randn(B, Hq, D).to(dtype)
    scale = D ** -0.5
    meta = AttentionMetadata.build(BS, B, [1] * B, lens, slots, tables, "cpu")
    ref = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, scale)

    t0 = time.perf_counter()
    path = ensure_library()
    build_s = time.perf_counter() - t0
    lib = ca.DecodeLibrary(path)

    def in_place(k, v):
        return ca.decode_attention_cpu(q, k, v, meta.block_tables, meta.seq_lens_t, scale, None, None, lib)

    layer_fns = {
        "gather+sdpa (reference)": lambda k, v: paged_attention_ref(q, k, v, meta, scale),
        "in place": in_place,
    }
    cands = {name: (lambda f=f: [f(k, v) for k, v in caches][0]) for name, f in layer_fns.items()}
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for name, f in cands.items():
        out = f()
        if isinstance(out, torch.Tensor):
            err = (out.float() - ref).abs().max().item()
            assert err < tol, f"{name}: max error {err}"
    times = {n: [] for n in cands}
    for _ in range(a.rounds):
        for n, f in cands.items():
            t0 = time.perf_counter()
            f()
            times[n].append((time.perf_counter() - t0) / a.layers)
    base = statistics.median(times["gather+sdpa (reference)"])
    kv_bytes = 2 * sum(lens) * Hk * D * k_cache.element_size()
    print(f"{a.dtype}, {B} sequences of {lo}..{hi} tokens (mean {sum(lens) / B:.0f}), {a.layers} layers of "
          f"{NB} blocks ({a.layout}), {torch.get_num_threads()} threads; K and V read a layer: "
          f"{kv_bytes / 1e6:.1f} MB; library ready in {build_s:.2f} s")
    print("| candidate | median ms a layer | ratio to gather+sdpa | K+V read at |\n|---|---|---|---|")
    for n, ts in times.items():
        m = statistics.median(ts)
        print(f"| {n} | {m * 1e3:.3f} | {m / base:.3f} | {kv_bytes / m / 1e9:.1f} GB/s |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
