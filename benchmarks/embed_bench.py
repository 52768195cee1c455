"""Embedding throughput, side by side: `jobrunner submit --kind embed` against transformers' batched
forward with the same pooling, on the same rows (issue 23: rows/s at least 2x transformers').

    python -m benchmarks.embed_bench                                  # 1,000 rows of ~100 tokens, default model
    python -m benchmarks.embed_bench --rows 64 --words 20:30          # a quick look

Rows are distinct texts of a number of words drawn uniformly from --words (default 45:105, about
60 to 140 tokens, 100 on average), in no particular order, as a corpus comes.

Both run in child processes (benchmarks.peers.run_child: wall, peak RSS, CPU seconds, the machine's
other load). jobrunner's rows/s is rows over its _stats.json wall_s (model load excluded, dataset
reading, tokenization and Parquet writing included); transformers' is rows over its timed loop
(tokenization, padded forwards of --batch rows in dataset order, pooling, normalization; load
excluded). The transformers child is this module run as a script:

    python -m benchmarks.embed_bench transformers --model M --prompts P.jsonl --pooling last --batch 32 --out R.json

As a check that both embed the same thing, the report gives the largest difference between the two
systems' vectors over the first rows (both run float32 from the same weights).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.peers import hf_source, run_child, run_jobrunner, transformers_available, _load_hf, _pythonpath

RESULTS = Path(__file__).resolve().parent / "results"
_WORDS = ("the quick brown fox jumps over lazy dogs while seven wizards quietly judge boxing matches near "
          "a river bank where engineers measure throughput latency memory and cost of batch inference jobs "
          "every night before the morning reports arrive at the office").split()


def make_rows(n: int, words: tuple[int, int], seed: int = 0) -> list[dict]:
    """n distinct rows of words[0]..words[1] words each (about 1.3 tokens a word with the default tokenizer)."""
    rng = random.Random(seed)
    return [{"id": f"r{i}", "prompt": f"document {i}: " + " ".join(
        rng.choice(_WORDS) for _ in range(rng.randint(*words)))} for i in range(n)]


def _span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


# ------------------------------------------------------------------------------ the transformers child

def _hf_embed(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.embed_bench transformers")
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokenizer")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--pooling", default="last", choices=("last", "mean", "cls"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--keep", type=int, default=8, help="vectors of the first rows written out, for the check")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import torch

    t0 = time.perf_counter()
    tok, model = _load_hf(args.model, args.tokenizer)        # left padding: the last token is at -1
    load_s = time.perf_counter() - t0
    texts = [json.loads(line)["prompt"] for line in open(args.prompts, encoding="utf-8") if line.strip()]
    kept, tokens = [], 0
    start = time.perf_counter()
    with torch.inference_mode():
        for lo in range(0, len(texts), args.batch):
            enc = tok(texts[lo:lo + args.batch], return_tensors="pt", padding=True)
            mask = enc["attention_mask"]
            tokens += int(mask.sum())
            hidden = model.model(**enc).last_hidden_state                   # [B, T, H], after the final norm
            if args.pooling == "last":
                v = hidden[:, -1]
            elif args.pooling == "mean":
                v = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
            else:                                                           # first real token (left padding)
                v = hidden[torch.arange(len(mask)), mask.argmax(1)]
            v = torch.nn.functional.normalize(v, dim=-1)
            kept += v[:max(0, args.keep - len(kept))].tolist()
    wall = time.perf_counter() - start
    Path(args.out).write_text(json.dumps({"wall_s": wall, "load_s": load_s, "rows": len(texts),
                                          "prompt_tokens": tokens, "vectors": kept}))
    return 0


def run_transformers_embed(prompts: Path, gguf: Path, out_json: Path, pooling: str, batch: int) -> dict:
    why = transformers_available()
    if why:
        return {"system": "transformers", "skipped": why}
    model, extra = hf_source(gguf)
    cmd = [sys.executable, "-m", "benchmarks.embed_bench", "transformers", "--model", model, "--prompts",
           str(prompts), "--pooling", pooling, "--batch", str(batch), "--out", str(out_json)]
    if extra.get("tokenizer"):
        cmd += ["--tokenizer", extra["tokenizer"]]
    res = {"system": "transformers", **run_child(cmd, out_json.with_suffix(".log"), env={"PYTHONPATH": _pythonpath()})}
    if res["rc"] != 0:
        res["error"] = f"exit code {res['rc']}; see {res['log']}"
        return res
    res.update(json.loads(out_json.read_text()))
    res["rows_per_s"] = res["rows"] / res["wall_s"]
    res["prompt_tokens_per_s"] = res["prompt_tokens"] / res["wall_s"]
    return res


# ------------------------------------------------------------------------------ the comparison

def _our_vectors(out_dir: Path, n: int) -> list[list[float]]:
    import pyarrow.dataset as ds
    table = ds.dataset(str(out_dir), format="parquet").to_table(columns=["id", "embedding"]).to_pylist()
    by_id = {r["id"]: r["embedding"] for r in table}
    return [by_id[f"r{i}"] for i in range(n)]


def _num(v) -> float:
    return float("nan") if v is None else v


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["transformers"]:
        return _hf_embed(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m benchmarks.embed_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--words", type=_span, default=(45, 105), help="words a row, N or LO:HI (default 45:105)")
    ap.add_argument("--pooling", default="last", choices=("last", "mean", "cls"))
    ap.add_argument("--batch", type=int, default=32, help="transformers: rows a forward")
    ap.add_argument("--kv-cache-memory", default="512MB",
                    help="jobrunner's KV cache: an embedding row holds blocks only while it is computed")
    args = ap.parse_args(argv)

    from jobrunner.models.known import resolve_model
    gguf = Path(resolve_model(args.model))
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    tmp = RESULTS / "tmp" / f"embed-{stamp}"
    tmp.mkdir(parents=True, exist_ok=True)
    prompts = tmp / "rows.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in make_rows(args.rows, args.words)))

    ours = run_jobrunner(prompts, tmp / "out", ["--kind", "embed", "-m", args.model, "--pooling", args.pooling,
                                                "--device", "cpu", "--kv-cache-memory", args.kv_cache_memory])
    hf = run_transformers_embed(prompts, gguf, tmp / "transformers.json", args.pooling, args.batch)
    report = {"stamp": stamp, "rows": args.rows, "words": list(args.words), "pooling": args.pooling,
              "model": args.model, "transformers_batch": args.batch,
              "jobrunner": {k: v for k, v in ours.items() if not k.startswith("row_")},
              "transformers": {k: v for k, v in hf.items() if k != "vectors"}}
    if "error" not in ours and "rows_per_s" in hf:
        report["ratio_rows_per_s"] = ours["rows_per_s"] / hf["rows_per_s"]
        mine = _our_vectors(tmp / "out", len(hf["vectors"]))
        report["max_abs_diff_first_rows"] = max(abs(a - b) for u, v in zip(mine, hf["vectors"]) for a, b in zip(u, v))
    out = RESULTS / f"embed-{stamp}.json"
    out.write_text(json.dumps(report, indent=1, default=str))
    for name in ("jobrunner", "transformers"):
        r = report[name]
        print(f"{name:12s} " + (f"{r['rows_per_s']:.2f} rows/s, {r['prompt_tokens_per_s']:.0f} prompt tok/s, "
                                f"{r['prompt_tokens']} tokens, wall {r['wall_s']:.1f}s, other load "
                                f"{_num(r.get('other_load_cores')):.1f} cores"
                                if "rows_per_s" in r else str(r.get("error") or r.get("skipped"))))
    if "ratio_rows_per_s" in report:
        print(f"ratio        {report['ratio_rows_per_s']:.2f}x rows/s (jobrunner / transformers); "
              f"max |diff| of the first vectors {report['max_abs_diff_first_rows']:.2e}")
    print(f"report       {out}")
    return 0 if "ratio_rows_per_s" in report else 1


if __name__ == "__main__":
    sys.exit(main())
