#!/usr/bin/env bash
# The GPU machine's check, in one go and in under 8 minutes: the GPU tests, engine throughput on
# dummy-weight Llama-3.1-8B (1000 prompts 256/256, then 1000 prompts 1024/512 and 1000 with
# lengths uniform in 100..1024, each bounded by a time limit; 256/256 again without async
# scheduling), the mixture of experts dummy:qwen3-30b-a3b (the fused-MoE kernel timed at its
# shapes, then 256/256 in bf16 with a profile of two decode steps, and in fp8), and transformers
# batched generate on a subset as the peer. Installs nothing and
# needs no network (torch, triton, transformers, pytest are on that machine; polars and gguf are
# not, and nothing here imports them). Each part's failure is reported; none stops the others.
#
#   bash benchmarks/gpu_check.sh                    # GPU machine; logs and JSON in $OUT/gpu-<stamp>/
#                                                   # (or benchmarks/results/gpu-<stamp>/ without $OUT)
#   GPU_CHECK_MODE=quick bash benchmarks/gpu_check.sh  # a first look: shorter runs, a torch.profiler table
#   GPU_CHECK_SMALL=1 bash benchmarks/gpu_check.sh  # the same steps at toy sizes on any machine
#
# One log per part (each throughput log ends with its figures as a JSON line): at most 8 files, what
# the device tool brings back. Ends with a compact summary (also in summary.txt); exit status 0 when
# every part passed.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
DIR=${OUT:-benchmarks/results}/gpu-$STAMP
mkdir -p "$DIR"
BUDGET=${GPU_CHECK_BUDGET:-460}          # seconds for all parts together (8 minutes = 480)
T0=$(date +%s)
FAILED=0
: > "$DIR/summary.txt"

# Sizes: full (default), quick (a first look: short runs and a profile), small (toy sizes, any machine).
MODE=${GPU_CHECK_MODE:-full}
[ -n "${GPU_CHECK_SMALL:-}" ] && MODE=small
case $MODE in
  small)
    MODEL=dummy:smollm2-135m; MOE_MODEL=dummy:benchmarks/configs/tiny-qwen3-moe.json; L_MOE=150; TL_MOE=30
    A="--num-prompts 8 --input-len 32 --output-len 8"
    B="--num-prompts 8 --input-len 16:64 --output-len 4:8"; HF="--num-prompts 4 --input-len 32 --output-len 8"
    U="--num-prompts 8 --input-len 10:40 --output-len 4:8"; TL_U=30
    L_TEST=300; L_A=150; TL_A=60; L_B=150; TL_B=60; L_E=150; TL_E=60; L_HF=150; TL_HF=60; PROF="--profile-steps 2" ;;
  quick)
    MODEL=dummy:llama-3.1-8b; MOE_MODEL=dummy:qwen3-30b-a3b; L_MOE=120; TL_MOE=15
    A="--num-prompts 300 --input-len 256 --output-len 256"
    B="--num-prompts 300 --input-len 1024 --output-len 512"; HF=""
    U="--num-prompts 300 --input-len 100:1024 --output-len 100:1024"; TL_U=10
    L_TEST=100; L_A=70; TL_A=20; L_B=70; TL_B=10; L_E=40; TL_E=10
    PROF="--profile-steps 3 --profile-after 60" ;;
  *)
    MODEL=dummy:llama-3.1-8b; MOE_MODEL=dummy:qwen3-30b-a3b; L_MOE=150; TL_MOE=25
    A="--num-prompts 1000 --input-len 256 --output-len 256"
    B="--num-prompts 1000 --input-len 1024 --output-len 512"; HF="--num-prompts 64 --input-len 256 --output-len 256"
    U="--num-prompts 1000 --input-len 100:1024 --output-len 100:1024"; TL_U=40
    L_TEST=120; L_A=110; TL_A=60; L_B=140; TL_B=60; L_E=60; TL_E=25; L_HF=70; TL_HF=30; PROF=""
    # two 8192-token prefill steps under torch.profiler: how prefill's time splits between matmuls,
    # attention and the rest (its MFU was ~60%); costs the timed run well under a second
    PROF_B="--profile-steps 2 --profile-after 10" ;;
esac
PROF_B=${PROF_B:-}
# 256/256: every prompt fits in the KV cache at once; 1024/512: ~500 do, more would be preempted.
A="$A --max-num-seqs 1024 --max-batched-tokens 8192"
B="$B --max-num-seqs 512 --max-batched-tokens 8192"
U="$U --max-num-seqs 512 --max-batched-tokens 8192"

note() { echo "$*" | tee -a "$DIR/summary.txt"; }

# part NAME LIMIT_S COMMAND...: runs COMMAND under `timeout`, capped by what is left of BUDGET;
# logs to NAME.log; one summary line with the status, the seconds and the part's key figure.
part() {
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - T0) ))
  if [ "$left" -lt 20 ]; then note "$name: SKIPPED (out of time budget)"; FAILED=1; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local s=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$DIR/$name.log" 2>&1
  local rc=$? secs=$(( $(date +%s) - s )) status
  case $rc in
    0) status=ok ;;
    124|137) status="TIMEOUT after ${limit}s"; FAILED=1 ;;
    *) status="FAILED rc=$rc"; FAILED=1 ;;
  esac
  local key
  key=$(grep -E "^(jobrunner|transformers) .* requests in |[0-9]+ (passed|failed|skipped|deselected)|no tests ran|^GPU:|per token: constrained" "$DIR/$name.log" \
        | tail -n 3 | tr '\n' ' ')
  [ -z "$key" ] && key=$(tail -n 1 "$DIR/$name.log")
  note "$name: $status (${secs}s) $key"
}

note "gpu_check $STAMP model=$MODEL budget=${BUDGET}s dir=$DIR"
part env 30 "$PY" -c '
import torch, sys
print("torch", torch.__version__, "cuda", torch.version.cuda, "python", sys.version.split()[0])
for m in ("triton", "transformers"):
    try: print(m, __import__(m).__version__)
    except Exception as e: print(m, "missing:", e)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info()
    print(f"GPU: {p.name}, {p.multi_processor_count} SMs, {total / 2**30:.0f} GiB ({free / 2**30:.0f} free)")
else:
    print("GPU: none visible (CPU run)")
'
cat "$DIR/env.log" >> "$DIR/summary.txt" && rm -f "$DIR/env.log"     # the device tool brings back 8 files at most

# GPU tests: the test files that have any (collecting every file would fail on modules that need polars);
# several pytest workers when pytest-xdist is there (Triton compiles are CPU bound)
GPU_TESTS=$(grep -l -E "mark\.gpu|cuda_only" tests/test_*.py 2>/dev/null | tr '\n' ' ')
XDIST=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 4")
if [ -n "$GPU_TESTS" ]; then
  part gpu-tests "$L_TEST" "$PY" -m pytest -q -m gpu -p no:cacheprovider $XDIST $GPU_TESTS
else
  note "gpu-tests: SKIPPED (no test file marks gpu tests)"
fi

# then (same log: the device tool brings back 8 files) tensor parallelism over 2 GPUs where there are 2 (issue 22)
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
part throughput-256-256 "$L_A" sh -c "\"$PY\" -m benchmarks.throughput -m \"$MODEL\" $A --time-limit $TL_A $PROF &&
  if [ \"$GPUS\" -ge 2 ]; then \"$PY\" -m benchmarks.throughput -m \"$MODEL\" $A --time-limit $TL_A --tensor-parallel 2;
  else echo 'tensor parallel: SKIPPED (one GPU)'; fi"
# Mixture of experts (one log: the device tool brings back 8 files): the fused-MoE kernel at Qwen3-30B-A3B's
# shapes (time and GB/s of the experts a batch touches), then 256/256 in bf16 with a profile of two decode
# steps (the MoE kernels' share of a step), then in fp8 where the GPU has it (compute capability >= 8.9)
FP8_OK=$("$PY" -c "import torch; print(int(torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)))" 2>/dev/null)
part moe-256-256 "$L_MOE" sh -c "\"$PY\" -m benchmarks.kernel_bench --only fused_moe $( [ "$MODE" = small ] && echo --tiny ) &&
  \"$PY\" -m benchmarks.throughput -m \"$MOE_MODEL\" $A --time-limit $TL_MOE --profile-steps 2 --profile-after 50 &&
  if [ \"$FP8_OK\" = 1 ]; then \"$PY\" -m benchmarks.throughput -m \"$MOE_MODEL\" $A --quantization fp8 --time-limit $TL_MOE; fi"
# 1024/512, then (same log: the device tool brings back 8 files) lengths uniform in 100..1024
part throughput-1024-512 "$L_B" sh -c "\"$PY\" -m benchmarks.throughput -m \"$MODEL\" $B --time-limit $TL_B $PROF_B &&
  \"$PY\" -m benchmarks.throughput -m \"$MODEL\" $U --time-limit $TL_U"
# One log for three A/B runs (the device tool brings back 8 files):
#  * async scheduling (every other run uses it): the same 256/256 run waiting for each step;
#  * embeddings (issue 23): 1000 prompts of 512 tokens pooled by their last token, beside the prefill
#    rate of the same prompts (--output-len 1): the embedding tokens/s should be within 10% of it;
#  * structured output (issue 17): rows under an extraction JSON schema against the same lengths
#    unconstrained (target ratio <= 1.05). llguidance is not on the GPU machine: carry its wheel as
#    benchmarks/wheels/llguidance-*.whl (3 MB, no dependencies); it is unpacked into a temp dir here.
E512="--num-prompts 1000 --input-len 512 --max-num-seqs 1024 --max-batched-tokens 8192"; TL_EMB=15; S_ROWS=256
[ "$MODE" = small ] && E512="--num-prompts 8 --input-len 64" && TL_EMB=60 && S_ROWS=8
LLG_PATH=""
if ! "$PY" -c "import llguidance" 2>/dev/null && ls benchmarks/wheels/llguidance-*.whl >/dev/null 2>&1; then
  LLG_PATH=$(mktemp -d) && "$PY" -m zipfile -e benchmarks/wheels/llguidance-*.whl "$LLG_PATH"
fi
part sync-embed-structured $(( L_E + 160 )) sh -c "\"$PY\" -m benchmarks.throughput -m \"$MODEL\" $A --sync-scheduling --time-limit $TL_E;
  \"$PY\" -m benchmarks.throughput -m \"$MODEL\" $E512 --output-len 1 --time-limit $TL_EMB;
  \"$PY\" -m benchmarks.throughput -m \"$MODEL\" $E512 --embed last --time-limit $TL_EMB;
  PYTHONPATH=\"$LLG_PATH${PYTHONPATH:+:$PYTHONPATH}\" \"$PY\" -m benchmarks.structured -m \"$MODEL\" --num-prompts $S_ROWS --max-tokens 128"
[ -n "$HF" ] && part transformers-256-256 "$L_HF" "$PY" -m benchmarks.throughput --engine transformers -m "$MODEL" $HF \
  --hf-batch 64 --time-limit "$TL_HF"
if [ "$MODE" = full ]; then
  # quantized, in one log (the device tool brings back 8 files): fp8 weights against TensorRT-LLM's
  # published fp8 figures (issue 21) at 256/256, 128/128 and 1000/1000; an int8 KV cache against bf16 KV
  # (with a profile of two decode steps)
  F="--num-prompts 1000 --max-num-seqs 1024 --max-batched-tokens 8192 --quantization fp8"
  part quant 150 sh -c "\"$PY\" -m benchmarks.throughput -m \"$MODEL\" $F --input-len 256 --output-len 256 --time-limit 20;
    \"$PY\" -m benchmarks.throughput -m \"$MODEL\" $F --input-len 128 --output-len 128 --time-limit 15;
    \"$PY\" -m benchmarks.throughput -m \"$MODEL\" $F --input-len 1000 --output-len 1000 --time-limit 30;
    \"$PY\" -m benchmarks.throughput -m \"$MODEL\" $A --kv-cache-dtype int8 --time-limit 20 \
    --profile-steps 2 --profile-after 100"
fi

note "total $(( $(date +%s) - T0 ))s; $( [ $FAILED = 0 ] && echo 'all parts ok' || echo 'SOME PARTS FAILED: see the logs' ) in $DIR"
echo "---- summary ----"
cat "$DIR/summary.txt"
exit $FAILED
