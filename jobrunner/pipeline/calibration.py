"""`--quantization auto` on CPU, decided by measurement: once per model and machine, kept in the cache.

Each mode the engine accepts here is loaded in turn (one engine at a time, closed before the next)
and measured the same way:

    perplexity   of calibration_text.txt (the opening of Conan Doyle's "A Scandal in Bohemia", 1891,
                 public domain; ~550 tokens of the default model) in one score request (score_from=1);
    tokens/s     of ROWS greedy rows of PROMPT_TOKENS prompt tokens each (distinct), NEW_TOKENS new each
                 (ignore_eos), prefill included, after a warm-up: the best of REPEATS by the wall clock
                 (tokens per CPU-second beside it; the choice takes the wall clock, what a job gets).
                 Each repeat computes on the cores free when it starts, as a job's thread governor
                 would give it (--threads N: N), and the cores other processes kept busy meanwhile
                 are recorded ("other_load").

Perplexity does not depend on the machine's load; speed does. So a calibration on a loaded machine can
understate a mode's speed and choose a slower mode that passes the same 1% test, never one that fails
it; JOBRUNNER_CALIBRATION=refresh measures again when the machine is quiet.

The choice (`pick`) is the fastest mode whose perplexity is within TOLERANCE of float32's, float32
when none is, ties to the more exact. Candidates are what the engine runs on this CPU, not what its
flags promise: bfloat16 without AMX/AVX512_BF16 or w8a8 without VNNI is measured too and wins only by
the same test (AVX2's 7-bit fbgemm activations measured +5.9% on the default model: it fails it). The
engine picks w8a8's GEMM itself (torch._int_mm where exact, else fbgemm with row scales:
engine/quant/apply.py w8a8_backend) and has no switch between them, so w8a8 is one candidate.

The figures are cached under <cache>/calibration/<key>.json (engine.cache_root()); the key is the
checkpoint's content (jobrunner/cache/identity.py), the CPU's name, flags and cores, torch's version,
the engine's NUMERICS_VERSION and this module's CALIBRATION_VERSION; a later job reads them and loads no
engine. JOBRUNNER_CALIBRATION=off takes the flag rule (jobrunner/pipeline/precision.py) without measuring;
=refresh measures again. A dry resolve (`jobrunner validate`, `jobrunner.generate`) measures nothing: the
cached figures if there are any, else the flag rule ("auto: calibrated at first run"). A torchrun rank
takes the flag rule (each rank resolves for itself: measurements or caches could differ between nodes,
the flags of one machine class cannot). Our own data-parallel workers and Ray workers get the
launcher's Resolved, record and all, and resolve nothing.

A record (the Resolved's `calibration`, the manifest's "calibration") is plain JSON: the mode and the
dtype and quantization it stands for, why, where it came from ("measured", "cache", "flags"), each mode's
figures, the modes skipped and why, the machine, and how to ask for exactness (EXACT).
"""
from __future__ import annotations

import gc
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path

from jobrunner import engine
from jobrunner.engine import ConfigError, EngineConfig, EngineFailure, ModelError, Request, SamplingParams
from jobrunner.cache.identity import checkpoint_identity
from jobrunner.pipeline.precision import BF16_FLAGS, VNNI_FLAGS, auto_precision, cpu_flags, cpu_name
from jobrunner.output.layout import output_fs
from jobrunner.output.manifest import load_manifest
from jobrunner.common.storage import atomic_write, url_fs
from jobrunner.common.threads import OTHER_BUSY_CORE, OtherLoad, free_cores

log = logging.getLogger("jobrunner")

ENV = "JOBRUNNER_CALIBRATION"       # off: the flag rule, nothing measured; refresh: measure again
EXACT = "--dtype float32 --quantization none"
TOLERANCE = 0.01                    # a mode's perplexity at most 1% over float32's
CALIBRATION_VERSION = 6             # the text, the workload or the figures' meaning changed: measure again
                                    # (4: decode attention in place for bfloat16 too, issue 47 item 3;
                                    # 5: the int4 candidate for GGUF files shipped 4-bit, issue 62 item 2;
                                    # 6: the w4a8 candidate beside it)
# mode -> (EngineConfig.dtype, EngineConfig.quantization), the more exact first (ties go to it);
# dtype auto is float32 on CPU, as the flag rule says it. int4 and w4a8 (int4's weights times int8
# activations): candidates only where the weights are shipped 4-bit (engine.ships_int4: GGUF Q4_0/Q4_1, the
# default model's Q4_1; a GPTQ, AWQ or W4A16 checkpoint: w4a8 only), computed on as shipped, so int4's
# perplexity is the checkpoint's own and w4a8's adds only its activations' rounding; elsewhere both would be
# a new rounding of float weights.
MODES = {"float32": ("auto", "none"), "bfloat16": ("bfloat16", "none"), "w8a8": ("auto", "w8a8"),
         "int4": ("auto", "int4"), "w4a8": ("auto", "w4a8")}
FLOAT_MODES = ("float32", "bfloat16")       # what splits over --tensor-parallel ranks (w8a8 does not)
# A checkpoint quantized int4 weight-only (GPTQ, AWQ, W4A16): float32 runs it as shipped (its perplexity the
# base), w4a8 its linears with int8 activations; w8a8 and int4 would quantize it again (the engine refuses).
SHIPPED_MODES = ("float32", "bfloat16", "w4a8")
# A job's shape, not a toy's: with 8-token prompts and 16 new, bfloat16 timed 1.3x float32 on an AVX-512
# EPYC, yet ran the benchmark suite's jobs 1.3-1.6x slower (its attention and elementwise ops, which short
# contexts hide); at 128 + 32 the calibration ranks the modes as those jobs do.
ROWS, PROMPT_TOKENS, NEW_TOKENS, WARMUP_TOKENS, REPEATS = 16, 128, 32, 4, 2
TEXT_TOKENS = 1024                  # the scored text at most (the default model's is ~550)
KV_CACHE_BYTES = 256 << 20          # ROWS x 160 tokens and the text, with room: not the job's 2 GiB
SHOWN_FLAGS = ("avx2", "fma", "avx512f", *VNNI_FLAGS, *BF16_FLAGS, "amx_int8", "amx_tile")
TEXT_FILE = Path(__file__).with_name("calibration_text.txt")


def pick(figures: Mapping[str, Mapping], tolerance: float = TOLERANCE, allowed=tuple(MODES)) -> str:
    """The fastest of `allowed` whose perplexity is at most (1 + tolerance) x float32's; float32 when
    none is, or float32 has no figure. figures: mode -> {"perplexity", "tokens_per_s"} (None: not
    measurable). Equal speeds go to the mode listed first in MODES (the more exact)."""
    base = (figures.get("float32") or {}).get("perplexity")
    if not _finite(base):
        return "float32"
    limit = base * (1 + tolerance)
    passing = [m for m in MODES if m in allowed and m in figures and _finite(figures[m].get("perplexity"))
               and figures[m]["perplexity"] <= limit and _finite(figures[m].get("tokens_per_s"))]
    return max(passing, key=lambda m: figures[m]["tokens_per_s"], default="float32")    # max: the first of equals


def cpu_auto(model: str, threads: int | None, *, measure: bool = True, float_only: bool = False,
             packed_weights: bool = True, shipped: bool = False) -> dict:
    """The record of auto's choice for `model` on this CPU: the cached figures, else measured now
    (`measure`; on `threads`, None: the free cores), else the flag rule. float_only: --tensor-parallel,
    where w8a8 does not split. packed_weights: the job's (float32's speed depends on it). shipped: a checkpoint
    quantized int4 weight-only, chosen among SHIPPED_MODES (as shipped where nothing is measured)."""
    allowed = FLOAT_MODES if float_only else SHIPPED_MODES if shipped else tuple(MODES)
    setting = os.environ.get(ENV, "on").strip().lower()
    fallback = as_shipped if shipped else by_flags
    if setting == "off":
        return fallback(f"{ENV}=off", float_only)
    if _torchrun_rank():        # each rank resolves: caches or measurements could differ between nodes, flags cannot
        return fallback("a torchrun rank measures nothing and reads no cache", float_only)
    if not TEXT_FILE.is_file():     # an install without the package's data
        return fallback(f"{TEXT_FILE.name} is not installed", float_only)
    path = cache_path(model, packed_weights)
    figures = read_cache(path) if path is not None and setting != "refresh" else None
    source = "cache"
    if figures is None:
        if not measure:
            return fallback("auto: calibrated at first run", float_only)
        figures, source = measure_all(model, threads, packed_weights, shipped), "measured"
        if "float32" not in figures["modes"]:
            return by_flags(f"float32 could not be measured ({figures['skipped'].get('float32')})", float_only)
        if path is not None:
            write_cache(path, figures)
    mode = pick(figures["modes"], allowed=allowed)
    dtype, quantization = MODES[mode]
    why = (f"fastest within {TOLERANCE:.0%} of float32's perplexity" if mode != "float32"
           else f"no mode within {TOLERANCE:.0%} of float32's perplexity ran faster")
    if float_only and pick(figures["modes"]) not in FLOAT_MODES:
        why += " of the float modes (w8a8 does not split over --tensor-parallel ranks)"
    if shipped and mode == "float32":
        why += ": its own int4 weights with float32 activations, as shipped"
    return {**figures, "mode": mode, "dtype": dtype, "quantization": quantization, "why": why, "source": source,
            "tolerance": TOLERANCE, "exact": EXACT, **({"cache_file": str(path)} if path is not None else {})}


def by_flags(reason: str, float_only: bool = False) -> dict:
    """The record of the flag rule's choice (jobrunner.job.precision.auto_precision), nothing measured."""
    dtype, quantization, why = auto_precision("cpu", "auto")
    if quantization == "w8a8" and float_only:
        quantization, why = "none", f"{why}, but w8a8 does not split over --tensor-parallel ranks"
    mode = next(m for m, dq in MODES.items() if dq == (dtype, quantization))
    return {"mode": mode, "dtype": dtype, "quantization": quantization, "why": f"{reason}; by flags: {why}",
            "source": "flags", "modes": {}, "machine": machine(), "tolerance": TOLERANCE, "exact": EXACT}


def as_shipped(reason: str, float_only: bool = False) -> dict:
    """The record of a shipped int4 checkpoint run as shipped, nothing measured (`reason`: why not)."""
    dtype, quantization = MODES["float32"]
    return {"mode": "float32", "dtype": dtype, "quantization": quantization, "why": f"{reason}; as shipped",
            "source": "flags", "modes": {}, "machine": machine(), "tolerance": TOLERANCE, "exact": EXACT}


def summary(record: Mapping) -> str:
    """The one log line of a record: the choice, each mode's figures, the machine, how to be exact."""
    base = (record.get("modes", {}).get("float32") or {}).get("perplexity")
    figures = "; ".join(_figure_text(m, record["modes"][m], base) for m in MODES if m in record.get("modes", {}))
    skipped = "; ".join(f"{m} not run: {why}" for m, why in record.get("skipped", {}).items())
    took = f" in {record['seconds']:.1f} s" if record.get("source") == "measured" else ""
    kept = "kept from the output it resumes, " if record.get("resumed") else ""
    m = record.get("machine", {})
    return (f"{record['mode']} (dtype {record['dtype']}, quantization {record['quantization']}): {record['why']}"
            f" [{kept}{record['source']}{took}{': ' if figures else ''}{figures}{'; ' if skipped else ''}{skipped}]"
            f" on {m.get('cpu') or 'this CPU'} ({' '.join(m.get('flags', ())) or 'no AVX flags'}); "
            f"exact: {record['exact']}")


def _figure_text(mode: str, f: Mapping, base) -> str:
    ppl = f.get("perplexity")
    rel = f" ({(ppl / base - 1):+.1%})" if mode != "float32" and _finite(ppl) and _finite(base) else ""
    busy = f.get("other_load")
    load = f" (other load {busy:.1f} cores)" if _finite(busy) and busy >= OTHER_BUSY_CORE else ""
    return f"{mode} ppl {_num(ppl)}{rel} {_num(f.get('tokens_per_s'))} tok/s{load}"


def output_record(output_url: str) -> dict | None:
    """The calibration record of the output a job resumes (its manifest's "calibration"), None when there
    is none (a new output, one begun before records, one not ours: checks.check_output says so)."""
    try:
        fs, root = output_fs(output_url)
        record = (load_manifest(fs, root) or {}).get("calibration")
    except Exception:  # noqa: BLE001 - an unreadable output is check_output's to report, not ours
        return None
    return record if isinstance(record, dict) and record.get("mode") in MODES else None


def output_begun(output_url: str) -> bool:
    """Whether a job has written the output's manifest (False where it cannot be read: check_output's to say)."""
    try:
        fs, root = output_fs(output_url)
        return load_manifest(fs, root) is not None
    except Exception:  # noqa: BLE001 - as output_record
        return False


# --- measuring -------------------------------------------------------------------------------


def measure_all(model: str, threads: int | None, packed_weights: bool = True, shipped: bool = False) -> dict:
    """Every mode's figures, one engine at a time: {"modes": {mode: figures}, "skipped": {mode: why},
    "machine", "seconds", "measured_at"}. A mode the engine refuses (or fails to run) is skipped. shipped:
    a checkpoint quantized int4 weight-only (SHIPPED_MODES)."""
    t0 = time.perf_counter()
    modes, skipped = {}, {}
    if shipped:
        skipped["w8a8"] = skipped["int4"] = "the checkpoint is quantized int4 already: float32 runs it as shipped"
    elif not engine.ships_int4(model):
        skipped["int4"] = skipped["w4a8"] = "weights not shipped 4-bit (GGUF Q4_0/Q4_1, GPTQ, AWQ, W4A16)"
    for mode in (m for m in MODES if m not in skipped):
        try:
            modes[mode] = measure_mode(model, mode, threads, packed_weights)
        except (ConfigError, ModelError, EngineFailure, RuntimeError, NotImplementedError, OSError) as e:
            skipped[mode] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            log.info("calibration: %s not run (%s)", mode, skipped[mode])
        gc.collect()        # the last engine's weights, before the next loads
    return {"modes": modes, "skipped": skipped, "machine": machine(), "seconds": round(time.perf_counter() - t0, 2),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def measure_mode(model: str, mode: str, threads: int | None, packed_weights: bool = True) -> dict:
    """One mode's figures: {"perplexity", "tokens_per_s", "cpu_tokens_per_s", "threads", "other_load",
    "load_s"} (the module doc). threads: fixed, or None: the cores free at each repeat's start."""
    dtype, quantization = MODES[mode]
    config = EngineConfig(model=model, dtype=dtype, device="cpu", quantization=quantization,
                          kv_cache_memory=KV_CACHE_BYTES, num_threads=threads or free_cores(),
                          packed_weights=packed_weights)
    t0 = time.perf_counter()
    with engine.Engine(config) as eng:
        load_s = time.perf_counter() - t0
        ids = list(eng.tokenizer.encode(calibration_text()))[:min(TEXT_TOKENS, eng.info.max_model_len - 1)]
        out = eng.generate([Request("calibration-text", ids, SamplingParams(max_tokens=0), score_from=1)])[0]
        lps = out.prompt_logprobs or []
        ppl = math.exp(-sum(lps) / len(lps)) if lps else None
        prompts = [ids[(i * PROMPT_TOKENS) % (len(ids) - PROMPT_TOKENS):][:PROMPT_TOKENS] for i in range(ROWS)]
        _decode(eng, prompts, WARMUP_TOKENS, "warm")
        other, runs = OtherLoad(), []
        for r in range(REPEATS):
            n = threads or free_cores()
            eng.set_threads(n)
            runs.append((*_decode(eng, prompts, NEW_TOKENS, f"r{r}"), n))
        busy = other.cores()
    best = max(runs)        # by the wall clock
    return {"perplexity": _round(ppl, 6), "tokens_per_s": _round(best[0]),
            "cpu_tokens_per_s": _round(max(c for _, c, _ in runs)), "threads": best[2],
            "other_load": None if busy is None else round(busy, 2), "load_s": round(load_s, 2)}


def _decode(eng, prompts: list[list[int]], new: int, tag: str) -> tuple[float, float]:
    """(tokens/s by the wall clock, tokens per CPU-second of this process) of one greedy batch."""
    reqs = [Request(f"calibration-{tag}-{i}", p, SamplingParams(max_tokens=new, ignore_eos=True))
            for i, p in enumerate(prompts)]
    w0, c0 = time.perf_counter(), time.process_time()
    outs = eng.generate(reqs)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    n = sum(len(o.token_ids) for o in outs)
    return n / max(wall, 1e-9), n / max(cpu, 1e-9)


def calibration_text() -> str:
    return TEXT_FILE.read_text(encoding="utf-8")


def machine() -> dict:
    """The machine the figures come from: the CPU's name, its flags that decide the modes, cores, torch."""
    import torch        # its version: the engine has loaded it, or will

    flags = cpu_flags()
    return {"cpu": cpu_name(), "flags": [f for f in SHOWN_FLAGS if f in flags], "cores": os.cpu_count(),
            "torch": torch.__version__}


# --- the cache -------------------------------------------------------------------------------


def cache_path(model: str, packed_weights: bool = True) -> Path | None:
    """<cache>/calibration/<key>.json for `model` on this machine; None (with a warning) when the
    checkpoint cannot be identified (then nothing is cached: each job measures)."""
    import torch

    try:
        checkpoint = checkpoint_identity(model)
    except Exception as e:  # noqa: BLE001 - an unidentifiable model is measured, never cached
        log.warning("calibration not cached: cannot identify the model %s (%s)", model, e)
        return None
    key = {"checkpoint": checkpoint, "cpu": cpu_name(), "flags": sorted(cpu_flags()), "cores": os.cpu_count(),
           "torch": torch.__version__, "numerics": engine.NUMERICS_VERSION, "calibration": CALIBRATION_VERSION,
           "text": hashlib.blake2b(calibration_text().encode(), digest_size=8).hexdigest(),
           **({} if packed_weights else {"packed_weights": False})}
    text = json.dumps(key, sort_keys=True, separators=(",", ":"))
    return engine.cache_root() / "calibration" / f"{hashlib.blake2b(text.encode(), digest_size=16).hexdigest()}.json"


def read_cache(path: Path) -> dict | None:
    """The figures cached at path; None when there are none or they cannot be read (measured again)."""
    try:
        figures = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("calibration cache %s unreadable (%s): measuring again", path, e)
        return None
    return figures if isinstance(figures, dict) and isinstance(figures.get("modes"), dict) else None


def write_cache(path: Path, figures: dict) -> None:
    """Best effort: a cache that cannot be written only means the next job measures again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fs, p = url_fs(str(path))
        atomic_write(fs, p, json.dumps(figures, indent=1, sort_keys=True).encode())
    except OSError as e:
        log.warning("calibration not cached at %s (%s)", path, e)


def _torchrun_rank() -> bool:
    """A rank of a torchrun (srun, PyTorchJob) world over 1; not our own launcher's workers, which get
    the launcher's Resolved and resolve nothing (jobrunner/parallel/world.distributed_env's rule)."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return False
    return world > 1 and "RANK" in os.environ and not os.environ.get("JOBRUNNER_LAUNCHER_PID")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _round(x: float | None, digits: int = 4) -> float | None:
    """A figure to `digits` significant digits; a non-finite one as None (the record stays strict JSON)."""
    return float(f"{x:.{digits}g}") if _finite(x) else None


def _num(x) -> str:
    return f"{x:.4g}" if _finite(x) else "n/a"
