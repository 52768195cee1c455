"""Speculative decoding (issue 63): `--speculative auto` and `ngram` against `off`, on the jobs it is for and
on those it must not slow down. Every pair runs in one process tree, one after the other, on the same
machine state; figures are ratios of the same job's wall time (model load excluded).

    python -m benchmarks.speculative                       # every workload below
    python -m benchmarks.speculative --only extraction --rows 100 --modes off,auto
    python -m benchmarks.speculative --only extraction --jobrunner-args "--dtype bfloat16"

  extraction   rows whose answers copy spans of their prompts (repeat a passage, list its sentences,
               wrap it in JSON), 128 new tokens: at --max-num-seqs 8 and at the defaults
  long-tail    200 free-generation rows, ten of them with 10x the others' max_tokens (an OpenAI batch
               file: each line its own max_tokens), EOS ignored: the job's last minutes run a few rows
  cpu-suite    the CPU suite's shared prefix (classification) and free generation: auto must stay
               within 2% of off there
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
import tempfile
from pathlib import Path

from benchmarks import workloads as W
from benchmarks.peers import run_jobrunner

_PLACES = "harbor bridge library museum river station market garden tower school village mountain forest castle road".split()
_ASKS = (lambda p: f"Repeat the following text exactly, word for word.\n\nText: {p}",
         lambda p: f"{p}\n\nList every sentence above that mentions a year, copied exactly, one per line.",
         lambda p: f"Text: {p}\n\nReturn a JSON object with the field \"text\" holding the text above, unchanged.")


def extraction(rows: int, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(rows):
        passage = " ".join(f"The {rng.choice(_PLACES)} near the {rng.choice(_PLACES)} was built in "
                           f"{rng.randint(1700, 2000)}." for _ in range(rng.randint(4, 8)))
        out.append({"id": f"x{i:03d}", "prompt": _ASKS[i % len(_ASKS)](passage)})
    return out


def long_tail(tok, rows: int = 200, long_rows: int = 10, short: int = 32, seed: int = 3) -> list[dict]:
    base = W.free_generation(tok, n=rows, min_tokens=16, max_tokens=64, seed=seed)
    lines = W.openai_batch(tok, base, max_tokens=(short, short)).rows
    for line in random.Random(seed).sample(lines, long_rows):
        line["body"]["max_tokens"] = short * 10
    return lines


def _write(rows: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def compare(label: str, data: Path, tmp: Path, common: list[str], modes=("off", "auto", "ngram")) -> dict:
    """Each mode's wall time and figures on one dataset; prints a table row per mode."""
    walls = {}
    for mode in modes:
        res = run_jobrunner(data, tmp / f"out-{label}-{mode}", [*common, "--speculative", mode])
        if "error" in res:
            raise SystemExit(f"{label} {mode}: {res['error']}")
        eng = res.get("engine") or {}
        drafted, kept = eng.get("draft_tokens") or 0, eng.get("accepted_tokens") or 0
        walls[mode] = res["wall_s"]
        ratio = walls["off"] / res["wall_s"] if "off" in walls else 1.0
        print(f"| {label} | {mode} | {res['wall_s']:.1f} | {res['output_tokens_per_s']:.1f} | {ratio:.2f}x | "
              f"{kept:,} / {drafted:,} | {eng.get('steps', 0):,} |", flush=True)
    return walls


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m-instruct")
    ap.add_argument("--only", choices=("extraction", "long-tail", "cpu-suite"), action="append")
    ap.add_argument("--rows", type=int, default=100, help="extraction rows")
    ap.add_argument("--modes", default="off,auto,ngram", help="--speculative values to run (off first: the base)")
    ap.add_argument("--jobrunner-args", dest="extra", type=shlex.split, default=[],
                    help='extra options for every run, e.g. "--dtype bfloat16"')
    args = ap.parse_args(argv)
    modes = tuple(args.modes.split(","))
    only = set(args.only or ("extraction", "long-tail", "cpu-suite"))
    tmp = Path(tempfile.mkdtemp(prefix="speculative-"))
    tok = W.our_tokenizer(args.model)
    print("| job | --speculative | wall s | completion tok/s | speed vs off | accepted / drafted | steps |\n"
          "|---|---|---|---|---|---|---|")
    model = ["-m", args.model, *args.extra]
    if "extraction" in only:
        data = _write(extraction(args.rows), tmp / "extraction.jsonl")
        compare("extraction, batch 8", data, tmp, [*model, "--max-tokens", "128", "--max-num-seqs", "8"], modes)
        compare("extraction, defaults", data, tmp, [*model, "--max-tokens", "128"], modes)
    if "long-tail" in only:
        data = _write(long_tail(tok), tmp / "long-tail.jsonl")
        compare("long tail", data, tmp, [*model, "--ignore-eos"], modes)
    if "cpu-suite" in only:
        cls = W.shared_prefix(tok, n=64).write(tmp / "shared-prefix.jsonl")
        compare("shared prefix", cls, tmp, [*model, "--no-chat", "--max-tokens", "4"], modes=("off", "auto"))
        gen = W.free_generation(tok, n=64).write(tmp / "free-generation.jsonl")
        compare("free generation", gen, tmp, [*model, "--no-chat", "--max-tokens", "128", "--ignore-eos"],
                modes=("off", "auto"))


if __name__ == "__main__":
    main()
