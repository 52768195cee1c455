"""Engine-level offline throughput on random token prompts, with dummy (random) weights.

    python -m benchmarks.throughput -m dummy:smollm2-135m --num-prompts 32 --input-len 128 --output-len 32
    python -m benchmarks.throughput -m dummy:llama-3.1-8b --num-prompts 1000 --input-len 256 --output-len 256
    python -m benchmarks.throughput -m dummy:llama-3.1-8b --num-prompts 1000 --input-len 100:1024 --output-len 100:1024
    python -m benchmarks.throughput -m dummy:llama-3.1-8b --engine transformers --num-prompts 64 ...   (the peer)
    python -m benchmarks.throughput -m dummy:llama-3.1-8b --num-prompts 1000 --input-len 512 --embed last

--embed POOLING makes every request an embedding (prefill only, pooled; --output-len is ignored):
its total tokens/s compares with the prefill rate of the same prompts with --output-len 1.

Every request generates exactly its output length (ignore_eos). Reported: output tokens/s,
total (prompt + output) tokens/s, requests/s, model FLOP utilization and an estimate of the
memory bandwidth achieved, against --peak-tflops / --peak-bandwidth (defaults: an H200 on CUDA,
790 TFLOP/s bf16 and 4.8 TB/s; on CPU 0.128 TFLOP/s float32, the rate DESIGN.md measured on our
2-core machines, and a bandwidth measured here by a large copy).

How the figures are computed (documented, since they are estimates):
  * MFU = 2 x params x tokens / time / peak. params: every weight used by a matmul (attention
    and MLP projections of all layers, and the LM head), not the embedding table; tokens: every
    token run through the model (prompt tokens computed plus generated). `mfu_with_attention`
    adds attention's own 4 x layers x heads x head_dim x context FLOPs per token.
  * Bandwidth: each engine step streams the matmul weights once; each decode token reads the KV
    of its whole context; prefill tokens write their KV once and read it once. Bytes / time.
  * --time-limit S stops stepping after S seconds and reports what was done by then
    (`truncated: true`); the figures stay per second.

Imports neither polars nor gguf (dummy weights need neither), so it runs on the GPU machine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import time

H200_TFLOPS, H200_TBPS = 790.0, 4.8
CPU_TFLOPS = 0.128


# ------------------------------------------------------------------------------ workload

def parse_len(text: str) -> tuple[int, int]:
    """'256' -> (256, 256); '100:1024' -> (100, 1024), uniform in between (inclusive)."""
    lo, _, hi = str(text).partition(":")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"bad length {text!r}: N or LO:HI with 1 <= LO <= HI")
    return lo, hi


def parse_size(text: str | None) -> int | None:
    if text is None:
        return None
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
    t = text.strip().lower()
    num = t.rstrip("kmgib")
    unit = t[len(num):]
    if unit not in units:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: e.g. 8GiB, 512MB or bytes")
    return int(float(num) * units[unit])


def random_workload(n: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int,
                    seed: int = 0) -> list[tuple[list[int], int]]:
    """n (prompt token ids, output length) pairs; token ids avoid the first 16 (specials)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        i, o = rng.randint(*input_len), rng.randint(*output_len)
        out.append(([rng.randrange(16, vocab) for _ in range(i)], o))
    return out


# ------------------------------------------------------------------------------ model arithmetic

def model_arith(cfg, weight_itemsize: float, kv_itemsize: float) -> dict:
    """Parameter counts and bytes from a ModelConfig (independent of module swaps). Mixture of
    experts: layer_params counts what a token uses (router, its top k experts, a shared expert);
    stored_layer_params every expert, which a step streams once its batch touches them all."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attn = h * (q + 2 * kv) + q * h
    mlp = [_mlp_params(cfg, i) for i in range(cfg.num_layers)]
    layers = cfg.num_layers * attn + sum(active for active, _ in mlp)
    stored = cfg.num_layers * attn + sum(total for _, total in mlp)
    head = h * cfg.vocab_size
    return {"layer_params": layers, "stored_layer_params": stored, "head_params": head,
            "matmul_params": layers + head, "embedding_params": h * cfg.vocab_size,
            "streamed_weight_bytes": (stored + head) * weight_itemsize,
            "kv_bytes_per_token": 2 * cfg.num_layers * kv * kv_itemsize,
            "attn_flops_per_context_token": 4 * cfg.num_layers * q}


def _mlp_params(cfg, layer: int) -> tuple[int, int]:
    """(parameters a token uses, parameters stored) of layer's feed-forward block."""
    h, moe = cfg.hidden_size, getattr(cfg, "moe", None)
    if moe is None or not moe.is_sparse(layer):
        return 3 * h * cfg.intermediate_size, 3 * h * cfg.intermediate_size
    shared = 3 * h * moe.shared_intermediate_size + (h if moe.shared_intermediate_size else 0)
    common = h * moe.num_experts + shared                       # router and shared expert
    expert = 3 * h * moe.intermediate_size
    return common + moe.top_k * expert, common + moe.num_experts * expert


def context_sums(work: list[tuple[list[int], int]]) -> tuple[int, int, int]:
    """(prompt tokens, sum of the keys each prompt token attends to, sum over decode tokens)."""
    prompt = pre = dec = 0
    for ids, o in work:
        i = len(ids)
        prompt += i
        pre += i * (i + 1) // 2
        # decode tokens sit at positions i .. i+o-2 (the first output token comes with the prefill)
        dec += sum(range(i + 1, i + o))
    return prompt, pre, dec


def figures(*, elapsed: float, prompt_done: int, prompt_computed: int, generated: int, steps: int,
            requests: int, work, arith: dict, peak_tflops: float, peak_tbps: float, fraction: float) -> dict:
    tokens = prompt_computed + generated
    _, pre_ctx, dec_ctx = context_sums(work)
    matmul = 2 * arith["layer_params"] * tokens + 2 * arith["head_params"] * generated
    simple = 2 * arith["matmul_params"] * tokens
    attn = arith["attn_flops_per_context_token"] * (pre_ctx + dec_ctx) * fraction
    kv_bytes = arith["kv_bytes_per_token"] * (dec_ctx * fraction + 2 * prompt_computed)
    moved = steps * arith["streamed_weight_bytes"] + kv_bytes
    e = max(elapsed, 1e-9)
    return {
        "elapsed_s": elapsed, "requests_finished": requests, "steps": steps,
        "prompt_tokens": prompt_done, "prompt_tokens_computed": prompt_computed, "output_tokens": generated,
        "output_tokens_per_s": generated / e, "total_tokens_per_s": (prompt_done + generated) / e,
        "requests_per_s": requests / e,
        "model_tflops": simple / e / 1e12, "mfu": simple / e / 1e12 / peak_tflops,
        "mfu_with_attention": (matmul + attn) / e / 1e12 / peak_tflops,
        "achieved_bandwidth_tbps": moved / e / 1e12, "bandwidth_fraction": moved / e / 1e12 / peak_tbps,
        "peak_tflops": peak_tflops, "peak_bandwidth_tbps": peak_tbps,
        "params_matmul": arith["matmul_params"],
    }


def measure_copy_bandwidth(device) -> float:
    """TB/s of a large device-to-device copy (read + write), best of 3."""
    import torch
    x = torch.empty(64 * 2**20, dtype=torch.float32, device=device)   # 256 MiB
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(3):
        if x.is_cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        y.copy_(x)
        if x.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * x.numel() * 4 / best / 1e12


# ------------------------------------------------------------------------------ runs

def _engine_config(args):
    from jobrunner.engine.config.engine_config import EngineConfig
    from jobrunner.models.known import resolve_model

    return EngineConfig(model=resolve_model(args.model), device=args.device, dtype=args.dtype, quantization=args.quantization,
                        kv_cache_dtype=args.kv_cache_dtype, kv_cache_memory=args.kv_cache_memory,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens,
                        enable_prefix_caching=not args.no_prefix_cache, seed=args.seed, num_threads=args.threads,
                        cuda_graphs=not args.eager, async_scheduling=not args.sync_scheduling,
                        tensor_parallel=args.tensor_parallel)


def _warm_up(engine, args, sync) -> float:
    """Runs args.warmup short requests before timing; their seconds (0.0: no warm-up)."""
    from jobrunner.engine.api.request import Request, SamplingParams

    if not args.warmup:
        return 0.0
    rng = random.Random(args.seed + 1)
    vocab = engine.rt.model_config.vocab_size
    warm = [Request(f"warmup-{k}", [rng.randrange(16, vocab) for _ in range(32 + 8 * k)],
                    SamplingParams(max_tokens=8, ignore_eos=True)) for k in range(args.warmup)]
    tw = time.perf_counter()
    engine.generate(warm)
    sync()
    return time.perf_counter() - tw


def _timed_run(engine, args, work, sync) -> tuple[int, bool, float]:
    """Adds the workload's requests and steps the engine until done or past --time-limit
    (profiling --profile-steps of them); (requests finished, truncated, elapsed seconds)."""
    from jobrunner.engine.api.request import EmbedParams, Request, SamplingParams

    embed = EmbedParams(args.embed) if args.embed else None
    penalties = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1) if args.penalties else {}
    reqs = [Request(f"r{i}", ids, SamplingParams(max_tokens=o, ignore_eos=True, **penalties), embed=embed)
            for i, (ids, o) in enumerate(work)]
    sync()
    start = time.perf_counter()
    for r in reqs:
        engine.add_request(r)
    finished, truncated = 0, False
    profiled = 0
    while engine.has_unfinished():
        if args.profile_steps and profiled == 0 and engine.counters().steps >= args.profile_after:
            finished += profile_steps(engine, args.profile_steps, sync)
            profiled = 1
            continue
        finished += len(engine.step())
        if args.time_limit and time.perf_counter() - start > args.time_limit:
            truncated = engine.has_unfinished()
            break
    sync()
    return finished, truncated, time.perf_counter() - start


def _our_figures(args, engine, work, finished: int, elapsed: float) -> dict:
    """figures() from the engine's counters, with the weight bytes averaged over the model as loaded."""
    rt, c = engine.rt, engine.counters()
    planned = sum(len(ids) + o for ids, o in work)
    done_prompt = c.prompt_tokens_computed + c.prompt_tokens_cached
    # bytes a weight takes, averaged over the model as loaded (quantized or not)
    unit = model_arith(rt.model_config, 1, 1)
    unique = unit["stored_layer_params"] + unit["embedding_params"] + (
        0 if rt.model_config.tie_word_embeddings else unit["head_params"])
    arith = model_arith(rt.model_config, rt.weight_bytes / unique, rt.kv_dtype.itemsize)
    peak_tf, peak_bw = peaks(args, rt.device)
    done = min(1.0, (done_prompt + c.generated_tokens) / planned)
    return figures(elapsed=elapsed, prompt_done=done_prompt, prompt_computed=c.prompt_tokens_computed,
                   generated=c.generated_tokens, steps=c.steps, requests=finished, work=work, arith=arith,
                   peak_tflops=peak_tf, peak_tbps=peak_bw, fraction=done)


def run_ours(args, work) -> dict:
    from jobrunner.engine.core.engine import Engine

    cfg = _engine_config(args)
    t0 = time.perf_counter()
    engine = Engine(cfg)
    load = time.perf_counter() - t0
    try:
        return _run_engine(args, work, cfg, engine, load)
    finally:
        engine.close()


def _run_engine(args, work, cfg, engine, load) -> dict:
    import torch
    rt = engine.rt
    sync = torch.cuda.synchronize if rt.device.type == "cuda" else (lambda: None)
    warm_s = _warm_up(engine, args, sync)
    engine.reset_counters()
    finished, truncated, elapsed = _timed_run(engine, args, work, sync)
    c = engine.counters()
    out = _our_figures(args, engine, work, finished, elapsed)
    out.update(engine="jobrunner", model=args.model, device=str(rt.device), dtype=str(rt.dtype).replace("torch.", ""),
               kv_blocks=rt.num_blocks, load_s=load, warmup_s=warm_s, truncated=truncated,
               preemptions=c.preemptions, cached_prompt_tokens=c.prompt_tokens_cached,
               cuda_graphs=engine.runner.graphs is not None, graph_capture_s=engine.graph_capture_s,
               graph_steps=c.graph_steps, max_num_seqs=rt.max_num_seqs, max_batched_tokens=rt.max_num_batched_tokens,
               async_scheduling=cfg.async_scheduling,
               host_s={k: round(getattr(c, k), 3) for k in ("schedule_s", "prepare_s", "forward_s", "sample_s",
                                                            "wait_s", "process_s")})
    return out


def profile_steps(engine, n: int, sync) -> int:
    """Runs n engine steps under torch.profiler and prints where the time went (device kernels
    and host ops). Returns the requests that finished meanwhile."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.rt.device.type == "cuda" else [])
    finished = 0
    sync()
    t = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(n):
            finished += len(engine.step())
        sync()
    wall = time.perf_counter() - t
    key = "self_cuda_time_total" if engine.rt.device.type == "cuda" else "self_cpu_time_total"
    running = len(engine.scheduler.running)
    print(f"--- profile: {n} steps, {wall * 1000 / n:.1f} ms/step wall, {running} running sequences ---")
    print(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60))
    return finished


def _hf_device_dtype(args):
    """(torch device, torch dtype) for the transformers peer from --device and --dtype."""
    import torch

    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    return device, dtype


def _load_hf_model(model_name: str, device, dtype):
    """A transformers model: random weights from a dummy:<name or config> spec, else from_pretrained."""
    import torch
    import transformers

    from jobrunner.engine.load.loader import DUMMY_CONFIGS
    if model_name.startswith("dummy:"):
        spec = model_name[len("dummy:"):]
        if spec in DUMMY_CONFIGS:
            hf = dict(DUMMY_CONFIGS[spec])
        else:
            with open(spec if spec.endswith(".json") else f"{spec}/config.json") as f:
                hf = json.load(f)
        hf.pop("architectures", None)
        conf = transformers.AutoConfig.for_model(hf.pop("model_type", "llama"), **hf)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(conf, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_name, dtype=dtype).to(device)
    model.eval()
    return model


def _hf_generate_batch(model, batch, device) -> int:
    """Left-padded greedy generate of one batch to its longest output length; that length."""
    import torch

    width = max(len(ids) for ids, _ in batch)
    new = max(o for _, o in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for k, (p, _) in enumerate(batch):          # left padding
        ids[k, width - len(p):] = torch.tensor(p)
        mask[k, width - len(p):] = 1
    model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                   min_new_tokens=new, do_sample=False, pad_token_id=0)
    return new


def _hf_timed_run(model, args, work, device) -> dict:
    """Generates the workload in --hf-batch batches until done or past --time-limit; the counts and elapsed_s."""
    import torch

    n = dict(generated=0, prompt=0, steps=0, computed=0, finished=0, truncated=False)
    start = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(work), args.hf_batch):
            batch = work[b:b + args.hf_batch]
            new = _hf_generate_batch(model, batch, device)
            n["prompt"] += sum(len(p) for p, _ in batch)
            n["computed"] += sum(len(p) for p, _ in batch)
            n["generated"] += sum(o for _, o in batch)
            n["steps"] += new
            n["finished"] += len(batch)
            if args.time_limit and time.perf_counter() - start > args.time_limit and b + args.hf_batch < len(work):
                n["truncated"] = True
                break
    if device.type == "cuda":
        torch.cuda.synchronize()
    n["elapsed_s"] = time.perf_counter() - start
    return n


def run_transformers(args, work) -> dict:
    """HF transformers batched greedy generate on the same prompts (the peer). Rows of a batch
    generate the batch's longest output length; each row counts only its own."""
    import torch
    import transformers

    device, dtype = _hf_device_dtype(args)
    if args.threads and device.type == "cpu":
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model = _load_hf_model(args.model, device, dtype)
    load = time.perf_counter() - t0
    n = _hf_timed_run(model, args, work, device)
    from jobrunner.engine.config.model_config import ModelConfig
    mc = ModelConfig.from_hf({**model.config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    arith = model_arith(mc, dtype.itemsize, dtype.itemsize)
    peak_tf, peak_bw = peaks(args, device)
    out = figures(elapsed=n["elapsed_s"], prompt_done=n["prompt"], prompt_computed=n["computed"],
                  generated=n["generated"], steps=n["steps"], requests=n["finished"], work=work[:n["finished"]],
                  arith=arith, peak_tflops=peak_tf, peak_tbps=peak_bw, fraction=1.0)
    out.update(engine=f"transformers {transformers.__version__} (batch {args.hf_batch})", model=args.model,
               device=str(device), dtype=str(dtype).replace("torch.", ""), load_s=load, truncated=n["truncated"])
    return out


_MEASURED_BW = {}


def peaks(args, device) -> tuple[float, float]:
    if device.type == "cuda":
        return args.peak_tflops or H200_TFLOPS, args.peak_bandwidth or H200_TBPS
    if args.peak_bandwidth is None and "cpu" not in _MEASURED_BW:
        _MEASURED_BW["cpu"] = measure_copy_bandwidth(device)
    return args.peak_tflops or CPU_TFLOPS, args.peak_bandwidth or _MEASURED_BW["cpu"]


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run_identity(args, argv: list[str] | None) -> dict:
    """What a result line needs to be compared later: the device's name, the numeric setup, the code, the command."""
    import torch
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() and args.device != "cpu" else None
    return dict(gpu=gpu, cpu=platform.processor() or platform.machine(), quantization=args.quantization,
                tensor_parallel=args.tensor_parallel,
                kv_cache_dtype=args.kv_cache_dtype, commit=_commit(),
                command=shlex.join(["python", "-m", "benchmarks.throughput",
                                    *(sys.argv[1:] if argv is None else argv)]))


def _lengths(lo_hi: list[int]) -> str:
    return str(lo_hi[0]) if lo_hi[0] == lo_hi[1] else f"{lo_hi[0]}:{lo_hi[1]}"


def summary_line(r: dict) -> str:
    setup = "" if r.get("quantization", "none") == "none" else f" {r['quantization']}"
    setup += "" if r.get("kv_cache_dtype", "auto") == "auto" else f" kv={r['kv_cache_dtype']}"
    setup += "" if r.get("tensor_parallel", 1) == 1 else f" tp={r['tensor_parallel']}"
    return (f"{r['engine']} {r['model']} {r['gpu'] or r['device']} {r['dtype']}{setup} "
            f"{_lengths(r['input_len'])}/{_lengths(r['output_len'])}: {r['requests_finished']} requests in "
            f"{r['elapsed_s']:.1f}s{' (TRUNCATED by --time-limit)' if r.get('truncated') else ''} | "
            f"output {r['output_tokens_per_s']:,.0f} tok/s | total {r['total_tokens_per_s']:,.0f} tok/s | "
            f"MFU {100 * r['mfu']:.1f}% ({100 * r['mfu_with_attention']:.1f}% with attention) of "
            f"{r['peak_tflops']:g} TFLOP/s | bandwidth ~{1000 * r['achieved_bandwidth_tbps']:,.1f} GB/s "
            f"({100 * r['bandwidth_fraction']:.0f}% of {1000 * r['peak_bandwidth_tbps']:,.0f}) "
            f"| load {r['load_s']:.1f}s" + (f" | graphs {r['graph_steps']}/{r['steps']} steps, capture "
                                            f"{r['graph_capture_s']:.1f}s | host {r['host_s']}" if 'host_s' in r else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.throughput", description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="dummy:smollm2-135m",
                    help="dummy:smollm2-135m, dummy:llama-3.1-8b, dummy:qwen3-30b-a3b, dummy:<config.json> (or any model jobrunner loads)")
    ap.add_argument("--engine", choices=("ours", "transformers"), default="ours")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=parse_len, default=(128, 128), help="N or LO:HI (uniform)")
    ap.add_argument("--output-len", type=parse_len, default=(64, 64), help="N or LO:HI (uniform)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--kv-cache-memory", type=parse_size, help="e.g. 8GiB (default: the engine's)")
    ap.add_argument("--max-num-seqs", type=int, help="default: the engine's (256 on CPU, 1024 on a GPU)")
    ap.add_argument("--max-batched-tokens", type=int, help="default: the engine's (2048 on CPU, 8192 on a GPU)")
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs for decode steps")
    ap.add_argument("--penalties", action="store_true",
                    help="every request with presence, frequency and repetition penalties (logits processing)")
    ap.add_argument("--sync-scheduling", action="store_true",
                    help="wait for each step before scheduling the next (no async scheduling)")
    ap.add_argument("--profile-steps", type=int, default=0, help="profile this many steps (torch.profiler table)")
    ap.add_argument("--profile-after", type=int, default=0, help="... starting after this many steps")
    ap.add_argument("--threads", type=int, help="CPU compute threads (default: torch's, one per core)")
    ap.add_argument("--tensor-parallel", type=int, default=1, help="devices (processes) one engine spans")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up requests before timing (0: none)")
    ap.add_argument("--time-limit", type=float, default=0, help="stop after this many seconds (0: run all)")
    ap.add_argument("--hf-batch", type=int, default=64, help="transformers: prompts per generate call")
    ap.add_argument("--peak-tflops", type=float, help="default: 790 on CUDA (H200 bf16), 0.128 on CPU")
    ap.add_argument("--peak-bandwidth", type=float, help="TB/s; default: 4.8 on CUDA (H200), measured on CPU")
    ap.add_argument("--embed", choices=("last", "mean", "cls"),
                    help="embedding requests pooled so: prefill only, --output-len ignored (ours only)")
    ap.add_argument("--json", help="write the figures to this file too")
    args = ap.parse_args(argv)
    if args.embed and args.engine != "ours":
        ap.error("--embed runs our engine only")

    from jobrunner.engine.load.loader import load_model_bundle
    from jobrunner.models.known import resolve_model
    vocab = load_model_bundle(resolve_model(args.model)).config.vocab_size
    work = random_workload(args.num_prompts, args.input_len, args.output_len, vocab, args.seed)
    if args.embed:
        work = [(ids, 0) for ids, _ in work]
    r = run_ours(args, work) if args.engine == "ours" else run_transformers(args, work)
    r.update(num_prompts=args.num_prompts, input_len=list(args.input_len), output_len=list(args.output_len),
             embed=args.embed, **run_identity(args, argv))
    print(summary_line(r))
    print(json.dumps(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
