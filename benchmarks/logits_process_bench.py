"""The logits processing step (engine/sample/logits_process.py) alone: host build and device apply per step.

    python -m benchmarks.logits_process_bench --rows 64 --vocab 49152 --prompt 128 --generated 64

Reported beside an argmax over the same logits, the least any sampling step does.
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from jobrunner.engine.sample.logits_process import LogitsAdjust
from jobrunner.engine.api.request import SamplingParams
from jobrunner.engine.schedule.sequence import Sequence


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--generated", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args(argv)
    rng, dev, vocab = random.Random(0), torch.device(args.device), args.vocab
    p = SamplingParams(max_tokens=4096, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)
    seqs = []
    for i in range(args.rows):
        s = Sequence(f"r{i}", [rng.randrange(vocab) for _ in range(args.prompt)], args.prompt, p)
        for _ in range(args.generated):
            s.append_token(rng.randrange(vocab))
        seqs.append(s)
    x = torch.randn(args.rows, vocab, device=dev)
    build = lambda: LogitsAdjust.build([p] * args.rows, seqs, (2,), vocab, dev)
    for name, fn in [("build (host)", build), ("build + apply", lambda: build().apply(x)),
                     ("argmax (reference)", lambda: x.argmax(-1))]:
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.repeat):
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        print(f"{name:20s} {(time.perf_counter() - t) / args.repeat * 1e3:8.2f} ms per step "
              f"({args.rows} rows, vocab {vocab}, {args.prompt}+{args.generated} tokens each, {dev})")


if __name__ == "__main__":
    main()
