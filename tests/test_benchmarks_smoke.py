"""The benchmark suite produces every figure, and the figures agree with the workloads.

Never a speed: only that each figure is there, positive where it must be, and that tokens and
rows counted by each system match what the workload holds (our tokenizer's count).
The smoke suite runs `jobrunner submit` several times on the default model (a few minutes on
2 cores); the other tests here take seconds.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tok(default_gguf_path):
    from benchmarks.workloads import our_tokenizer
    return our_tokenizer("smollm2-135m-instruct")


# ------------------------------------------------------------------------------ workloads

def test_workloads_are_deterministic_and_counted(tok):
    from benchmarks import workloads as W

    a, b = W.shared_prefix(tok, n=8), W.shared_prefix(tok, n=8)
    assert a.rows == b.rows and a.prompt_tokens == b.prompt_tokens
    assert a.prompt_tokens == [len(tok.encode(p, add_special_tokens=True)) for p in a.prompts]
    assert len({r["id"] for r in a.rows}) == 8
    head = os.path.commonprefix(a.prompts)
    assert len(tok.encode(head)) > 250                          # the ~290-token shared instruction

    multi = W.shared_prefix(tok, n=32, prefixes=4)
    assert {r["prefix"] for r in multi.rows} == {0, 1, 2, 3}
    assert len({p.split("\nReview:")[0] for p in multi.prompts}) == 4

    gen = W.free_generation(tok, n=6, min_tokens=20, max_tokens=40)
    assert all(20 <= n <= 45 for n in gen.prompt_tokens)
    assert gen.rows == W.free_generation(tok, n=6, min_tokens=20, max_tokens=40).rows

    rag = W.rag(tok, n=3, prompt_tokens=256, docs_per_prompt=2, pool=4)
    for r, n in zip(rag.rows, rag.prompt_tokens):
        assert r["answer"] in r["prompt"] and 200 <= n <= 330

    ev = W.evaluation(tok, n=20)
    assert {r["answer"] for r in ev.rows} <= {"positive", "negative"} and ev.reference_column == "answer"

    oa = W.openai_batch(tok, gen, max_tokens=(3, 9))
    assert oa.format == "openai-batch" and oa.chat and all(3 <= k <= 9 for k in oa.max_tokens)
    for row, k in zip(oa.rows, oa.max_tokens):
        assert row["url"] == "/v1/chat/completions" and row["body"]["max_tokens"] == k
    rendered = tok.apply_chat_template([{"role": "user", "content": gen.prompts[0]}], add_generation_prompt=True)
    assert oa.prompt_tokens[0] == len(tok.encode(rendered, add_special_tokens=False))


# ../shared/peers/make_cls_workload.py, verbatim (it lies outside the repository): the rows it writes
# are the reference for workloads.shared_prefix.
PEER_CLS_SCRIPT = r'''"""The 64+-row shared-prefix classification workload (fixed seed): python make_cls_workload.py OUT.jsonl"""
# A classification-style workload: shared instructions + few-shot, unique review text.
import random, json
random.seed(7)
words = "the a movie film plot acting great terrible boring wonderful story scene character music slow fast loved hated director script ending beautiful awful funny sad long short brilliant dull".split()
sysmsg = ("You are a sentiment classifier. Read the review and answer with exactly one word: "
          "positive, negative or neutral. Examples:\n" +
          "\n".join(f"Review: {' '.join(random.choices(words, k=25))}\nSentiment: {random.choice(['positive','negative','neutral'])}" for _ in range(8)))
rows=[]
for i in range(256):
    rows.append({"id": f"r{i:04d}", "prompt": sysmsg + f"\nReview: {' '.join(random.choices(words, k=random.randint(10,40)))}\nSentiment:"})
random.shuffle(rows)
import sys
with open(sys.argv[1] if len(sys.argv) > 1 else "cls.jsonl","w") as f:
    for r in rows: f.write(json.dumps(r)+"\n")
print(len(sysmsg))
'''


def test_shared_prefix_reproduces_the_peer_script(tok, tmp_path):
    from benchmarks import workloads as W
    script = tmp_path / "make_cls_workload.py"
    script.write_text(PEER_CLS_SCRIPT)
    subprocess.run([sys.executable, str(script), str(tmp_path / "cls.jsonl")], check=True, capture_output=True)
    theirs = [json.loads(line) for line in (tmp_path / "cls.jsonl").read_text().splitlines()]
    assert len(theirs) == 256
    assert W.shared_prefix(tok, n=256).rows == theirs


# ------------------------------------------------------------------------------ report and parsers

def _fake_result():
    run = {"system": "jobrunner", "label": "jobrunner", "wall_s": 2.0, "model_load_s": 1.0, "rows": 4,
           "prompt_tokens": 100, "completion_tokens": 16, "prompt_tokens_per_s": 50.0, "output_tokens_per_s": 8.0,
           "total_tokens_per_s": 58.0, "prefill_s": 1.5, "decode_s": 0.5, "cache_hit_rate": 0.5,
           "optimum_cache_hit_rate": 0.6, "cache_hit_of_block_optimum": 0.9, "peak_rss_mb": 900.0,
           "other_load_cores": 0.1, "metrics": {"accuracy": 0.75}}
    peer = dict(run, system="transformers", label="transformers (batch 4)", wall_s=6.0, cache_hit_rate=None)
    cases = [{"name": "shared-prefix/generate", "runs": [run, peer, {"system": "llama.cpp", "label": "llama.cpp",
                                                                      "skipped": "llama-cpp-python not installed"}],
              "speedups": {"transformers (batch 4)": 3.0}}]
    cases += [{"name": f"rows={n}", "scaling": {"axis": "rows", "value": n}, "runs": [dict(run, wall_s=n / 4)],
               "speedups": {}} for n in (4, 8, 16)]
    return {"suite": "unit", "stamp": "20000101T000000Z", "command": "python -m benchmarks run --suite unit",
            "machine": {"cpu_model": "test cpu", "cpus_usable": 2}, "versions": {"torch": "x"},
            "git": {"commit": "abc"}, "cases": cases, "comparisons": [{"name": "c", "text": "t"}], "problems": []}


def test_report_writes_json_markdown_and_plots_or_a_note(tmp_path):
    from benchmarks import report
    saved = report.save(_fake_result(), tmp_path)
    data = json.loads(Path(saved["json"]).read_text())
    assert data["git"]["commit"] == "abc" and data["load_note"]
    md = Path(saved["markdown"]).read_text()
    assert "| shared-prefix/generate | jobrunner | 2.00 |" in md and "50% of 60% (83%)" in md
    assert "3.00x" in md and "skipped: llama-cpp-python not installed" in md and "accuracy 0.750" in md
    try:
        import matplotlib  # noqa: F401
        assert len(saved["plots"]) == 2 and all(Path(p).stat().st_size > 1000 for p in saved["plots"])
    except ImportError:
        assert saved["plots"] == [] and "matplotlib" in saved["notes"][0]
    for key in ("platform", "cpu_count", "loadavg"):
        assert key in report.machine()
    assert report.versions()["python"]


def test_parse_llamacpp_output():
    from benchmarks.peers import parse_llamacpp
    text = ("model load 0.41s (excluded), n_vocab=49152, llama-cpp-python 0.3.36, threads=2\n"
            "[N=64 mode=prefix unified=1 fa=-1] prompts=64 prompt_tokens=20436 (prefilled=2381, shared_prefix=286) "
            "generated=1024 wall=15.32s (tokenize 0.010s, prefill 4.10s, decode 11.20s) (prompt+gen) tok/s=1400.8 "
            "gen tok/s=66.8 | decode-phase gen tok/s=91.4 prefill tok/s(actual computed)=580.7 n_ctx=20992\n")
    (r,) = parse_llamacpp(text)
    assert r == {"n_parallel": 64, "mode": "prefix", "rows": 64, "prompt_tokens": 20436, "prompt_tokens_computed": 2381,
                 "shared_prefix": 286, "completion_tokens": 1024, "wall_s": 15.32, "prefill_s": 4.10,
                 "decode_s": 11.20, "model_load_s": 0.41}


def test_llamacpp_is_skipped_with_a_note_when_not_installed(tmp_path):
    import importlib.util

    from benchmarks.peers import run_llamacpp
    if importlib.util.find_spec("llama_cpp") is not None:
        pytest.skip("llama-cpp-python is installed here")
    r = run_llamacpp(tmp_path / "p.jsonl", tmp_path / "m.gguf", tmp_path / "l.log", rows=4, new_tokens=4)
    assert r == {"system": "llama.cpp", "skipped": "llama-cpp-python not installed"}


# ------------------------------------------------------------------------------ throughput.py

def test_throughput_runs_without_polars_and_gguf(tmp_path):
    """Dummy weights from a tiny config; the GPU machine has neither polars nor gguf."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512,
           "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code = ("import sys; sys.modules['polars'] = None; sys.modules['gguf'] = None\n"
            "from benchmarks.throughput import main\n"
            f"main(['-m', 'dummy:{tmp_path}/config.json', '--num-prompts', '5', '--input-len', '8:40',"
            f" '--output-len', '3:6', '--json', '{tmp_path}/r.json', '--peak-bandwidth', '0.01'])\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "r.json").read_text())
    from benchmarks.throughput import parse_len, random_workload
    work = random_workload(5, parse_len("8:40"), parse_len("3:6"), 512, 0)
    assert r["requests_finished"] == 5 and not r["truncated"]
    assert r["output_tokens"] == sum(o for _, o in work)
    assert r["prompt_tokens"] == sum(len(p) for p, _ in work)
    for k in ("output_tokens_per_s", "total_tokens_per_s", "mfu", "mfu_with_attention", "achieved_bandwidth_tbps",
              "load_s", "steps"):
        assert r[k] > 0, k
    assert r["peak_tflops"] == 0.128 and r["peak_bandwidth_tbps"] == 0.01
    assert "TRUNCATED" not in proc.stdout and "MFU" in proc.stdout


def test_throughput_arithmetic():
    from benchmarks.throughput import context_sums, figures, model_arith
    from jobrunner.engine.load.loader import DUMMY_CONFIGS
    from jobrunner.engine.config.model_config import ModelConfig
    arith = model_arith(ModelConfig.from_hf(DUMMY_CONFIGS["llama-3.1-8b"]), 2, 2)
    # Llama-3.1-8B: about 7.5 G matmul parameters (the issue's ~15 GFLOP a token), 128 KiB of KV a token
    assert 7.4e9 < arith["matmul_params"] < 7.6e9 and arith["kv_bytes_per_token"] == 131072
    work = [([1] * 4, 3)]
    assert context_sums(work) == (4, 10, 5 + 6)
    f = figures(elapsed=1.0, prompt_done=4, prompt_computed=4, generated=3, steps=3, requests=1, work=work,
                arith=arith, peak_tflops=790, peak_tbps=4.8, fraction=1.0)
    assert f["mfu"] == pytest.approx(2 * arith["matmul_params"] * 7 / 1e12 / 790)


# ------------------------------------------------------------------------------ the smoke suite

def test_smoke_suite_produces_every_figure(default_gguf_path, tmp_path):
    from benchmarks.__main__ import main
    # one compute thread per system: sizes are tiny, and on a shared machine 2 torch threads stall each other
    args = ["run", "--suite", "smoke", "--threads", "1", "--results-dir", str(tmp_path),
            "--workdir", str(tmp_path / "work")]
    if os.environ.get("BENCH_SMOKE_NO_TRANSFORMERS"):
        args.append("--no-transformers")
    rc = main(args)
    (path,) = tmp_path.glob("smoke-*.json")
    result = json.loads(path.read_text())
    assert result["problems"] == [] and rc == 0
    assert result["git"]["commit"] and result["machine"]["cpu_count"] and result["versions"]["torch"]
    assert result["threads"] == 1 and "--threads 1" in result["command"]
    assert Path(str(path).replace(".json", ".md")).is_file()
    names = [c["name"] for c in result["cases"]]
    assert names == ["shared-prefix/generate", "shared-prefix/classify", "free-generation", "rag",
                     "evaluation/classify", "openai-batch"]
    seen = set()
    for case in result["cases"]:
        for r in case["runs"]:
            seen.add(r["system"])
            if r.get("skipped"):
                assert r["system"] in ("llama.cpp", "transformers") and r["skipped"]
                continue
            assert "error" not in r, r.get("error")
            for k in ("wall_s", "model_load_s", "process_wall_s", "peak_rss_mb", "prompt_tokens_per_s", "rows_per_s"):
                assert r[k] > 0, (case["name"], r["label"], k)
            assert r["rows"] == case["rows"]
            assert r["prompt_tokens"] == case["expected_prompt_tokens"]
            assert r["completion_tokens"] == case["expected_completion_tokens"]
            assert 0 <= r["prefill_s"] <= r["wall_s"] * 1.01 and r["decode_s"] >= 0
            if case["expected_completion_tokens"]:
                assert r["output_tokens_per_s"] > 0
            if r["system"] in ("jobrunner", "ablation"):
                assert 0 <= r["cache_hit_rate"] <= r["optimum_cache_hit_rate"] <= 1
                assert r["other_load_cores"] is not None
        if case["name"] == "shared-prefix/generate":
            assert set(case["speedups"]) >= {"jobrunner --no-plan --no-prefix-cache"}
            ours = next(r for r in case["runs"] if r["system"] == "jobrunner")
            assert ours["cached_tokens"] > 0 and 0 < ours["cache_hit_of_optimum"] <= 1
    assert {"jobrunner", "ablation", "llama.cpp", "transformers"} <= seen
    assert any("vs generation" in c["name"] for c in result["comparisons"])
    ev = next(c for c in result["cases"] if c["name"] == "evaluation/classify")
    assert 0 <= ev["runs"][0]["metrics"]["accuracy"] <= 1
