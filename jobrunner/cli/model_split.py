"""`jobrunner validate`'s account of how a model splits over --tensor-parallel ranks and whether it
fits: each rank's heads, KV heads, MLP columns, vocabulary rows and experts, its weight bytes from the
model's config (no weight is read), and the memory of the devices it would run on.

The shapes come from the engine's own ShardPlan and check_split (engine/parallel/shards.py), so the
report says what the engine will build (experts: whole or by columns, as moe_split auto picks). The bytes are an estimate: decoder linears, experts,
embedding and lm_head at the precision chosen; norms, biases and quantization scales are left out
(a percent or two).
"""
from __future__ import annotations

import os

from jobrunner import engine       # engine.check_split and rank_plan: the engine's shard plans (torch) load at their first read
from jobrunner.engine import CPU_KV_CACHE_BYTES, ConfigError
from jobrunner.config.job import JobConfigError
from jobrunner.config.sections import EngineOptions, ParallelOptions
from jobrunner.pipeline.precision import on_gpu
from jobrunner.parallel.world import data_parallel_size

GiB = 2**30
# bytes per weight of the decoder linears (and experts) and of the embedding and lm_head, by scheme
# (engine/quant/apply.py's table); None: the float dtype's
_QUANT_BYTES = {"none": (None, None), "int8": (1.0, 1.0), "int4": (0.5, 1.0), "w8a8": (1.0, 1.0),
                "w4a8": (0.5, 1.0),                 "fp8": (1.0, None)}
_FLOAT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def check_model_split(model_config, size: int) -> None:
    """JobConfigError (exit 2) when the model's heads or MLP widths don't split over `size` ranks."""
    try:
        engine.check_split(model_config, size)
    except ConfigError as e:
        raise JobConfigError(str(e)) from None


def split_lines(model_config, size: int) -> dict[str, str]:
    """What each of `size` ranks holds, in words (a rank's share; every rank holds the same)."""
    mc = model_config
    plan = engine.rank_plan(mc, size)
    kv = "split" if mc.num_kv_heads >= size else f"replicated: each kept by {size // mc.num_kv_heads} ranks"
    lines = {
        "attention heads per rank": f"{plan.heads} of {mc.num_heads}",
        "KV heads per rank": f"{plan.kv_heads} of {mc.num_kv_heads} ({kv})",
        "vocab rows per rank": f"{plan.vocab_part} of {mc.vocab_size} (embedding and lm_head)",
    }
    if mc.moe is None or _dense_layers(mc):
        lines["MLP columns per rank"] = f"{plan.width(mc.intermediate_size)} of {mc.intermediate_size}"
    if mc.moe is not None:
        moe = mc.moe
        first, count = plan.experts
        experts = (f"{count} of {moe.num_experts} whole (rank r: {count} x r to {count} x r + {count - 1})"
                   if plan.experts_whole else
                   f"all {moe.num_experts} on every rank, each split by columns: "
                   f"{plan.expert_width()} of {moe.intermediate_size}")
        if moe.shared_intermediate_size:
            experts += (f"; shared expert {plan.width(moe.shared_intermediate_size)} of "
                        f"{moe.shared_intermediate_size}")
        lines["experts per rank"] = experts
    return lines


def weight_bytes_per_rank(model_config, size: int, float_bytes: int, quantization: str) -> int:
    """Estimated weight bytes one of `size` ranks holds (size 1: the whole model)."""
    mc = model_config
    plan = engine.rank_plan(mc, size)
    linear_b, embed_b = _QUANT_BYTES.get(quantization.split(":")[0], (None, None))
    linear_b, embed_b = linear_b or float_bytes, embed_b or float_bytes
    h, d = mc.hidden_size, mc.head_dim
    attention = h * (plan.heads * d + 2 * plan.kv_heads * d) + plan.heads * d * h
    dense_mlp = 3 * h * plan.width(mc.intermediate_size)
    linears = router = 0.0
    for layer in range(mc.num_layers):
        linears += attention
        if mc.moe is not None and mc.moe.is_sparse(layer):
            moe = mc.moe
            linears += plan.experts[1] * 3 * h * plan.expert_width()
            linears += 3 * h * plan.width(moe.shared_intermediate_size)
            router += h * moe.num_experts           # replicated, in the float dtype
        else:
            linears += dense_mlp
    vocab = plan.vocab_part * h * (1 if mc.tie_word_embeddings else 2)
    return int(linears * linear_b + vocab * embed_b + router * float_bytes)


def _dense_layers(mc) -> bool:
    return any(not mc.moe.is_sparse(i) for i in range(mc.num_layers))


def fit_report(engine: EngineOptions, parallel: ParallelOptions, model_config, resolved) -> dict[str, str]:
    """The split (with --tensor-parallel > 1), the weights per rank, the memory of the devices they
    would go on, and whether they fit. JobConfigError when the model does not split."""
    size = parallel.tensor_parallel
    check_model_split(model_config, size)
    device, dtype, quantization = _precision(engine.device, resolved)
    per_rank = weight_bytes_per_rank(model_config, size, _FLOAT_BYTES[dtype], quantization)
    precision = dtype + (f", {quantization} weights" if quantization != "none" else "")
    report: dict[str, str] = {}
    if size > 1:
        report["tensor_parallel"] = f"{size} ranks (processes{', GPUs' if device == 'cuda' else ''})"
        report.update(split_lines(model_config, size))
    report["weights per rank" if size > 1 else "weights"] = f"about {_gib(per_rank)} ({precision})"
    report.update(_memory(engine, parallel, device, per_rank))
    return report


def _precision(device: str, resolved) -> tuple[str, str, str]:
    """('cuda' | 'cpu', the float dtype's name, the quantization), as jobrunner.job.resolve found them
    (`device`: the job's --device)."""
    dtype = resolved.float_dtype
    if dtype not in _FLOAT_BYTES:
        raise JobConfigError(f"--dtype must be auto, {', '.join(_FLOAT_BYTES)}, not {dtype!r}")
    return "cuda" if on_gpu(device) else "cpu", dtype, resolved.quantization


def _memory(engine: EngineOptions, parallel: ParallelOptions, device: str, per_rank: int) -> dict[str, str]:
    """Each GPU's free memory against a rank's weights; on CPU, the host's against all processes'."""
    size = parallel.tensor_parallel
    if device == "cuda":
        import torch        # torch.cuda's memory figures: on a GPU only
        base = int(engine.device.split(":")[1]) if engine.device.startswith("cuda:") else 0
        count = torch.cuda.device_count()
        gpus = list(range(base, min(count, base + size)))
        if len(gpus) < size:
            return {"fits": f"no: {size} GPUs needed from cuda:{base}, {count} visible"}
        free = {i: torch.cuda.mem_get_info(i) for i in gpus}
        tight = min(gpus, key=lambda i: free[i][0])
        lines = {"device memory": ", ".join(f"cuda:{i} {_gib(f)} free of {_gib(t)}" for i, (f, t) in free.items())}
        # the KV cache needs room beside the weights: a tenth of the GPU at least
        ok = per_rank <= free[tight][0] - free[tight][1] // 10
        lines["fits"] = (f"yes: {_gib(per_rank)} of weights per GPU, the rest of its free memory for the KV cache"
                         if ok else f"no: {_gib(per_rank)} of weights per GPU, {_gib(free[tight][0])} free on "
                         f"cuda:{tight}; raise --tensor-parallel or quantize (--quantization int8, int4 or fp8)")
        return lines
    processes = size * data_parallel_size(engine, parallel)
    avail, total = _host_memory()
    if avail is None:
        return {"device memory": "CPU: host memory unknown"}
    kv = engine.kv_cache_memory or CPU_KV_CACHE_BYTES        # each process's KV cache (the engine's CPU budget)
    need = processes * (per_rank + kv)
    what = f"{_gib(per_rank)} of weights + {_gib(kv)} of KV cache"
    what = f"{processes} processes x ({what})" if processes > 1 else what
    return {"device memory": f"CPU: host memory {_gib(avail)} available of {_gib(total)}, shared by every process",
            "fits": f"yes: {what}" if need <= avail else
                    f"no: {what}, {_gib(avail)} available; lower --kv-cache-memory or quantize"}


def _host_memory() -> tuple[int | None, int | None]:
    """(available, total) bytes of host memory: /proc/meminfo's MemAvailable and MemTotal."""
    found = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemAvailable", "MemTotal"):
                    found[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if len(found) == 2:
        return found["MemAvailable"], found["MemTotal"]
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    except (ValueError, OSError, AttributeError):
        return None, None


def _gib(n: int) -> str:
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / 2**20:.1f} MiB"
