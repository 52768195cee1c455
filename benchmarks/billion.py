"""A billion-parameter model on the CPU (issue 62, item 4): a Llama-3.2-1B-shaped model with random
weights and the default model's tokenizer, our modes side by side with transformers and llama.cpp on
the same weights.

    python -m benchmarks.billion --llamacpp-python /path/to/venv/bin/python
    python -m benchmarks.billion --only free-generation --systems float32,int4,llama.cpp-Q4_0
    python -m benchmarks.billion --rows 16 --new 64 --layers 4        # a quicker, shallower model

The model (config.json, bfloat16 safetensors, the default model's tokenizer) is made once in the
jobrunner cache with its GGUF files: F16 written by our converter as llama.cpp's convert_hf_to_gguf
writes it, Q8_0 and Q4_0 by llama.cpp's own quantizer (llama_model_quantize), which needs a Python that
imports llama_cpp. Workloads, no chat template, EOS ignored:
  free-generation           16 rows of ~100 prompt tokens, 64 new tokens each
  shared-prefix             16 rows sharing a ~290-token few-shot prefix, 16 new tokens each
  shared-prefix/classify    the same rows classified (every label scored; not llama.cpp: it has no such job)
Every system runs as a child process; wall excludes model load; peak memory is the child's
(ru_maxrss: floored at this driver's own few hundred MB, far below a 1B model's; the model is made in a
child of its own so that the floor stays there). The result JSON and a Markdown table go to
benchmarks/results/; speeds are reported, never checked.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks import report
from benchmarks import workloads as W
from benchmarks.gguf_convert import write_gguf
from benchmarks.peers import llamacpp_python, run_jobrunner, run_llamacpp, run_transformers

RESULTS = Path(__file__).resolve().parent / "results"

# Llama-3.2-1B's shape with the default model's vocabulary (its tokenizer: 49,152 tokens).
SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
             rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)

# label -> our options (on the bfloat16 checkpoint unless the label names a GGUF file)
OURS = {
    "float32": ["--dtype", "float32"],
    "float32-onednn": ["--dtype", "float32"],      # float32 linears on oneDNN, not the panel kernel (ENV)
    "bfloat16": ["--dtype", "bfloat16"],
    "int8": ["--quantization", "int8"],
    "int8-bf16": ["--quantization", "int8", "--dtype", "bfloat16"],    # int8 values times bfloat16 activations
    "int4": ["--quantization", "int4"],
    "int4-bf16": ["--quantization", "int4", "--dtype", "bfloat16"],    # nibbles times bfloat16 activations
    "w4a8": ["--quantization", "w4a8"],
    "auto": ["--quantization", "auto"],
    "int4-Q4_0": ["--quantization", "int4"],
    "w4a8-Q4_0": ["--quantization", "w4a8"],
}
ENV = {"float32-onednn": {"JOBRUNNER_CPU_F32": "off"}}      # label -> environment its run adds
LLAMACPP = ("F16", "Q8_0", "Q4_0")
SYSTEMS = (*OURS, "transformers", *(f"llama.cpp-{q}" for q in LLAMACPP))
LLAMA_FTYPE = {"Q8_0": 7, "Q4_0": 2}           # llama.h's LLAMA_FTYPE_MOSTLY_*

# issue 62's targets, as (system, peer, at most this ratio of the peer's wall)
TARGETS = (("float32", "transformers", 0.6), ("auto", "transformers", 0.35), ("int4", "llama.cpp-Q4_0", 0.7),
           ("int4-bf16", "llama.cpp-Q4_0", 0.7), ("int8", "float32", 1.0), ("bfloat16", "float32", 1.0),
           ("w4a8-Q4_0", "llama.cpp-Q4_0", 0.7))


def model_dir(layers: int) -> Path:
    from jobrunner.models.known import cache_root
    return cache_root() / "bench-models" / f"llama-1b-random-{layers}layers"


def make_model(path: Path, layers: int, shape: dict = SHAPE) -> Path:
    """The random 1B-shaped checkpoint (bfloat16 on disk) with the default model's tokenizer; kept once made."""
    if (path / "done").is_file():
        return path
    import torch
    import transformers
    from safetensors.torch import save_file

    from jobrunner.models.known import pull

    path.mkdir(parents=True, exist_ok=True)
    cfg = transformers.LlamaConfig(**{**shape, "num_hidden_layers": layers})
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(str(path))
    gguf = Path(pull("smollm2-135m-instruct"))
    transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(path))
    g = torch.Generator().manual_seed(0)
    h, ff, kv = shape["hidden_size"], shape["intermediate_size"], shape["num_key_value_heads"] * shape["head_dim"]

    def rand(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rand(shape["vocab_size"], h),
               "model.norm.weight": (1 + rand(h, std=0.1).float()).to(torch.bfloat16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": (1 + rand(h, std=0.1).float()).to(torch.bfloat16),
                    p + "post_attention_layernorm.weight": (1 + rand(h, std=0.1).float()).to(torch.bfloat16),
                    p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv, h),
                    p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, h),
                    p + "mlp.gate_proj.weight": rand(ff, h), p + "mlp.up_proj.weight": rand(ff, h),
                    p + "mlp.down_proj.weight": rand(h, ff)}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "done").write_text("")
    return path


def make_ggufs(path: Path, python: str | None) -> dict[str, Path]:
    """{qtype: file}: F16 by our converter; Q8_0 and Q4_0 by llama.cpp's quantizer when `python` imports
    llama_cpp (else left out)."""
    f16 = path / "model.F16.gguf"
    if not f16.is_file():
        write_gguf(path, f16.with_suffix(".tmp"), "llama", "F16").rename(f16)
    files = {"F16": f16}
    for q, ftype in LLAMA_FTYPE.items():
        out = path / f"model.{q}.gguf"
        if not out.is_file() and python:
            code = ("import llama_cpp as L, sys; p = L.llama_model_quantize_default_params(); p.ftype = int(sys.argv[3]);"
                    " p.nthread = 2; sys.exit(L.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))")
            subprocess.run([python, "-c", code, str(f16), str(out.with_suffix(".tmp")), str(ftype)], check=True,
                           capture_output=True)
            out.with_suffix(".tmp").rename(out)
        if out.is_file():
            files[q] = out
    return files


def workloads(tok, rows: int, new: int) -> dict[str, tuple[W.Workload, int]]:
    """name -> (workload, new tokens a row; 0: classify)"""
    cls = W.shared_prefix(tok, n=rows)
    return {"free-generation": (W.free_generation(tok, n=rows, min_tokens=90, max_tokens=110), new),
            "shared-prefix": (cls, 16), "shared-prefix/classify": (cls, 0)}


def run_one(system: str, w: W.Workload, data: Path, work: Path, ckpt: Path, ggufs: dict, new: int, a) -> dict:
    slug = f"{data.stem}{'-classify' if not new else ''}.{system}"
    if system in OURS:
        model = ggufs.get("Q4_0") if system.endswith("Q4_0") else ckpt      # -Q4_0: llama.cpp's own 4-bit blocks
        if model is None:
            return {"system": system, "skipped": "no Q4_0 file (needs --llamacpp-python)"}
        job = ["--max-tokens", str(new), "--ignore-eos"] if new else ["--kind", "classify", "--labels", ",".join(w.labels)]
        return run_jobrunner(data, work / slug, ["-m", str(model), "--no-chat", *job, *OURS[system]], system=system,
                             timeout=a.timeout, env=ENV.get(system))
    if system == "transformers":
        return run_transformers(data, ckpt, work / f"{slug}.json", new_tokens=new or 1, batch=w.num_rows,
                                labels=() if new else w.labels, timeout=a.timeout)
    if not new:
        return {"system": system, "skipped": "llama.cpp has no classify job"}
    q = system.split("-", 1)[1]
    if q not in ggufs:
        return {"system": system, "skipped": f"no {q} file (needs --llamacpp-python)"}
    r = run_llamacpp(data, ggufs[q], work / f"{slug}.log", rows=w.num_rows, new_tokens=new, python=a.llamacpp_python,
                     modes="parallel,prefix" if data.stem == "shared-prefix" else "parallel", timeout=a.timeout)
    return {**r, "system": system}


def table(results: dict) -> str:
    lines = ["| workload | system | wall s | output tok/s | peak memory MB | wall vs float32 |", "|---|---|---|---|---|---|"]
    for name, runs in results.items():
        base = runs.get("float32", {}).get("wall_s")
        for system, r in runs.items():
            if not r.get("wall_s"):
                lines.append(f"| {name} | {system} | {r.get('skipped') or r.get('error', '').splitlines()[0]} | | | |")
                continue
            ratio = f"{r['wall_s'] / base:.2f}x" if base else ""
            lines.append(f"| {name} | {system} | {r['wall_s']:.1f} | {r.get('output_tokens_per_s', 0):.1f} | "
                         f"{r.get('peak_rss_mb', 0):.0f} | {ratio} |")
    return "\n".join(lines)


def target_lines(results: dict) -> list[str]:
    out = []
    for name, runs in results.items():
        for ours, peer, want in TARGETS:
            a, b = runs.get(ours, {}).get("wall_s"), runs.get(peer, {}).get("wall_s")
            if a and b:
                out.append(f"{name}: {ours} / {peer} = {a / b:.2f}x (target <= {want}x: "
                           f"{'met' if a / b <= want else 'not met'})")
        a, b = runs.get("int4", {}).get("peak_rss_mb"), runs.get("float32", {}).get("peak_rss_mb")
        if a and b:
            out.append(f"{name}: int4 peak memory / float32's = {a / b:.2f}x (target <= 0.5x)")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--new", type=int, default=64, help="new tokens a row in free generation")
    ap.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    ap.add_argument("--only", help="comma-separated workloads: free-generation, shared-prefix, shared-prefix/classify")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    ap.add_argument("--llamacpp-python", help="a Python that imports llama_cpp (its quantizer and the peer)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("--results-dir", default=str(RESULTS))
    a = ap.parse_args(argv)
    systems = a.systems.split(",")
    if bad := [s for s in systems if s not in SYSTEMS]:
        raise SystemExit(f"--systems: unknown {', '.join(bad)}; choose from {', '.join(SYSTEMS)}")
    a.llamacpp_python = llamacpp_python(a.llamacpp_python)[0]
    # made in a child: the ~4 GB it takes would stay in this driver's peak, which every child's ru_maxrss inherits
    ckpt = model_dir(a.layers)
    subprocess.run([sys.executable, "-c", f"from benchmarks.billion import make_model as m; from pathlib import Path; "
                    f"m(Path({str(ckpt)!r}), {a.layers})"], check=True)
    ggufs = make_ggufs(ckpt, a.llamacpp_python)
    tok = W.our_tokenizer(str(ckpt))
    stamp = report.timestamp()
    work = Path(a.results_dir) / "tmp" / f"billion-{stamp}"
    chosen = workloads(tok, a.rows, a.new)
    if a.only:
        chosen = {k: v for k, v in chosen.items() if k in a.only.split(",")}
    results: dict[str, dict] = {}
    for name, (w, new) in chosen.items():
        data = w.write(work / f"{w.name}.jsonl")
        results[name] = {}
        for system in systems:
            r = run_one(system, w, data, work, ckpt, ggufs, new, a)
            results[name][system] = r
            print(f"[{name}] {system}: " + (f"wall {r['wall_s']:.1f} s, peak {r.get('peak_rss_mb', 0):.0f} MB"
                                            if r.get("wall_s") else r.get("skipped") or r.get("error", "")),
                  flush=True)
    md = table(results) + "\n\n" + "\n".join(f"- {t}" for t in target_lines(results))
    out = {"command": "python -m benchmarks.billion " + " ".join(sys.argv[1:] if argv is None else argv),
           "machine": report.machine(), "versions": report.versions(), "git": report.git(), "shape": SHAPE,
           "layers": a.layers, "rows": a.rows, "results": results}
    Path(a.results_dir).mkdir(parents=True, exist_ok=True)
    (Path(a.results_dir) / f"billion-{stamp}.json").write_text(json.dumps(out, indent=1, default=str))
    (Path(a.results_dir) / f"billion-{stamp}.md").write_text(md + "\n")
    print("\n" + md + f"\n\nresult: {Path(a.results_dir) / f'billion-{stamp}.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
