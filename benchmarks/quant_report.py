"""Quantization report: quality, memory and speed of each scheme against the unquantized model.

    python -m benchmarks.quant_report                     # default model, CPU: none int8 int4 w8a8 w8a8-fbgemm fp8 bf16
    python -m benchmarks.quant_report --schemes none,w8a8 --prompts 8 --max-tokens 16    # quick look
    python -m benchmarks.quant_report --model dummy:llama-3.1-8b --device cuda           # GPU (quality columns
                                                                                          # meaningless: random weights)
    python -m benchmarks.quant_report --compile-check     # build the Triton kernels for sm_90, no GPU needed

Per scheme:
  * greedy agreement: share of held-out chat prompts whose greedy output (up to --check-tokens,
    stopping at end of turn) equals the unquantized model's token for token;
  * perplexity of a fixed English text (score mode: Request(score_from=1));
  * weight bytes (what the model holds: EngineRuntime.weight_bytes) and the KV tokens that fit
    beside them in --memory-gib of RAM (model-dtype KV cache);
  * speed on a generation workload (--prompts x --max-tokens, greedy, ignore_eos), best of
    --repeats: tokens/s by the wall clock, and tokens per CPU-second of this process, which a
    busy shared machine disturbs far less (a descheduled process accrues no CPU time).

"w8a8-fbgemm" is w8a8 through torch.ao's dynamic quantized linear (fbgemm; each row scaled to
max |x| = 1, then activations quantized per batch, 8-bit where exact, else 7-bit), measured for comparison; plain "w8a8" takes the exact per-token
path (torch._int_mm) where this CPU has one. "bf16" is no quantization with bfloat16 compute (AMX
or AVX512_BF16 CPUs make it several times faster than float32). "q4xq8" (benchmark-only, no --quantization
scheme) keeps the GGUF blocks as stored and multiplies them with int8 activations per block of 32, as
llama.cpp does (kernels/matmul/gguf_matmul.py; issue 20 item 3). Writes a Markdown table to stdout
and to --out.
"""
from __future__ import annotations

from jobrunner.planner import lcp

import argparse
import gc
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.gguf_matmul_bench import swap_to_q4xq8

DEFAULT_OUT = Path(__file__).parent / "results" / "quant.md"

# Held out: none of these is used by tests/test_quant.py.
HELD_OUT = [
    "What is the largest planet in the solar system?", "Give two synonyms for 'happy'.",
    "Explain in one sentence what a CPU does.", "What is 12 times 7?",
    "Write a haiku about autumn.", "Name a famous painting by Leonardo da Vinci.",
    "What language is spoken in Brazil?", "Suggest a name for a pet goldfish.",
    "Is a tomato a fruit or a vegetable?", "What does HTML stand for?",
    "List three kinds of renewable energy.", "How many days are in a leap year?",
    "Summarize the plot of Cinderella in one sentence.", "What is the boiling point of water in Fahrenheit?",
    "Recommend a book for someone who likes science fiction.", "What is the opposite of 'ancient'?",
]
TOPICS = ["the ocean", "trains", "coffee", "mountains", "libraries", "bicycles", "volcanoes", "chess",
          "honeybees", "the moon", "bread", "rainforests", "jazz", "lighthouses", "deserts", "robots",
          "tea", "castles", "whales", "autumn", "bridges", "museums", "owls", "glaciers",
          "gardens", "maps", "kites", "islands", "clocks", "rivers", "snow", "markets"]
# A fixed text for perplexity (written for this benchmark; plain English prose).
TEXT = """\
The old harbor town woke slowly on winter mornings. Fishing boats rocked against the pier while the \
gulls argued over the scraps left from the night before, and the baker on the corner opened his shutters \
a little after six. By seven the smell of fresh bread had drifted down to the water, where a few men in \
heavy coats were mending nets and talking about the weather.

Most of the people who lived there had never thought of leaving. Their parents had worked the same \
boats and the same shops, and the rhythm of the tides shaped their days more than any clock. In summer \
the streets filled with visitors who photographed the painted doors and asked for directions to the \
lighthouse, but by October the town belonged to its own people again.

The lighthouse itself stood on a rocky point at the end of a narrow path. It had been built more than a \
century ago, after a storm drove three ships onto the rocks in a single night. For decades a keeper and \
his family lived at the base of the tower, climbing the spiral stairs every evening to light the lamp and \
wind the clockwork that turned the lens. Today the light is automatic, and the keeper's cottage has become \
a small museum with old logbooks, brass instruments and a collection of photographs.

Children from the local school visit the museum every spring. They read the careful handwriting in the \
logbooks, which records the wind, the visibility and every ship that passed, and they try to imagine a \
life measured in nights without sleep. Their teacher always ends the visit at the top of the tower, where \
on a clear day you can see the coastline curve away for miles and the islands sit low on the horizon like \
sleeping animals.
"""


@dataclass
class Row:
    label: str
    scheme: str
    note: str = ""
    weight_bytes: int = 0
    kv_tokens: int = 0
    agree: float = float("nan")
    prefix: float = float("nan")
    ppl: float = float("nan")
    wall_tps: float = float("nan")
    cpu_tps: float = float("nan")
    load_s: float = float("nan")


VARIANTS = {  # label -> (EngineConfig.quantization, extra quantize_model kwargs or None)
    "none": ("none", None), "int8": ("int8", None), "int4": ("int4", None), "int4-g128": ("int4-g128", None),
    "w8a8": ("w8a8", None), "w8a8-fbgemm": ("w8a8", dict(w8a8_backend_name="fbgemm")), "fp8": ("fp8", None),
    "bf16": ("none", None), "q4xq8": ("int4", None),
}
# label -> what is done to the quantized model after it is built (benchmark-only paths)
POST = {"q4xq8": swap_to_q4xq8}
DTYPES = {"bf16": "bfloat16"}    # label -> compute dtype, where not the device's default


def build_engine(label: str, args, bundle):
    from jobrunner.engine.config.engine_config import EngineConfig
    from jobrunner.engine.core.engine import Engine
    from jobrunner.engine.quant import quantize_model
    from jobrunner.engine.run.runtime import _unique_tensors, build_runtime

    scheme, extra = VARIANTS[label]
    cfg = EngineConfig(model=args.model, device=args.device, quantization=scheme if extra is None else "none",
                       dtype=DTYPES.get(label, "auto"),
                       kv_cache_memory=args.kv_cache_mb << 20, num_threads=args.threads or None)
    t = time.perf_counter()
    rt = build_runtime(cfg, bundle)
    if label in POST:
        POST[label](rt.model)
    if extra is not None:
        quantize_model(rt.model, scheme, bundle, **extra)
    if extra is not None or label in POST:
        rt.weight_bytes = sum(t.numel() * t.element_size() for t in _unique_tensors(rt.model))
    return Engine(cfg, runtime=rt), time.perf_counter() - t


def _chat(tok, text: str) -> list[int]:
    if getattr(tok, "has_chat_template", False):
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
    return tok.encode(text)


def measure(engine, args, tok) -> dict:
    from jobrunner.engine.api.request import Request, SamplingParams

    out = {}
    greedy = engine.generate([Request(f"q{i}", _chat(tok, q), SamplingParams(max_tokens=args.check_tokens))
                              for i, q in enumerate(HELD_OUT)])
    out["greedy"] = [o.token_ids for o in greedy]
    ids = tok.encode(TEXT)
    lp = engine.generate([Request("ppl", ids, score_from=1)])[0].prompt_logprobs
    out["ppl"] = math.exp(-sum(lp) / len(lp))
    prompts = [_chat(tok, f"Write a short paragraph about {TOPICS[i % len(TOPICS)]}.") for i in range(args.prompts)]
    best_wall = best_cpu = 0.0
    for rep in range(args.repeats):
        reqs = [Request(f"r{rep}-{i}", p, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
                for i, p in enumerate(prompts)]
        w0, c0 = time.perf_counter(), time.process_time()
        outs = engine.generate(reqs)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        n = sum(len(o.token_ids) for o in outs)
        best_wall, best_cpu = max(best_wall, n / wall), max(best_cpu, n / cpu)
    out["wall_tps"], out["cpu_tps"] = best_wall, best_cpu
    return out


def run(args) -> list[Row]:
    from jobrunner.engine.config.engine_config import ConfigError
    from jobrunner.engine.load.loader import load_model_bundle
    from jobrunner.engine.run.model_runner import ModelRunner
    from jobrunner.engine.quant import check_quantization, w8a8_backend
    from jobrunner.engine.run.runtime import resolve_device, resolve_dtype
    from jobrunner.models.known import resolve_model

    device = resolve_device(args.device)
    dtype = resolve_dtype("auto", device)
    bundle = load_model_bundle(resolve_model(args.model))
    tok = bundle.tokenizer
    base = None
    rows = []
    for label in args.schemes:
        scheme = VARIANTS[label][0]
        row = Row(label, scheme)
        if label == "w8a8":
            b, qmax = w8a8_backend(device)
            row.note = f"{b}, weights +-{qmax}, activations per token"
        elif label == "w8a8-fbgemm":
            from jobrunner.kernels.ops import fbgemm_full_range
            bits = 8 if fbgemm_full_range() else 7
            row.note = f"fbgemm, rows scaled, then one activation scale per batch ({bits}-bit)"
        elif label == "q4xq8":
            row.note = ("GGUF blocks as stored (nibbles unpacked to int8) x int8 activations per block of 32: "
                        "llama.cpp's Q4_1 x Q8_1, one torch._int_mm per block (benchmarks/gguf_matmul_bench.py)")
        elif label.startswith("int4"):
            row.note = "GGUF Q4_x layers as stored" if label == "int4" and bundle.weight_format == "gguf" else ""
        try:
            if scheme != "none":
                check_quantization(scheme, device, dtype)
            engine, row.load_s = build_engine(label, args, bundle)
        except ConfigError as e:
            row.note = f"not run: {e}"
            rows.append(row)
            print(f"{label}: {row.note}", flush=True)
            continue
        row.weight_bytes = engine.rt.weight_bytes
        per_token = ModelRunner.kv_bytes_per_block(engine.rt.model_config, 1, engine.rt.kv_dtype)
        row.kv_tokens = max(0, (int(args.memory_gib * 2**30) - row.weight_bytes) // per_token)
        m = measure(engine, args, tok)
        del engine
        gc.collect()
        if base is None:
            base = m
        same = [a == b for a, b in zip(m["greedy"], base["greedy"])]
        row.agree = sum(same) / len(same)
        row.prefix = sum(lcp(a, b) / max(len(b), 1) for a, b in zip(m["greedy"], base["greedy"])) / len(same)
        row.ppl, row.wall_tps, row.cpu_tps = m["ppl"], m["wall_tps"], m["cpu_tps"]
        rows.append(row)
        print(f"{label}: {row}", flush=True)
    return rows


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def markdown(rows: list[Row], args, load_before: str, load_after: str) -> str:
    base = next((r for r in rows if r.label == "none" and r.weight_bytes), None)
    lines = [
        "# Quantization report",
        "",
        f"Model `{args.model}` on {args.device} ({_cpu_name()}, {os.cpu_count()} logical CPUs, "
        f"{args.threads or torch.get_num_threads()} torch thread(s)); torch {torch.__version__}; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        f"* greedy = float: share of {len(HELD_OUT)} held-out chat prompts whose greedy output (up to "
        f"{args.check_tokens} tokens, stopping at end of turn) equals the unquantized model's; prefix: mean share "
        f"of the float output matched before the first difference.",
        f"* ppl: perplexity of a fixed {len(TEXT.split())}-word English text (score mode).",
        f"* KV tokens: tokens of KV cache ({'float32' if args.device != 'cuda' else 'model dtype'}) that fit "
        f"beside the weights in {args.memory_gib:g} GiB.",
        f"* speed: {args.prompts} prompts x {args.max_tokens} generated tokens, greedy, best of {args.repeats}; "
        "tok/s by the wall clock and per CPU-second of this process; x float uses CPU time.",
        f"* The machine is shared with other engineers' jobs (load average {load_before} before, {load_after} "
        "after): wall-clock figures are noisy; the CPU-time figures are steadier but not immune "
        "(caches and memory bandwidth are shared too).",
        "",
        "| scheme | weights MB | x float | KV tokens | greedy = float | prefix | ppl | ppl x float "
        "| tok/s (wall) | tok/CPU-s | speed x float | notes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if not r.weight_bytes:
            lines.append(f"| {r.label} | | | | | | | | | | | {r.note} |")
            continue
        wx = r.weight_bytes / base.weight_bytes if base else float("nan")
        px = r.ppl / base.ppl if base else float("nan")
        sx = r.cpu_tps / base.cpu_tps if base else float("nan")
        lines.append(f"| {r.label} | {r.weight_bytes / 1e6:.1f} | {wx:.3f} | {r.kv_tokens:,} | {r.agree:.0%} | "
                     f"{r.prefix:.0%} | {r.ppl:.2f} | {px:.3f} | {r.wall_tps:.1f} | {r.cpu_tps:.1f} | {sx:.2f} | "
                     f"{r.note} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- sm_90 compile check

def compile_check(arch: int = 90) -> list[str]:
    """Compile the int8/int4 kernels with the launch configurations the launchers pick, for
    sm_<arch>, with triton's bundled toolchain (no GPU); report registers and spills."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from benchmarks.kernel_bench import cubin_resources
    from jobrunner.kernels.matmul import quant_matmul_triton as tq
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("--compile-check needs TRITON_INTERPRET unset")
    out = []
    for tdt, dt in ((torch.bfloat16, "*bf16"), (torch.float16, "*fp16"), (torch.float32, "*fp32")):
        for m in (1, 32, 64):
            bm, bn, bk, warps = tq._tiles(m, tdt)
            cases = [(f"int8 g{g or 'ch'}", tq._int8_matmul_kernel,
                      dict(x_ptr=dt, w_ptr="*i8", s_ptr="*fp32", b_ptr=dt, y_ptr=dt),
                      dict(GROUP=g, HAS_BIAS=True, IEEE=tdt == torch.float32, BLOCK_M=bm, BLOCK_N=bn,
                           BLOCK_K=min(g, bk) if g else bk)) for g in (0, 32)]
            cases += [(f"int4 g{g}", tq._int4_matmul_kernel,
                       dict(x_ptr=dt, p_ptr="*u8", s_ptr="*fp16", z_ptr="*fp16", b_ptr=dt, y_ptr=dt),
                       dict(HALF=g // 2, SUB=min(bk, g // 2), HAS_BIAS=True, IEEE=tdt == torch.float32,
                            BLOCK_M=bm, BLOCK_N=bn)) for g in (32, 64, 128)]
            for name, kernel, types, cx in cases:
                fn = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)
                sig = {n: ("constexpr" if n in cx else types.get(n, "i32")) for n in fn.arg_names}
                attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
                k = triton.compile(ASTSource(fn, sig, constexprs=cx, attrs=attrs),
                                   target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps))
                found = cubin_resources(k.asm["cubin"])
                usage = f"regs {found[0]}, spill {found[1]} B" if found else "?"
                out.append(f"{name:10s} {dt[1:]:5s} M<={m:<3d} tile {bm}x{bn}: {usage}, "
                           f"{'mma' if 'mma' in k.asm['ptx'] else 'fma'}")
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--device", default="cpu")
    p.add_argument("--schemes", default="none,int8,int4,w8a8,w8a8-fbgemm,fp8,bf16",
                   help=f"comma-separated, from {', '.join(VARIANTS)}; the first should be none")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--check-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: on a busy shared machine more threads wait on each other)")
    p.add_argument("--kv-cache-mb", type=int, default=256)
    p.add_argument("--memory-gib", type=float, default=1.0)
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--compile-check", action="store_true")
    args = p.parse_args(argv)
    if args.compile_check:
        print("\n".join(compile_check()))
        return
    args.schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    unknown = [s for s in args.schemes if s not in VARIANTS]
    if unknown:
        p.error(f"unknown schemes {unknown}; choose from {', '.join(VARIANTS)}")
    load_before = _load()
    rows = run(args)
    text = markdown(rows, args, load_before, _load())
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
