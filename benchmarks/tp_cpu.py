"""Tensor parallelism on CPU: one engine over 2 processes (gloo) against one process, same cores.

    python -m benchmarks.tp_cpu                     # 16 prompts of 128 tokens, 32 new, 3 repeats
    python -m benchmarks.tp_cpu --repeats 1 --prompts 4 --output-len 4      # a smoke run

Not expected to win on a 2-core machine: it shows what the split costs (an all-reduce after each
attention and MLP block, the embedding's, the logits' gather and the step plan's broadcast, each
a round trip through the loopback network). The model is Qwen2.5-0.5B's shape cut to 8 layers
(hidden 896, 14 heads, 2 KV heads, MLP 4864, vocabulary 151936) with dummy weights, float32.
Rows: one process with 2 threads and with 1 thread; 2 ranks with 1 thread each. Dummy weights
differ between ranks and one process (each rank draws its own), so only times are compared.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

CONFIG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
          "intermediate_size": 4864, "num_hidden_layers": 8, "num_attention_heads": 14, "num_key_value_heads": 2,
          "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
          "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151645}


def _time(model: str, tp: int, threads: int, prompts: list[list[int]], output_len: int, repeats: int) -> list[float]:
    from jobrunner.engine.config.engine_config import EngineConfig
    from jobrunner.engine.core.engine import Engine
    from jobrunner.engine.api.request import Request, SamplingParams

    engine = Engine(EngineConfig(model=model, tensor_parallel=tp, num_threads=threads, kv_cache_memory=512 * 2**20))
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    try:
        engine.generate([Request("warm", prompts[0][:16], SamplingParams(max_tokens=2, ignore_eos=True))])
        times = []
        for r in range(repeats):
            t0 = time.perf_counter()      # distinct prompts each repeat: nothing from the prefix cache
            engine.generate([Request(f"{r}-{i}", [r + 1] + p, params) for i, p in enumerate(prompts)])
            times.append(time.perf_counter() - t0)
        return times
    finally:
        engine.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    import random
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 100000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(CONFIG))
        model = f"dummy:{path}"
        rows = []
        for label, tp, threads in (("one process, 2 threads", 1, 2), ("one process, 1 thread", 1, 1),
                                   ("2 ranks, 1 thread each", 2, 1)):
            times = _time(model, tp, threads, prompts, args.output_len, args.repeats)
            rows.append((label, min(times), statistics.median(times)))
    tokens = args.prompts * (args.prompt_len + 1 + args.output_len)
    base = rows[0][1]
    print(f"{args.prompts} prompts x {args.prompt_len + 1} tokens, {args.output_len} new; best of {args.repeats}")
    print("| engine | best s | median s | tokens/s | vs one process, 2 threads |\n|---|---|---|---|---|")
    for label, best, median in rows:
        print(f"| {label} | {best:.2f} | {median:.2f} | {tokens / best:.0f} | {best / base:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
