#!/usr/bin/env bash
# One small `jobrunner submit` job of each kind and front end, on the default model, from CODE_DIR's
# code, each into OUT_DIR/<name>; compare two such runs with benchmarks/compare_outputs.py:
#
#   benchmarks/run_kinds.sh /tmp/house_base /tmp/kinds_before
#   benchmarks/run_kinds.sh "$PWD" /tmp/kinds_after
#   python benchmarks/compare_outputs.py /tmp/kinds_before /tmp/kinds_after
#
# The data, this checkout's examples/reviews.jsonl and small files written beside it, lies in one
# directory for every run ($RUN_KINDS_DATA, default /tmp/jobrunner-run-kinds-data), so that two runs'
# manifests name the same datasets. Every job: --limit 8 --max-tokens 8, on CPU, one thread (the thread
# governor follows the machine's load, and another thread count sums floats in another order).
set -euo pipefail
CODE_DIR=$(cd "$1" && pwd)
OUT_DIR=$2
HERE=$(cd "$(dirname "$0")/.." && pwd)
DATA=${RUN_KINDS_DATA:-/tmp/jobrunner-run-kinds-data}
mkdir -p "$DATA" "$OUT_DIR"
REVIEWS="$DATA/reviews.jsonl"
cp "$HERE/examples/reviews.jsonl" "$REVIEWS"

# an OpenAI batch file: chat lines (one with its own sampling), a completions line
python - "$DATA" <<'EOF'
import json, sys
d = sys.argv[1]
lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
          "body": {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": q}]}}
         for i, q in enumerate(["Name a color.", "What is 2 + 2?", "Say hello in French."])]
lines[1]["body"].update(temperature=0.8, seed=7, n=2)
lines.append({"custom_id": "p0", "method": "POST", "url": "/v1/completions",
              "body": {"model": "smollm2-135m-instruct", "prompt": "The capital of France is"}})
lines.append({"custom_id": "s0", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "smollm2-135m-instruct", "messages": [
                  {"role": "system", "content": "Answer in one word."},
                  {"role": "user", "content": [{"type": "text", "text": "Sky color?"}]}]}})
with open(f"{d}/batch.jsonl", "w") as f:
    f.writelines(json.dumps(x) + "\n" for x in lines)
# rows with repeats, for dedup (a template and a system prompt make the prompt)
rows = [{"id": f"d{i}", "text": t} for i, t in enumerate(["good", "bad", "good", "fine", "bad", "good", "meh", "fine"])]
with open(f"{d}/repeats.jsonl", "w") as f:
    f.writelines(json.dumps(x) + "\n" for x in rows)
EOF

# the command line's entry, in either layout (jobrunner/cli/main.py, or jobrunner/cli.py before it)
MAIN=$'try:\n    from jobrunner.cli.main import main\nexcept ImportError:\n    from jobrunner.cli import main\nmain()'

run() {     # run NAME DATASET OPTIONS...
    local name=$1 dataset=$2
    shift 2
    echo "== $name"
    (cd "$CODE_DIR" && PYTHONPATH="$CODE_DIR" python -c "$MAIN" submit "$dataset" --output "$OUT_DIR/$name" \
        --overwrite --limit 8 --max-tokens 8 --device cpu --threads "${RUN_KINDS_THREADS:-1}" "$@")
}

run generate "$REVIEWS"
run generate_n2_logprobs_seed "$REVIEWS" --n 2 --logprobs --top-logprobs 2 --temperature 0.7 --top-p 0.9 --seed 3
run classify "$REVIEWS" --kind classify --labels positive,negative,neutral --reference-column label
run score "$REVIEWS" --kind score --score-column label
run embed "$REVIEWS" --kind embed --prompt-column text
run openai_batch "$DATA/batch.jsonl" --output-format openai-batch
run template_system_dedup "$DATA/repeats.jsonl" --template 'Review: {text}\nOne word:' \
    --system 'You rate reviews.' --dedup
# the same jobs over two data-parallel workers, and over Ray actors (RUN_KINDS_RAY=0 skips them)
run generate_dp2 "$REVIEWS" --data-parallel 2
run classify_dp2 "$REVIEWS" --kind classify --labels positive,negative,neutral --reference-column label --data-parallel 2
if [ "${RUN_KINDS_RAY:-1}" = 1 ] && python -c "import ray" 2>/dev/null; then
    run generate_ray "$REVIEWS" --ray local --data-parallel 2
    run template_system_dedup_ray "$DATA/repeats.jsonl" --template 'Review: {text}\nOne word:' \
        --system 'You rate reviews.' --dedup --ray local --data-parallel 2
fi
