"""lm-evaluation-harness on the default model: `lm_eval --model jobrunner` against `lm_eval --model hf`,
side by side in one run on the same machine, on two local tasks (no dataset hub):

  * bench_mc: a synthetic hellaswag-like multiple-choice task, --questions questions (default 500) of
    four endings each, behind a task description shared by all of them (as MMLU's subjects have);
  * bench_ppl: whole-document perplexity (loglikelihood_rolling) over this repository's own docs,
    cut into --docs documents, scored in rolling windows of max_length 256.

    python -m benchmarks.lm_eval_bench                     # both tasks, both backends (~10+ min on 2 cores)
    python -m benchmarks.lm_eval_bench --questions 40 --docs 4 --hf-batch-size 8    # a quick look

Both backends load the same float32 safetensors directory, converted once from the default model's
GGUF with transformers (cached under <jobrunner cache>/lm-eval-bench/), with dtype float32. Every
run is its own process (`python -c "... cli_evaluate()"`, the same wrapper for both; it imports our
backend, as the installed jobrunner-lm-eval.pth would); the figures are that process's wall time and
lm-eval's own `total_evaluation_time_seconds`. hf's batch size is fixed (--hf-batch-size, 32): its
`auto` probes batches of max_length tokens, which on a CPU takes longer than the task itself.
The load average before and after is printed: other processes on the machine slow both backends.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WRAPPER = ("import sys, jobrunner.lm_eval_model; from lm_eval.__main__ import cli_evaluate; cli_evaluate()")

_PEOPLE = ["A man", "A woman", "The boy", "The girl", "An old farmer", "A young cook", "The teacher", "A nurse",
           "The driver", "A painter", "The student", "A tourist"]
_PLACES = ["in the kitchen", "at the park", "on the beach", "in a small office", "near the river", "in the garage",
           "at the market", "in the garden", "on a crowded train", "in the library"]
_SCENES = [("picks up a knife and an onion", [" chops the onion into small pieces.", " throws the onion at a bird.",
                                              " reads the onion a story.", " paints the knife green."]),
           ("opens a box of paint and a brush", [" paints the fence white.", " eats the brush slowly.",
                                                 " mails the box to the moon.", " sings to the paint."]),
           ("ties the laces of a pair of running shoes", [" jogs along the path.", " plants the shoes in soil.",
                                                          " cooks the laces for dinner.", " files the shoes away."]),
           ("pours warm water into a bucket with soap", [" washes the car carefully.", " drinks the bucket.",
                                                         " frames the soap on a wall.", " buries the water."]),
           ("takes a book from the shelf", [" sits down and reads the first page.", " bakes the book.",
                                            " waters the shelf.", " throws the book into the sea."]),
           ("holds a ball and looks at a friend", [" throws the ball to the friend.", " sews the ball shut.",
                                                   " irons the friend's hat.", " hides the ball in the soup."])]
DESCRIPTION = ("The following are short descriptions of everyday scenes. Each one stops in the middle; choose the "
               "ending that a careful observer would most likely see next.\n\n")


def mc_docs(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        verb, endings = rng.choice(_SCENES)
        order = list(range(4))
        rng.shuffle(order)
        docs.append({"ctx": f"{rng.choice(_PEOPLE)} {rng.choice(_PLACES)} {verb}. Then they",
                     "endings": [endings[i] for i in order], "label": order.index(0)})
    return docs


def ppl_docs(n: int, chars: int = 2000) -> list[dict]:
    text = "\n\n".join((REPO / p).read_text() for p in ("README.md", "docs/ARCHITECTURE.md"))
    return [{"text": text[i * chars:(i + 1) * chars]} for i in range(min(n, len(text) // chars))]


def write_tasks(root: Path, questions: int, docs: int) -> None:
    for name, rows in (("mc", mc_docs(questions)), ("ppl", ppl_docs(docs))):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = "dataset_path: json\ntest_split: test\nmetadata:\n  version: 1.0\n"
    (root / "bench_mc.yaml").write_text(
        f"task: bench_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'mc.jsonl'}\n"
        f"output_type: multiple_choice\ndescription: {json.dumps(DESCRIPTION)}\ndoc_to_text: \"{{{{ctx}}}}\"\n"
        "doc_to_target: \"{{label}}\"\ndoc_to_choice: \"{{endings}}\"\nmetric_list:\n  - metric: acc\n"
        "  - metric: acc_norm\n")
    (root / "bench_ppl.yaml").write_text(
        f"task: bench_ppl\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'ppl.jsonl'}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\nmetric_list:\n"
        "  - metric: word_perplexity\n  - metric: bits_per_byte\n")


def float32_model_dir() -> Path:
    """The default model as a float32 safetensors directory both backends load (converted once)."""
    from jobrunner.models.known import DEFAULT_MODEL, cache_root, pull
    path = cache_root() / "lm-eval-bench" / "smollm2-135m-instruct-float32"
    if (path / "done").is_file():
        return path
    import transformers
    gguf = pull(DEFAULT_MODEL)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    from safetensors.torch import save_file
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)        # the weights saved are plain float32 (save_pretrained refuses)
    path.mkdir(parents=True, exist_ok=True)
    type(model.config).from_dict(cfg).save_pretrained(str(path))
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k not in tied},
              str(path / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(str(path))
    (path / "done").write_text("ok")
    return path


def run(backend: str, model_args: str, task: str, tasks_dir: Path, out: Path, batch_size: str) -> dict:
    cmd = [sys.executable, "-c", WRAPPER, "--model", backend, "--model_args", model_args, "--tasks", task,
           "--include_path", str(tasks_dir), "--device", "cpu", "--batch_size", batch_size,
           "--output_path", str(out)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO),
                                                                     "HF_DATASETS_OFFLINE": "1"})
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{backend} on {task} failed:\n{done.stderr[-4000:]}")
    result = json.loads(sorted(out.rglob("results_*.json"))[-1].read_text())
    return {"wall_s": wall, "eval_s": float(result.get("total_evaluation_time_seconds", "nan")),
            "metrics": {k: v for k, v in result["results"][task].items() if isinstance(v, float)}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=500)
    ap.add_argument("--docs", type=int, default=24)
    ap.add_argument("--hf-batch-size", default="32")
    ap.add_argument("--jobrunner-args", default="", help="more model args for ours, e.g. threads=2")
    ap.add_argument("--tasks", default="bench_mc,bench_ppl")
    args = ap.parse_args(argv)
    model = float32_model_dir()
    common = f"pretrained={model},dtype=float32,max_length=256"
    print("load before:", os.getloadavg())
    rows = []
    with tempfile.TemporaryDirectory(prefix="lm-eval-bench-") as tmp:
        root = Path(tmp)
        write_tasks(root, args.questions, args.docs)
        for task in args.tasks.split(","):
            ours_args = f"{common},{args.jobrunner_args}".rstrip(",")
            ours = run("jobrunner", ours_args, task, root, root / f"jr-{task}", "auto")
            hf = run("hf", common, task, root, root / f"hf-{task}", args.hf_batch_size)
            rows.append((task, ours, hf))
            print(json.dumps({"task": task, "jobrunner": ours, "hf": hf}))
    print("load after:", os.getloadavg())
    print(f"\n| task | jobrunner wall s (eval s) | hf wall s (eval s), batch {args.hf_batch_size} | speedup (wall) |"
          "\n|---|---|---|---|")
    for task, ours, hf in rows:
        print(f"| {task} | {ours['wall_s']:.1f} ({ours['eval_s']:.1f}) | {hf['wall_s']:.1f} ({hf['eval_s']:.1f}) "
              f"| {hf['wall_s'] / ours['wall_s']:.2f}x |")
    for task, ours, hf in rows:
        # perplexities exp-amplify float32 noise: relative 1e-4 there (as tests/test_lm_eval.py), 4 decimals elsewhere
        same = all(abs(ours["metrics"][k] - v) <= 1e-4 * abs(v) if "perplexity" in k
                   else round(ours["metrics"][k], 4) == round(v, 4)
                   for k, v in hf["metrics"].items() if "stderr" not in k)
        print(f"{task}: metrics agree: {same}; ours {ours['metrics']}; hf {hf['metrics']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
