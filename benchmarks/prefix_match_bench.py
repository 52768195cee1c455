"""Prefix-cache lookup cost as the cache fills: the engine's host time to admit one prompt.

    python -m benchmarks.prefix_match_bench --cached 1000 10000 50000

Fills a KV manager with N released 40-token random prompts (two full blocks and a partial one
each, all cached), then times match_prefix for 500 new random prompts. A long job keeps
hundreds of thousands of blocks cached on a large GPU, so a lookup that grows with the cache
would dominate the scheduler.
"""
from __future__ import annotations

import argparse
import random
import time

from jobrunner.engine.schedule.kv_manager import KVCacheManager
from jobrunner.engine.api.request import SamplingParams
from jobrunner.engine.schedule.sequence import Sequence

VOCAB = 49152


def match_us(num_cached: int, probes: int = 500, prompt_len: int = 40, seed: int = 0) -> float:
    rng = random.Random(seed)
    params = SamplingParams()
    prompt = lambda: [rng.randrange(VOCAB) for _ in range(prompt_len)]
    kv = KVCacheManager(num_cached * 3 + 10, block_size=16)
    for i in range(num_cached):
        s = Sequence(str(i), prompt(), prompt_len, params)
        kv.allocate(s, prompt_len)
        kv.end_step()
        kv.free(s)
    new = [Sequence("q", prompt(), prompt_len, params) for _ in range(probes)]
    t = time.perf_counter()
    for s in new:
        kv.match_prefix(s, prompt_len - 1)
    return (time.perf_counter() - t) / probes * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cached", type=int, nargs="+", default=[1000, 10000, 50000])
    args = ap.parse_args()
    for n in args.cached:
        print(f"{n:>8} cached prompts: {match_us(n):8.1f} us per match_prefix")


if __name__ == "__main__":
    main()
