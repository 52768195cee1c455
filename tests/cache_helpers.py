"""Shared by the result cache's tests: a tiny dummy Llama (byte tokenizer, random weights from a
config: loads in a moment), datasets of prompts, and jobs run in this process."""
from __future__ import annotations

import json
from pathlib import Path

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 259, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 1024,
        "tie_word_embeddings": False, "bos_token_id": 256, "eos_token_id": 258}
MAX_TOKENS = 5


def tiny_model(root: Path) -> str:
    (root / "model").mkdir(exist_ok=True)
    (root / "model" / "config.json").write_text(json.dumps(TINY))
    return f"dummy:{root / 'model'}"


def prompts(n: int, start: int = 0) -> list[str]:
    return [f"Question {i}: what follows {i * 7 % 100}?" for i in range(start, start + n)]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def run_job(engine, dataset: str, output: str, **kw):
    from jobrunner.config.job import job_config
    from jobrunner.pipeline.build import open_job
    kw = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "device": "cpu", **kw}
    job = open_job(job_config(dataset, output=output, model=engine.config.model, **kw), engine=engine)
    return job.run()


def outputs(output: str) -> dict:
    """id -> (output, prompt_tokens, completion_tokens, error, reused); each id once."""
    from jobrunner.output import read_results
    rows = read_results(output).to_pylist()
    assert len({r["id"] for r in rows}) == len(rows), "an id written twice"
    return {r["id"]: (r["output"], r["prompt_tokens"], r["completion_tokens"], r["error"], r["reused"]) for r in rows}
