"""One long row among many short ones (issue 41): the job with it against the same job without it.

    python -m benchmarks.long_row                              # 100 short rows, one of ~3,300 tokens
    python -m benchmarks.long_row --rows 400 --long-tokens 2700 --max-tokens 16
    python -m benchmarks.long_row --jobrunner-args "--quantization auto"       # both runs in auto's mode

The long row adds its own prefill and decode, not a padding of every short row's decode attention to
its length: the ratio "with / without" is what to watch (a job that pads pays it on every step that row
is in). Both runs are `jobrunner submit` as a user runs it, with the machine's state as it is.
"""
from __future__ import annotations

import argparse
import random
import shlex
import tempfile
from pathlib import Path

from benchmarks import workloads as W
from benchmarks.peers import run_jobrunner


def long_prompt(tok, tokens: int, seed: int = 5) -> str:
    """A document of about `tokens` tokens, then a question about it."""
    rng, words, s = random.Random(seed), W._GEN_WORDS, []
    while len(s) < tokens:                 # a word is one token or more: grown past, then cut by tokens
        s.append(rng.choice(words))
    ids = tok.encode(" ".join(s), add_special_tokens=False)[:tokens - 16]
    return tok.decode(ids) + "\n\nSummarize the text above in one sentence."


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, default=100, help="short rows")
    ap.add_argument("--long-tokens", type=int, default=3300)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--jobrunner-args", default="", help="more `jobrunner submit` options for both runs, one string")
    args = ap.parse_args(argv)

    tok = W.our_tokenizer(args.model)
    short = W.free_generation(tok, n=args.rows, min_tokens=16, max_tokens=64)
    tmp = Path(tempfile.mkdtemp(prefix="long-row-"))
    without = short.write(tmp / "short.jsonl")
    with_long = W.Workload("long-row", "", short.rows + [{"id": "long", "prompt": long_prompt(tok, args.long_tokens)}],
                           [], []).write(tmp / "with-long.jsonl")
    common = ["-m", args.model, "--no-chat", "--max-tokens", str(args.max_tokens), "--ignore-eos",
              *shlex.split(args.jobrunner_args)]
    print(f"{args.rows} short rows (16-64 tokens), {args.max_tokens} new tokens each; the long row: "
          f"~{args.long_tokens} tokens\n")
    print("| job | wall s | rows/s | prompt tokens | completion tokens |\n|---|---|---|---|---|")
    walls = {}
    for label, data in (("without the long row", without), ("with the long row", with_long)):
        res = run_jobrunner(data, tmp / f"out-{data.stem}", common)
        if "error" in res:
            raise SystemExit(f"{label}: {res['error']}")
        walls[label] = res["wall_s"]
        print(f"| {label} | {res['wall_s']:.1f} | {res['rows_per_s']:.2f} | {res['prompt_tokens']} | "
              f"{res['completion_tokens']} |", flush=True)
    print(f"\nwith / without: {walls['with the long row'] / walls['without the long row']:.2f}x")


if __name__ == "__main__":
    main()
