"""LoRA's cost inside one engine (issue 33): 64 rows x 16 greedy tokens of the default model, all on the
base model vs spread over four rank-16 adapters (made by benchmarks.lora_cpu in /tmp/lora-bench),
interleaved three times after a warm-up round. Prints wall and forward seconds per round.

    python -m benchmarks.lora_forward
"""
import time
from jobrunner.engine import Engine, EngineConfig, Request, SamplingParams
from jobrunner.models.known import resolve_model, DEFAULT_MODEL
W = "/tmp/lora-bench"
e = Engine(EngineConfig(model=resolve_model(DEFAULT_MODEL), loras=tuple((f"a{i}", f"{W}/a{i}") for i in range(4)),
                        num_threads=2, enable_prefix_caching=False))
tok = e.tokenizer
rows = [tok.encode(f"Write one sentence about topic number {i}.") for i in range(64)]
p = SamplingParams(max_tokens=16, ignore_eos=True)
def run(tag, adapters):
    c0 = e.counters(); t0 = time.perf_counter()
    e.generate([Request(f"{tag}{i}", ids, p, adapter=adapters[i % len(adapters)]) for i, ids in enumerate(rows)])
    c = e.counters()
    return time.perf_counter() - t0, c.forward_s - c0.forward_s
run("w", [None])
res = {"base": [], "lora": []}
for k in range(3):
    res["base"].append(run(f"b{k}-", [None]))
    res["lora"].append(run(f"l{k}-", ["a0", "a1", "a2", "a3"]))
for name, v in res.items():
    print(name, "wall", [round(w, 2) for w, _ in v], "forward", [round(f, 2) for _, f in v])
