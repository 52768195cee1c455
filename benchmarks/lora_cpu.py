"""LoRA on CPU (issue 33): the default model with four rank-16 adapters on every projection, rows spread
evenly over them, in one job; against the same rows on the base model alone, and against four jobs of
one adapter's rows each (what merging each adapter into its own checkpoint costs: a merged model
computes exactly as the base does, so each of the four is timed as a base-model job over its rows,
model load included; the merge itself is left out, in the four jobs' favour).

    python -m benchmarks.lora_cpu [--rows 256] [--max-tokens 32] [--workdir /tmp/lora-bench]

Each job is its own `jobrunner submit` process (wall time, load included). Adapters are made by peft
(random, B non-zero) on a transformers Llama of the default model's shapes.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

NAMES = ("a0", "a1", "a2", "a3")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(workdir: Path, rank: int) -> dict[str, Path]:
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    from jobrunner.engine import load_model_bundle
    from jobrunner.models.known import DEFAULT_MODEL, resolve_model
    cfg = load_model_bundle(resolve_model(DEFAULT_MODEL)).config
    hf_cfg = transformers.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                      intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                                      num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                                      tie_word_embeddings=True)
    out = {}
    for i, name in enumerate(NAMES):
        path = workdir / name
        if not (path / "adapter_model.safetensors").exists():
            torch.manual_seed(i)
            hf = transformers.LlamaForCausalLM(hf_cfg)
            lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
            get_peft_model(hf, lora).save_pretrained(str(path))
        out[name] = path
    return out


def write_rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def submit(dataset: str, output: Path, *args: str) -> float:
    cmd = [sys.executable, "-m", "jobrunner.cli.main", "submit", dataset, "-o", str(output), "--overwrite", *args]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--workdir", default="/tmp/lora-bench")
    a = ap.parse_args()
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    adapters = make_adapters(work, a.rank)
    rows = [{"id": str(i), "prompt": f"Write one sentence about topic number {i}.", "adapter": NAMES[i % 4]}
            for i in range(a.rows)]
    common = ["--max-tokens", str(a.max_tokens), "--ignore-eos"]
    loras = [x for n, p in adapters.items() for x in ("--lora", f"{n}={p}")]
    all_rows = write_rows(work / "rows.jsonl", rows)
    per = {n: write_rows(work / f"rows-{n}.jsonl", [r for r in rows if r["adapter"] == n]) for n in NAMES}
    base = submit(all_rows, work / "out-base", *common)
    mixed = submit(all_rows, work / "out-lora", *common, *loras, "--lora-column", "adapter")
    four = sum(submit(per[n], work / f"out-{n}", *common) for n in NAMES)
    tokens = a.rows * a.max_tokens
    print(json.dumps({"rows": a.rows, "max_tokens": a.max_tokens, "rank": a.rank,
                      "base_s": round(base, 1), "lora_mixed_s": round(mixed, 1), "four_merged_jobs_s": round(four, 1),
                      "lora_vs_base": round(mixed / base, 2), "lora_vs_four_jobs": round(mixed / four, 2),
                      "lora_tok_s": round(tokens / mixed, 1), "base_tok_s": round(tokens / base, 1)}))


if __name__ == "__main__":
    main()
