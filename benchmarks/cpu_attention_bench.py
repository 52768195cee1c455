"""CPU decode attention, the candidates side by side (issue 20 item 1), on the default model's heads.

    python -m benchmarks.cpu_attention_bench                        # float32, 64 sequences
    python -m benchmarks.cpu_attention_bench --dtype bfloat16 --batch 8 --compile-ref

One decode step of one layer: B sequences of 64..384 tokens (free generation's range), 9 query heads
over 3 KV heads, head_dim 64, block size 16, each sequence's blocks scattered over the pool
(--layout shuffled) or consecutive, as a job's pool hands them out (--layout job: the gather then copies
runs of memory). The engine's choice for bfloat16 (gather) came from its steps, not from here
(RESULTS.md, issue 34). The candidates run in turn, round after round, and each is reported as its
median and its ratio to the gather reference measured in the same rounds (the machine is shared:
ratios, not absolute times, are what compare):

    gather+sdpa         kernels.attention's reference: index_select of the blocks, SDPA at one row
    gather only         its copy alone
    sdpa, no gather     SDPA over context already contiguous: the floor of per-sequence context
                        buffers kept between steps (their upkeep, a copy of each new token and a
                        re-pack when the batch changes, not counted)
    gather+gqa matmul   the GQA group as [G, D] x [D, L] products after the same gather
    compile(reference)  torch.compile(dynamic=True) of gather+sdpa (--compile-ref: its first call
                        compiles for tens of seconds)
    flex in place       kernels.cpu_attention's package (built first if absent), its block mask
                        included (built once per step in the engine; timed here per call: "+mask")
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--pool", type=int, default=4000, help="blocks in the pool")
    ap.add_argument("--layout", default="shuffled", choices=["shuffled", "job"],
                    help="blocks scattered over the pool, or each sequence's consecutive")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--compile-ref", action="store_true", help="also torch.compile the reference")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    from engine.cpu_decode import build_package, package_path
    from kernels import cpu_attention as ca
    from kernels.attention import AttentionMetadata, paged_attention_ref
    from kernels.attention_ref import _blocks, _sdpa

    torch.manual_seed(a.seed)
    dtype = getattr(torch, a.dtype)
    B, Hq, Hk, D, BS, NB = a.batch, 9, 3, 64, 16, a.pool
    G = Hq // Hk
    lens = torch.randint(64, 384, (B,)).tolist()
    k_cache = torch.randn(NB, BS, Hk, D).to(dtype)
    v_cache = torch.randn(NB, BS, Hk, D).to(dtype)
    perm = torch.randperm(NB).tolist() if a.layout == "shuffled" else list(range(NB))[::-1]
    tables = [[perm.pop() for _ in range(-(-L // BS))] for L in lens]
    slots = [t[(L - 1) // BS] * BS + (L - 1) % BS for t, L in zip(tables, lens)]
    q = torch.randn(B, Hq, D).to(dtype)
    scale = D ** -0.5
    meta = AttentionMetadata.build(BS, B, [1] * B, lens, slots, tables, "cpu")
    ref = paged_attention_ref(q, k_cache, v_cache, meta, scale)

    key = ca.decode_key(q, k_cache, None)
    path = package_path(key)
    t0 = time.perf_counter()
    if not path.exists():
        build_package(key, path)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    runner = ca.load_decode_package(path)
    load_s = time.perf_counter() - t0
    mask = meta.decode_mask(NB, None)

    def gather():
        blocks = meta._decode[0]
        return _blocks(k_cache, None, blocks, B, dtype), _blocks(v_cache, None, blocks, B, dtype)
    kg, vg = gather()
    causal = meta.mask("decode", None)

    def gqa_mm():
        k, v = gather()
        s = torch.matmul(q.view(B, Hk, G, D), k.permute(0, 2, 3, 1)) * scale
        s = s.masked_fill(~causal.view(B, 1, 1, -1), float("-inf"))
        return torch.matmul(torch.softmax(s, -1, dtype=torch.float32).to(dtype), v.transpose(1, 2)).reshape(B, Hq, D)

    def flex_with_mask():
        m = ca.DecodeMask.build(meta.block_tables, meta.seq_lens_t, BS, NB, None)
        return ca.decode_attention_cpu(q, k_cache, v_cache, m, scale, None, runner)

    cands = {
        "gather+sdpa (reference)": lambda: paged_attention_ref(q, k_cache, v_cache, meta, scale),
        "gather only": gather,
        "sdpa, no gather (context-buffer floor)": lambda: _sdpa(q[:, None], kg, vg, causal, scale)[:, 0],
        "gather+gqa matmul": gqa_mm,
        "flex in place": lambda: ca.decode_attention_cpu(q, k_cache, v_cache, mask, scale, None, runner),
        "flex in place +mask": flex_with_mask,
    }
    first = {}
    if a.compile_ref:
        def ref_fn(q, k_cache, v_cache, blocks, m):
            k = k_cache.index_select(0, blocks).view(q.shape[0], -1, Hk, D)
            v = v_cache.index_select(0, blocks).view(q.shape[0], -1, Hk, D)
            return _sdpa(q[:, None], k, v, m, scale)[:, 0]
        compiled = torch.compile(ref_fn, dynamic=True)
        cands["compile(reference)"] = lambda: compiled(q, k_cache, v_cache, meta._decode[0], causal)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for name, f in cands.items():
        t0 = time.perf_counter()
        out = f()
        first[name] = time.perf_counter() - t0
        if isinstance(out, torch.Tensor):
            err = (out.reshape(ref.shape).float() - ref.float()).abs().max().item()
            assert err < tol, f"{name}: max error {err}"
    times = {n: [] for n in cands}
    for _ in range(a.rounds):
        for n, f in cands.items():
            t0 = time.perf_counter()
            f()
            times[n].append(time.perf_counter() - t0)
    base = statistics.median(times["gather+sdpa (reference)"])
    print(f"{a.dtype}, {B} sequences of 64..384 tokens (mean {sum(lens) / B:.0f}), pool {NB} blocks ({a.layout}), "
          f"{torch.get_num_threads()} threads; package build {build_s:.1f} s, load {load_s * 1e3:.1f} ms")
    print("| candidate | median ms | ratio to gather+sdpa | first call s |\n|---|---|---|---|")
    for n, ts in times.items():
        m = statistics.median(ts)
        print(f"| {n} | {m * 1e3:.2f} | {m / base:.2f} | {first[n]:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
