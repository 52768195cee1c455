"""CPU prefill attention, one layer: the padded-SDPA reference, torch's flash attention (kernels/attention/
cpu_prefill.py, issue 34 item 3) and the in-place kernel (cpu_attention.c's prefill entry, issue 62).

    python -m benchmarks.cpu_prefill_bench                 # the default model's heads, 2 threads
    python -m benchmarks.cpu_prefill_bench --threads 1     # CPU time is then the least disturbed by load

Layouts: 4 prompts of 512 tokens and 16 of 128 (a prompt-only job's 2,048-token steps); one 2048-token chunk;
64 chunks of 16-48 tokens over one cached 320-token prefix (the shared-prefix workload's steps), its blocks
consecutive in the pool or shuffled; a 2048-token chunk after 2048 cached tokens. 9 query heads over 3 KV
heads, head_dim 64, block size 16. The candidates run in turn, round after round; each figure is a median
(wall and process CPU time); the ratios are CPU time against the reference's and the in-place kernel's
speed over flash (wall). "-" where the kernel is not built for this CPU (no AVX-512).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

H_Q, H_K, D, BS = 9, 3, 64, 16


def layout(seqs, prefix: int, consecutive: bool, rng: random.Random):
    """q, k_cache, v_cache, AttentionMetadata for prefill chunks seqs [(query_len, seq_len)]; the first
    `prefix` positions (whole blocks) of every sequence are the same blocks."""
    from jobrunner.kernels.attention.attention import AttentionMetadata
    shared_n = prefix // BS
    need = [-(-L // BS) for _, L in seqs]
    pool = list(range(shared_n + sum(need) + 3))
    shared = pool[:shared_n] if consecutive else rng.sample(pool, shared_n)
    free = [b for b in pool if b not in shared]
    rng.shuffle(free)
    tables, slots = [], []
    for (ql, L), n in zip(seqs, need):
        keep = min(shared_n, (L - ql) // BS)
        table = shared[:keep] + [free.pop() for _ in range(n - keep)]
        tables.append(table)
        slots += [table[p // BS] * BS + p % BS for p in range(L - ql, L)]
    meta = AttentionMetadata.build(BS, 0, [q for q, _ in seqs], [L for _, L in seqs], slots, tables, "cpu")
    shape = (len(pool), BS, H_K, D)
    return torch.randn(sum(q for q, _ in seqs), H_Q, D), torch.randn(shape), torch.randn(shape), meta


def _timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from jobrunner.engine.run.cpu_decode import ensure_library
    from jobrunner.kernels.attention import cpu_attention as ca
    from jobrunner.kernels.attention.reference import _prefill_ref
    from jobrunner.kernels.attention.cpu_prefill import prefill_attention_cpu
    lib = ca.DecodeLibrary(ensure_library())
    rng = random.Random(args.seed)
    short = [(n, 320 + n) for n in (rng.randint(16, 48) for _ in range(64))]
    cases = [("4 prompts of 512 tokens", [(512, 512)] * 4, 0, True),
             ("16 prompts of 128 tokens", [(128, 128)] * 16, 0, True),
             ("one 2048-token chunk", [(2048, 2048)], 0, True),
             ("64 chunks over a 320-token prefix, consecutive blocks", short, 320, True),
             ("64 chunks over a 320-token prefix, shuffled blocks", short, 320, False),
             ("a 2048-token chunk after 2048 cached", [(2048, 4096)], 0, False)]
    print(f"{torch.get_num_threads()} threads; ms a layer, median of {args.rounds} rounds (wall / CPU)\n")
    print("| layout | reference | flash (cpu_prefill) | in place | flash / ref (CPU) | in place over flash |\n"
          "|---|---|---|---|---|---|")
    for name, seqs, prefix, consecutive in cases:
        q, k, v, meta = layout(seqs, prefix, consecutive, rng)
        out = torch.empty_like(q)
        fns = {"ref": lambda: _prefill_ref(q, k, v, meta, D ** -0.5, None, None, None, None),
               "flash": lambda: prefill_attention_cpu(q, k, v, meta.prefill_plan(), D ** -0.5)}
        if lib.covers_prefill(q, k):
            fns["in place"] = lambda: ca.prefill_attention_in_place(q, k, v, meta.block_tables, meta.query_start_loc,
                                                                    meta.seq_lens_t, D ** -0.5, lib, out)
        want = fns["ref"]()
        torch.testing.assert_close(fns["flash"](), want, atol=1e-5, rtol=1e-5)
        if "in place" in fns:
            assert fns["in place"]()
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        rounds = [{n: _timed(f) for n, f in fns.items()} for _ in range(args.rounds)]
        med = {n: [1e3 * statistics.median(r[n][j] for r in rounds) for j in (0, 1)] for n in fns}
        cell = {n: f"{w:.1f} / {c:.1f}" for n, (w, c) in med.items()}
        over = f"{med['flash'][0] / med['in place'][0]:.2f}x" if "in place" in med else "-"
        print(f"| {name} | {cell['ref']} | {cell['flash']} | {cell.get('in place', '-')} | "
              f"{med['flash'][1] / med['ref'][1]:.2f} | {over} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
