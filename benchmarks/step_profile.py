"""Where one engine step's time goes, op by op: a decode step at N sequences and a prefill chunk.

    python -m benchmarks.step_profile                      # the default model, 64 decodes, a 2048-token chunk
    python -m benchmarks.step_profile --threads 1 --seqs 64 --prompt-len 64 --chunk 2048
    python -m benchmarks.step_profile --prefix-len 320     # also a step of --seqs chunks over a cached prefix

Each phase is timed first without the profiler (the median of --steps steps' wall), then profiled
over the same number of steps. The table groups torch's ops by what they do (matmul, attention,
norm, rotary, activation, residual, sampling, logits processing, KV write, other ops); "Python
between ops" is the unprofiled wall less every op's own time (the profiler's own overhead is left out). Each matmul shape gets its GFLOP/s.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import defaultdict

# matmul op -> ((M, K), N) from its input shapes: F.linear's mm takes x [M, K] and w.t() [K, N];
# a packed linear (kernels/matmul/cpu_linear.py) x [M, K] and the weight [N, K]
MATMULS = {"aten::mm": lambda s: (tuple(s[0][:2]), s[1][1]),
           "mkldnn::_linear_pointwise": lambda s: (tuple(s[0][-2:]), s[1][0])}
# op name -> group; the first key contained in the name wins (lower-cased)
GROUPS = [
    ("cpu_attention", "attention"), ("attention", "attention"), ("sdpa", "attention"), ("flex", "attention"),
    ("scaled_dot_product", "attention"), ("softmax", "attention"), ("bmm", "attention"),
    ("aten::mm", "matmul"), ("aten::addmm", "matmul"), ("linear", "matmul"), ("fbgemm", "matmul"),
    (".matmul", "matmul"),          # the C weight kernels' calls, named cpu_int4.matmul etc. (no shapes recorded)
    ("quantized", "matmul"), ("rms_norm", "norm"), ("aten::pow", "norm"), ("aten::rsqrt", "norm"),
    ("aten::mean", "norm"), ("aten::sum", "norm"),
    ("aten::sin", "rotary"), ("aten::cos", "rotary"), ("aten::neg", "rotary"), ("aten::cat", "rotary"),
    ("silu", "activation"), ("gelu", "activation"), ("aten::mul", "elementwise mul"),
    ("aten::add", "residual add"), ("index_copy", "KV write"), ("index_put", "KV write"),
    ("argmax", "sampling"), ("multinomial", "sampling"), ("topk", "sampling"), ("sort", "sampling"),
    ("exponential", "sampling"), ("log_softmax", "sampling"), ("aten::div", "logits processing"),
    ("masked_fill", "logits processing"), ("scatter", "logits processing"), ("gather", "logits processing"),
    ("aten::copy_", "copies"), ("index_select", "copies"), ("aten::to", "copies"), ("contiguous", "copies"),
]
WRAPPERS = ("aten::matmul", "aten::linear", "aten::rms_norm", "aten::_fused_rms_norm")   # totals, not own time


def group_of(name: str) -> str:
    low = name.lower()
    for key, group in GROUPS:
        if key in low:
            return group
    return "other ops"


def _requests(n: int, prompt_len: int, max_tokens: int, vocab: int, seed: int, shared: int = 0):
    from jobrunner.engine.api.request import Request, SamplingParams
    rng = random.Random(seed)
    prefix = [rng.randrange(16, vocab) for _ in range(shared)]
    return [Request(f"r{i}", prefix + [rng.randrange(16, vocab) for _ in range(prompt_len - shared)],
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for i in range(n)]


def _wall_per_step(engine, steps: int) -> float:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _profile(engine, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            engine.step()
    wall = (time.perf_counter() - t) / steps
    groups: dict[str, float] = defaultdict(float)
    shapes: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for ev in prof.key_averages(group_by_input_shape=True):
        own = ev.self_cpu_time_total / 1e6 / steps
        if ev.key in WRAPPERS or own <= 0:
            continue
        groups[group_of(ev.key)] += own
        if ev.key in MATMULS and len(ev.input_shapes) >= 2 and ev.input_shapes[0] and ev.input_shapes[1]:
            (m, k), n = MATMULS[ev.key](ev.input_shapes)
            entry = shapes[f"{m}x{k} @ {k}x{n}"]
            entry[0] += own
            entry[1] = 2 * m * k * n * ev.count / steps
    return {"profiled_wall_s": wall, "groups": dict(groups),
            "matmuls": {s: {"ms": 1e3 * t_, "gflops": f / t_ / 1e9} for s, (t_, f) in shapes.items() if t_ > 0}}


def decode_phase(engine, args) -> dict:
    vocab = engine.rt.model_config.vocab_size
    steps_needed = 2 * args.steps + 4
    for r in _requests(args.seqs, args.prompt_len, steps_needed + 8, vocab, args.seed):
        engine.add_request(r)
    while len(engine.scheduler.running) < args.seqs or engine.scheduler.waiting:
        engine.step()
    for _ in range(2):
        engine.step()
    rt = engine.rt
    # K and V a decode step's attention reads: every running row's context, in every layer
    contexts = sum(s.num_tokens for s in engine.scheduler.running) + args.steps * args.seqs
    row_bytes = 2 * rt.model_config.num_kv_heads * rt.model_config.head_dim * rt.kv_dtype.itemsize
    kv_bytes = contexts * row_bytes * rt.model_config.num_layers
    wall, kernel_s = _timing_decode_kernel(lambda: _wall_per_step(engine, args.steps))
    out = _with_python({"wall_s": wall, **_profile(engine, args.steps), "kv_bytes": kv_bytes,
                        "kernel_s": kernel_s / args.steps})
    while engine.has_unfinished():
        engine.step()
    return out


def _timing_decode_kernel(run):
    """run() with the in-place CPU decode kernel's calls timed (no profiler): (run's value, seconds in it)."""
    import jobrunner.kernels.attention.attention as dispatch
    real, spent = dispatch.decode_attention_cpu, [0.0]

    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return real(*a, **kw)
        finally:
            spent[0] += time.perf_counter() - t
    dispatch.decode_attention_cpu = timed
    try:
        return run(), spent[0]
    finally:
        dispatch.decode_attention_cpu = real


def _time_or_profile(engine, profile: bool, walls: list) -> dict | None:
    """One step: profiled (its figures returned), or timed (its wall appended to `walls`)."""
    if profile:
        return _profile(engine, 1)
    t = time.perf_counter()
    engine.step()
    walls.append(time.perf_counter() - t)
    return None


def prefill_phase(engine, args) -> dict:
    """Steps whose whole batch is one prompt chunk of --chunk tokens."""
    vocab = engine.rt.model_config.vocab_size
    walls, profiled = [], None
    for k in range(args.steps + 1):
        for r in _requests(1, args.chunk, 1, vocab, args.seed + 100 + k):
            engine.add_request(r)
        profiled = _time_or_profile(engine, k == args.steps, walls) or profiled
        while engine.has_unfinished():
            engine.step()
    return _with_python({"wall_s": statistics.median(walls), **profiled})


def shared_prefix_phase(engine, args) -> dict:
    """The first step after --seqs rows sharing a cached --prefix-len prefix arrive, each with --prompt-len
    tokens of its own: as many chunks as the step's token budget packs, each over the cached prefix."""
    vocab = engine.rt.model_config.vocab_size
    walls, profiled = [], None
    for k in range(args.steps + 1):
        seed = args.seed + 200 + k
        shared = args.prefix_len
        for r in _requests(1, shared, 1, vocab, seed, shared=shared):     # caches the prefix
            engine.add_request(r)
        while engine.has_unfinished():
            engine.step()
        for r in _requests(args.seqs, shared + args.prompt_len, 1, vocab, seed, shared=shared):
            engine.add_request(r)
        before = engine.counters()
        profiled = _time_or_profile(engine, k == args.steps, walls) or profiled
        tokens = (engine.counters() - before).tokens_computed
        while engine.has_unfinished():
            engine.step()
    return _with_python({"wall_s": statistics.median(walls), "tokens": tokens, **profiled})


def _with_python(res: dict) -> dict:
    """The step's wall (unprofiled) less its ops' own time (profiled): the host's Python between ops."""
    res["groups"]["Python between ops"] = max(0.0, res["wall_s"] - sum(res["groups"].values()))
    return res


def print_phase(title: str, res: dict, flops: float) -> None:
    wall = res["wall_s"]
    print(f"\n### {title}: {wall * 1e3:.1f} ms a step ({flops / wall / 1e9:.1f} GFLOP/s of the model's matmuls), "
          f"{res['profiled_wall_s'] * 1e3:.1f} ms profiled\n")
    print("| part | ms a step | share |\n|---|---|---|")
    total = sum(res["groups"].values())
    for group, t in sorted(res["groups"].items(), key=lambda kv: -kv[1]):
        print(f"| {group} | {t * 1e3:.1f} | {100 * t / total:.0f}% |")
    if "bandwidth" in res:
        need = res["weight_bytes"] + res["kv_bytes"]
        bound = need / res["bandwidth"]
        print(f"\nBytes a step must read: weights {res['weight_bytes'] / 1e6:.0f} MB + K and V {res['kv_bytes'] / 1e6:.0f} "
              f"MB; at the {res['bandwidth'] / 1e9:.1f} GB/s a 1 GiB read runs at here, {bound * 1e3:.1f} ms: "
              f"the step takes {wall / bound:.2f}x its bytes-read bound")
    if res.get("peak_flops"):       # none where no matmul recorded its shapes (the C weight kernels' calls)
        # the linears at the rate a prefill chunk's reach (or their weights' reading, if slower), then K and V read
        linears = max(flops / res["peak_flops"], res["weight_bytes"] / res["bandwidth"])
        both = linears + res["kv_bytes"] / res["bandwidth"]
        print(f"With arithmetic: the linears at the {res['peak_flops'] / 1e9:.0f} GFLOP/s a prefill chunk's matmuls reach "
              f"here take {linears * 1e3:.1f} ms at least, K and V's reading {res['kv_bytes'] / res['bandwidth'] * 1e3:.1f} ms: "
              f"the step takes {wall / both:.2f}x that bound")
    if "kv_bytes" in res:
        attention, kernel = res["groups"].get("attention", 0.0), res["kernel_s"]
        mb = res["kv_bytes"] / 1e6
        print(f"\nDecode attention read {mb:.0f} MB of K and V a step: in {attention * 1e3:.1f} ms profiled "
              f"({mb / 1e3 / max(attention, 1e-9):.1f} GB/s); the in-place kernel's calls, timed unprofiled: "
              + (f"{kernel * 1e3:.1f} ms ({mb / 1e3 / kernel:.1f} GB/s)" if kernel else "none (the gather path served)"))
    print("\n| matmul | ms a step | GFLOP/s |\n|---|---|---|")
    for shape, m in sorted(res["matmuls"].items(), key=lambda kv: -kv[1]["ms"]):
        print(f"| {shape} | {m['ms']:.1f} | {m['gflops']:.1f} |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-m", "--model", default="smollm2-135m-instruct", help="a model jobrunner loads")
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--prefix-len", type=int, default=0,
                   help="also profile a step of --seqs chunks of --prompt-len tokens over a cached prefix this long")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quantization", default="none")
    p.add_argument("--dtype", default="auto", help="the engine's compute dtype (float32, bfloat16; auto: float32 on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)

    from jobrunner.engine.config.engine_config import EngineConfig
    from jobrunner.engine.core.engine import Engine
    from jobrunner.models.known import resolve_model

    model = resolve_model(args.model)
    engine = Engine(EngineConfig(model=model, device="cpu", num_threads=args.threads, quantization=args.quantization,
                                 dtype=args.dtype,
                                 max_num_batched_tokens=max(2048, args.chunk)))
    try:
        params = _matmul_params(engine)
        results = {"decode": decode_phase(engine, args), "prefill": prefill_phase(engine, args)}
        results["decode"].update(weight_bytes=_weight_bytes_read(engine), bandwidth=read_bandwidth())
        if args.prefix_len:
            results["shared_prefix"] = shared_prefix_phase(engine, args)
    finally:
        engine.close()
    import torch
    print(f"model {model}, {torch.get_num_threads()} threads, dtype {args.dtype}, quantization {args.quantization}")
    results["decode"]["peak_flops"] = _matmul_rate(results["prefill"])
    print_phase(f"decode step, {args.seqs} sequences at ~{args.prompt_len} tokens", results["decode"],
                2 * params * args.seqs)
    print_phase(f"prefill chunk of {args.chunk} tokens", results["prefill"], 2 * params * args.chunk)
    if args.prefix_len:
        res = results["shared_prefix"]
        print_phase(f"prefill step over a cached {args.prefix_len}-token prefix: {res['tokens']} new tokens "
                    f"in chunks of {args.prompt_len}", res, 2 * params * res["tokens"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **results}, f, indent=1)


def _matmul_rate(res: dict) -> float:
    """FLOP/s of a phase's matmuls together (profiled): what the linears reach on this machine at a prefill's M."""
    mm = res["matmuls"].values()
    return sum(m["gflops"] * 1e9 * m["ms"] for m in mm) / max(sum(m["ms"] for m in mm), 1e-9)


def _weight_bytes_read(engine) -> int:
    """Bytes of every linear's weight and the output head's (what a decode step reads once at best; the
    embedding's rows are gathered, not read whole, unless it is the tied head)."""
    import torch
    from jobrunner.engine.quant.linear import QuantLinear
    from jobrunner.kernels.ops import PackedLinear
    seen, total = set(), 0
    for m in engine.rt.model.modules():
        if isinstance(m, (torch.nn.Linear, PackedLinear, QuantLinear)):
            for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
                if id(t) not in seen and t is not getattr(m, "bias", None):     # a tied head's weight: once
                    seen.add(id(t))
                    total += t.numel() * t.element_size()
    return total


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes a second this process reads a float32 tensor of `gib` GiB at (torch's sum, its threads; best of)."""
    import torch
    x = torch.ones(int(gib * (1 << 30)) // 4)
    x.sum()
    best = min(_timed(x.sum) for _ in range(repeats))
    return x.numel() * 4 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _matmul_params(engine) -> int:
    """Weights a token multiplies: every linear layer's (plain, packed or quantized) plus the output head's."""
    import torch
    from jobrunner.engine.quant.linear import QuantLinear
    from jobrunner.kernels.ops import PackedLinear
    return sum(m.in_features * m.out_features for m in engine.rt.model.modules()
               if isinstance(m, (torch.nn.Linear, PackedLinear, QuantLinear)))


if __name__ == "__main__":
    main()
